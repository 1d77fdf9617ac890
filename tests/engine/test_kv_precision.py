"""Quantised KV pages end to end (`EngineConfig.kv_precision`): the pool holds the configured
format, chunk compression and decode write it, attention reads it, and greedy output stays close
to the bf16 pool's."""

import numpy as np
import pytest

from tangram_jax import LLM, kv_quant
from tangram_jax.engine.config import EngineConfig, EngineConfigError
from tangram_jax.engine.decode_step import decode_split_map
from tangram_jax.sampling import SamplingParams

from tiny_engine import tiny_engine_config

QUANTISED = ("k8v8", "k8v4", "k4v2")


def test_kv_precision_is_validated():
    with pytest.raises(EngineConfigError, match=r"kv_precision must be one of .*'k2v2'"):
        EngineConfig(kv_precision="k2v2")
    assert EngineConfig(kv_precision="k8v4").kv_precision == "k8v4"


def _greedy_ids(llm_or_engine_outputs):
    return [o.outputs[0].token_ids for o in llm_or_engine_outputs]


@pytest.mark.parametrize("mode, precisions", [("tangram", kv_quant.KV_PRECISIONS),
                                               ("full", ("bf16", "k8v8"))])
def test_tiny_engine_runs_every_precision(tiny_folder, mode, precisions):
    """The tiny model: prompts over several compression chunks, decode past a page; the pool
    is of the configured format and its bytes per page fall with the bits; every page comes
    back."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=n).tolist() for n in (5, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    page_bytes, outputs = {}, {}
    for precision in precisions:
        llm = LLM(config=tiny_engine_config(tiny_folder, mode, kv_precision=precision))
        runner = llm.engine.runner
        fmt = kv_quant.page_format(precision)
        for pages, bits in ((runner.k_pages, fmt.key_bits), (runner.v_pages, fmt.value_bits)):
            assert isinstance(pages, kv_quant.QuantPages) == (bits is not None)
            assert bits is None or pages.bits == bits
        page_bytes[precision] = runner.kv_bytes_per_page
        # The decode split maps are sized for the format's program target.
        engine = llm.engine
        assert runner.split_maps == {b: decode_split_map(
            engine.layout, engine.model_config, None, engine.config.num_programs, b,
            group_size=engine.layout.group_size,
            pool_format=kv_quant.pool_format(precision))
            for b in runner.split_maps}
        if precision == "k8v4" and mode == "tangram":
            assert runner.split_maps != {b: decode_split_map(
                engine.layout, engine.model_config, None, engine.config.num_programs, b,
                group_size=engine.layout.group_size) for b in runner.split_maps}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        outputs[precision] = _greedy_ids(outs)
        assert all(len(ids) == 12 for ids in outputs[precision])
        assert llm.engine.manager.pool.num_used == 0
        # The pool holds what was written: quantised pages are not all zero codes.
        if fmt.quantised:
            assert np.asarray(runner.k_pages.scale).any()
    # bf16 pages the largest and K4V2's the smallest; K8V4's per-plane value scales cost more
    # than its 4-bit codes save at the tiny model's head_dim (the formula's order at real head
    # dims: test_kv_quant.test_page_bytes_fall_with_bits).
    assert max(page_bytes, key=page_bytes.get) == "bf16"
    assert min(page_bytes, key=page_bytes.get) == precisions[-1]
    assert len(set(page_bytes.values())) == len(page_bytes)
    # Random weights have nearly flat logits, so only 8-bit keys and values are asked to
    # repeat bf16's first tokens (the embedded model's test below asks more).
    for ids_q, ids_b in zip(outputs["k8v8"], outputs["bf16"]):
        assert ids_q[:2] == ids_b[:2], (mode, ids_q, ids_b)


# The embedded model's precision checks (here and in test_kv_tiers_serving.py): a small engine
# and two prompts whose greedy answers are stable under K8V4.
EMBEDDED_SMALL_ENGINE = dict(max_num_seqs=4, kv_cache_tokens=4096, max_model_len=1024,
                             chunk_size=32, page_size=16, max_num_batched_tokens=256)
EMBEDDED_PROMPTS = ["The capital of France is",
                    "Paul Graham wrote that the way to get startup ideas is not to try to think "
                    "of startup ideas. It's to look for problems, preferably problems you have "
                    "yourself. Question: what should you look for to get startup ideas? Answer:"]


@pytest.mark.slow
def test_embedded_model_greedy_output_stays_close_to_bf16():
    """SmolLM2-135M, tangram at ratio 0.5: K8V4 answers as bf16 does (K8V8 keeps more bits
    than K8V4 in every place, so it is not built again here); K4V2 stays on topic (the answer
    still names the city). Seen: K8V4 gave bf16's 12 tokens exactly on both prompts."""
    small, prompts = EMBEDDED_SMALL_ENGINE, EMBEDDED_PROMPTS
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = {}
    for precision in ("bf16", "k8v4", "k4v2"):
        llm = LLM(mode="tangram", ratio=0.5, kv_precision=precision, **small)
        outs[precision] = llm.generate(prompts, params, use_tqdm=False)
    base = _greedy_ids(outs["bf16"])
    for g, b in zip(_greedy_ids(outs["k8v4"]), base):
        same = next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), min(len(g), len(b)))
        assert same >= 6, (g, b)
    assert "Paris" in outs["k4v2"][0].outputs[0].text
