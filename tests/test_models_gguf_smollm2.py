"""The embedded SmolLM2-135M-Instruct GGUF, loaded by us and by transformers from the same file."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from tangram_jax.models.decoder import DenseKVCache  # noqa: E402
from tangram_jax.models.gguf_loader import read_gguf  # noqa: E402
from tangram_jax.models.registry import default_model_path, load_model  # noqa: E402
from tangram_jax.reference import generate_dense  # noqa: E402
from tangram_jax.sampling import SamplingParams  # noqa: E402

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
def ours():
    return load_model(None, use_cache=False)


def test_state_dict_matches_transformers_dequantization(hf_model):
    _, state, _ = read_gguf(default_model_path())
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(theirs) - set(state) == {"lm_head.weight"}  # tied: transformers lists the alias
    for name, value in state.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_next_token_logits_match_transformers(ours, hf_model):
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        cache = DenseKVCache.create(ours.config, 1, 64)
        logits, _ = ours.model(jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
        logits = np.asarray(logits[0])
        rel = np.abs(logits - ref).max() / np.abs(ref).max()
        assert rel < 1e-3, (prompt, rel)
        assert logits[-1].argmax() == ref[-1].argmax()


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
