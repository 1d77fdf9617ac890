"""A mixed step on the CPU path: a prefill call and decode rows of other sequences in one program
(`ModelRunner.prefill(..., decode=...)`, `_mixed_impl`) give what the two programs give (the
prefill, then the decode): logits, kept counts, tokens and the pool; the program keeps the pool in
place; warm-up compiles every mixed shape; the engine's tokens are the same."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tangram_jax import kv_quant
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
from tangram_jax.kv_layout import KVLayout
from tangram_jax.models.decoder import Decoder
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from test_runner import CONFIG, LAYOUT

FULL = KVLayout.monolithic(3, 2, 8, page_size=4, chunk_size=16)


class TwoPrograms(ModelRunner):
    """The runner with mixed steps off: a step's prefill, then its decode."""
    mixes_steps = False


def _greedy(rows):
    return dict(temperature=np.zeros(rows, np.float32), top_k=np.full(rows, -1, np.int32),
                top_p=np.ones(rows, np.float32), seeds=np.zeros(rows, np.uint32),
                steps=np.zeros(rows, np.int32))


def _pool_leaves(runner):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves((runner.k_pages, runner.v_pages))]


def commit(manager, slot, num_tokens, kept, mode):
    """A prefill piece's lengths: the layout's rule, or dynamic mode's per-input counts (the
    engine reclaims the pages above them)."""
    before = manager.lengths[slot].copy()
    manager.commit_prefill(slot, num_tokens)
    if mode == "dynamic":
        manager.lengths[slot] = before + kept


def run_mixed_steps(runner_class, mode, precision):
    """Sequence A (21 tokens) is prefilled and decodes while B (37 tokens) prefills: three
    steps of one prefill chunk of B beside A's decode row (bucket 2: a padding row on the null
    slot), then one decode step of both. Returns the steps' prefill logits and kept counts,
    every decoded token and the pool."""
    layout = LAYOUT if mode == "tangram" else FULL
    manager = KVCacheManager(layout, 96, 3, 32, model_kv_shape=(3, 2, 8))
    model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    runner = runner_class(model, CONFIG, layout, 96, manager.block_tables.shape,
                          runner_config=RunnerConfig(mode=mode, max_prefill_tokens=32),
                          pool_format=kv_quant.pool_format(precision))
    assert runner.mixes_steps == (runner_class is ModelRunner)
    rng = np.random.default_rng(5)
    a_tokens, b_tokens = rng.integers(1, 97, 21), rng.integers(1, 97, 37)
    a, b = manager.allocate_slot(), manager.allocate_slot()
    assert manager.reserve(a, len(a_tokens)) and manager.reserve(b, len(b_tokens))
    runner.update_block_tables(*manager.take_table_updates())
    for start in range(0, len(a_tokens), 16):
        a_logits, a_kept = runner.prefill_chunk(a_tokens[start:start + 16], start, a,
                                                manager.lengths[a])
        commit(manager, a, len(a_tokens[start:start + 16]), np.asarray(a_kept), mode)
    a_decoded = [int(runner.sample([a_logits], [a], *_greedy(1).values())[0])]
    null = runner.null_slot
    logits, kept = [], []
    for start in range(0, len(b_tokens), 16):
        piece = b_tokens[start:start + 16]
        assert manager.grow_for_decode(np.array([a])).all()
        runner.update_block_tables(*manager.take_table_updates())
        slots = np.array([a, null])
        decode = dict(positions=np.array([len(a_tokens) + len(a_decoded) - 1, 0]), slots=slots,
                      lengths=manager.decode_write_lengths(slots), **_greedy(2))
        out_logits, out_kept, tokens = runner.prefill([piece], [start], [b],
                                                      [manager.lengths[b]], decode=decode)
        out_kept = np.asarray(out_kept)[0]
        commit(manager, b, len(piece), out_kept, mode)
        logits.append(np.asarray(out_logits)[0])
        kept.append(out_kept)
        a_decoded.append(int(tokens[0]))
    b_decoded = [int(runner.sample([logits[-1]], [b], *_greedy(1).values())[0])]
    assert manager.grow_for_decode(np.array([a, b])).all()
    runner.update_block_tables(*manager.take_table_updates())
    slots = np.array([a, b])
    tokens = runner.decode(np.array([len(a_tokens) + len(a_decoded) - 1, len(b_tokens)]), slots,
                           manager.decode_write_lengths(slots), **_greedy(2))
    return (np.stack(logits), np.stack(kept), a_decoded + [int(tokens[0])],
            b_decoded + [int(tokens[1])], _pool_leaves(runner))


@pytest.mark.parametrize("mode,precision", [("full", "bf16"), ("tangram", "bf16"),
                                            ("dynamic", "bf16"), ("tangram", "k8v4"),
                                            ("full", "k8v4")])
def test_a_mixed_step_equals_the_prefill_then_the_decode(mode, precision):
    mixed = run_mixed_steps(ModelRunner, mode, precision)
    apart = run_mixed_steps(TwoPrograms, mode, precision)
    np.testing.assert_allclose(mixed[0], apart[0], rtol=1e-5, atol=1e-5)   # prefill logits
    np.testing.assert_array_equal(mixed[1], apart[1])                      # kept counts
    assert mixed[2] == apart[2] and mixed[3] == apart[3]                   # greedy tokens
    for got, want in zip(mixed[4], apart[4]):                              # the pool
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _serve(folder, mode, compiles, warmup=True):
    """Greedy tokens of three prompts whose prefills overlap the others' decodes, and how many
    steps ran as one mixed program; `compiles` collects XLA compilations after warm-up
    (without it, an engine compiles only the steps it runs)."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import tiny_engine_config
    engine = Engine(tiny_engine_config(folder, mode, warmup=warmup, compile_cache_dir="off"))
    mixed = []
    call_mixed = engine.runner._call_mixed
    engine.runner._call_mixed = lambda *a: mixed.append(1) or call_mixed(*a)
    rng = np.random.default_rng(2)
    compiles.clear()
    for i, n in enumerate((5, 150, 40)):
        engine.add_request(str(i), prompt_token_ids=rng.integers(0, 250, n).tolist(),
                           sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True))
    tokens = {o.request_id: list(o.outputs[0].token_ids) for o in engine.stream() if o.finished}
    return tokens, len(mixed), list(compiles)


@pytest.mark.parametrize("mode", ["full", "tangram", "dynamic"])
def test_the_engine_serves_mixed_steps_as_one_program_with_the_same_tokens(
        tiny_folder, mode, monkeypatch):
    """Engine steps that decode some sequences while others prefill run the step's last
    prefill call and the decode rows as one program (compiled at warm-up: nothing compiles
    while serving) and give the tokens of the two programs."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    tokens, mixed, compiled = _serve(tiny_folder, mode, compiles)
    assert mixed >= 3 and compiled == []
    monkeypatch.setattr(ModelRunner, "mixes_steps", property(lambda self: False))
    apart, none, _ = _serve(tiny_folder, mode, compiles, warmup=False)
    assert none == 0 and tokens == apart and all(len(t) == 10 for t in tokens.values())
