"""The embedded SmolLM2-135M-Instruct GGUF, loaded by us and by transformers from the same file."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import DenseKVCache
from tangram_jax.models.gguf_loader import read_gguf
from tangram_jax.models.hf_loader import decoder_from_state_dict
from tangram_jax.models.registry import LoadedModel, default_model_path
from tangram_jax.models.tokenizer import Tokenizer
from tangram_jax.reference import generate_dense
from tangram_jax.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """A folder holding (a link to) the embedded GGUF, as `from_pretrained(folder, gguf_file=...)` wants."""
    src = default_model_path()
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / src.name).symlink_to(src)
    return folder, src.name


@pytest.fixture(scope="module")
def hf_model(gguf_folder):
    folder, name = gguf_folder
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def gguf_contents():
    return read_gguf(default_model_path())


@pytest.fixture(scope="module")
def ours(gguf_contents):
    """What `load_model(None, use_cache=False)` builds, from the one read of the file."""
    hf_config, state, spec = gguf_contents
    config = ModelConfig.from_hf_dict(hf_config)
    return LoadedModel(config, decoder_from_state_dict(config, state), Tokenizer.from_gguf_spec(spec),
                       "smollm2", default_model_path())


def test_state_dict_matches_transformers_dequantization(gguf_contents, hf_model):
    _, state, _ = gguf_contents
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(theirs) - set(state) == {"lm_head.weight"}  # tied: transformers lists the alias
    for name, value in state.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_next_token_logits_match_transformers(ours, hf_model):
    ids = [ours.tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, ids))
    # One right-padded batch (padding at position -1) so the model runs once.
    tokens = np.zeros((len(ids), width), np.int32)
    positions = np.full((len(ids), width), -1, np.int32)
    for b, row in enumerate(ids):
        tokens[b, :len(row)] = row
        positions[b, :len(row)] = np.arange(len(row))
    cache = DenseKVCache.create(ours.config, len(ids), width)
    logits, _ = ours.model(jnp.asarray(tokens), jnp.asarray(positions), cache)
    for b, row in enumerate(ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([row])).logits[0].numpy()
        got = np.asarray(logits[b, :len(row)])
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-3, (PROMPTS[b], rel)
        assert got[-1].argmax() == ref[-1].argmax()


def test_greedy_continuation_matches_transformers(ours, hf_model):
    ids = [ours.tokenizer.encode(p) for p in PROMPTS[:2]]
    got = generate_dense(ours.model, ours.config, ids, SamplingParams(temperature=0, max_tokens=8),
                         ours.tokenizer.eos_token_ids)
    for prompt_ids, ours_ids in zip(ids, got):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=list(ours.tokenizer.eos_token_ids))
        assert ours_ids == out[0, len(prompt_ids):].tolist()
    assert "Paris" in ours.tokenizer.decode(got[0])
