"""ModelRunner on a tiny random model: the two ways of looping over layers give the same step."""

import collections
import dataclasses
import functools
import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tangram_jax.engine.config import EngineConfig, EngineConfigError
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
from tangram_jax.pallas_kernels.prefill_attention import row_alignment
from tangram_jax.kv_layout import KVLayout
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tiny_engine import prefill_then_decode

CONFIG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                     tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                     bos_token_id=None, eos_token_ids=(0,))
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, group_size=1, page_size=4,
                  chunk_size=16, head_perm=np.array([[1, 0], [0, 1], [1, 0]]),
                  group_budgets=np.array([[0.5, 1.0], [0.25, 0.75], [1.0, 0.5]]))


def run_steps(layer_loop: str, max_pages: int = 16, table_width: int | None = None):
    manager = KVCacheManager(LAYOUT, 64, 2, max_pages, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager, layer_loop)
    if table_width is not None:   # attention given only these columns of the block table
        runner._table_width = lambda max_tokens, prefill: table_width
    assert runner.layer_loop == layer_loop
    tokens = np.random.default_rng(0).integers(1, 97, 27)
    logits, decoded, _ = prefill_then_decode(runner, manager, LAYOUT, tokens)
    return logits, decoded, np.asarray(runner.k_pages)


@pytest.mark.parametrize("layer_loop", ["unrolled", "switch"])
def test_layer_loops_equal_the_scan(layer_loop):
    scan_logits, scan_tokens, scan_pages = run_steps("scan")
    logits, tokens, pages = run_steps(layer_loop)
    np.testing.assert_allclose(logits, scan_logits, rtol=1e-5, atol=1e-5)
    assert tokens == scan_tokens
    np.testing.assert_allclose(pages, scan_pages, rtol=1e-5, atol=1e-5)


def test_switch_loop_reads_the_weights_in_place():
    """The ``switch`` loop (the CPU default) picks each layer's weights by a branch per layer:
    the compiled decode step slices no weight out of a stack (the scan's per-step copies)."""
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    texts = {}
    for loop in ("scan", "switch"):
        runner = make_runner(manager, loop)
        args, static = runner._null_decode_call(2, runner.k_pages, runner.v_pages)
        texts[loop] = runner._decode.lower(*args, **static).compile().as_text()
    kernel = f"f32[1,{CONFIG.hidden_size},{CONFIG.intermediate_size}]"   # one layer's gate/up
    sliced = lambda text: [line for line in text.splitlines()
                           if "dynamic-slice(" in line and kernel in line]
    assert sliced(texts["scan"])          # what the test would catch
    assert not sliced(texts["switch"])


def test_unrolled_loop_lowers_one_layer_body_and_compiles_the_unrolled_program(monkeypatch):
    """The ``unrolled`` loop (the GPU default) calls one jitted layer body a layer: the lowered
    decode step holds that body once and calls it num_layers times (lowering time stops
    growing with the layer count), and after XLA inlines the calls the compiled step has the
    instructions of the loop written out layer by layer (copies aside: XLA's copy insertion
    finds fewer activation copies to make across the calls' boundaries, never more)."""
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))

    def decode_step(runner):
        args, static = runner._null_decode_call(2, runner.k_pages, runner.v_pages)
        lowered = runner._decode.lower(*args, **static)
        return lowered.as_text(), lowered.compile().as_text()

    lowered, compiled = decode_step(make_runner(manager, "unrolled"))
    runner = make_runner(manager, "unrolled")
    monkeypatch.setattr(jax, "jit", lambda f, **_: f)   # the loop written out, layer by layer
    written_out_lowered, written_out = decode_step(runner)
    matmuls = lambda text: text.count("stablehlo.dot_general")
    # Written out, the 3 layers' matmuls are lowered 3 times; ours once.
    assert 2 * matmuls(lowered) < matmuls(written_out_lowered), \
        (matmuls(lowered), matmuls(written_out_lowered))
    opcodes = lambda text: collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))
    ours, theirs = opcodes(compiled), opcodes(written_out)
    assert ours["copy"] <= theirs["copy"]
    del ours["copy"], theirs["copy"]
    assert ours == theirs


def test_cpu_path_takes_the_whole_table_and_reads_only_the_blocks_the_rows_hold():
    """The CPU path's attention walks a row's block table in blocks of `HISTORY_BLOCK_PAGES`
    and skips the blocks past its length: the runner passes the whole table (one compiled
    width), with bit for bit the results of a table cut to its first block, which holds every
    page the rows use. (Cut narrower, the block's reductions run over fewer slots, and XLA's
    CPU code may sum them in another order: equal only to float rounding, by the host CPU.)"""
    from tangram_jax.engine.xla_attention import HISTORY_BLOCK_PAGES
    max_pages = 2 * HISTORY_BLOCK_PAGES
    manager = KVCacheManager(LAYOUT, 64, 2, max_pages, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager)
    for prefill in (True, False):
        assert runner._table_width(30, prefill=prefill) == max_pages
        assert runner._table_width(10_000, prefill=prefill) == max_pages
        assert runner._table_widths(prefill=prefill) == [max_pages]
    whole = run_steps("scan", max_pages=max_pages)
    # 30 tokens: 8 pages, all in the first block.
    narrow = run_steps("scan", max_pages=max_pages, table_width=HISTORY_BLOCK_PAGES)
    np.testing.assert_array_equal(narrow[0], whole[0])
    assert narrow[1] == whole[1]
    np.testing.assert_array_equal(narrow[2], whole[2])


def test_unknown_layer_loop_is_refused():
    with pytest.raises(ValueError, match="layer_loop"):
        RunnerConfig(layer_loop="vmap")


def make_runner(manager, layer_loop="scan"):
    model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    return ModelRunner(model, CONFIG, LAYOUT, 64, manager.block_tables.shape,
                       runner_config=RunnerConfig(layer_loop=layer_loop))


def test_prefill_rows_of_several_sequences_equal_one_call_each():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 97, n) for n in (16, 9, 13)]
    results = []
    for batched in (False, True):
        manager = KVCacheManager(LAYOUT, 64, 4, 16, model_kv_shape=(3, 2, 8))
        runner = make_runner(manager)
        slots = [manager.allocate_slot() for _ in prompts]
        for slot, p in zip(slots, prompts):
            assert manager.reserve(slot, len(p))
        runner.update_block_tables(*manager.take_table_updates())
        hist = [manager.lengths[s] for s in slots]
        if batched:   # 3 rows, padded to 4 by repeating the first
            logits, kept = runner.prefill(prompts, [0, 0, 0], slots, hist)
            assert logits.shape[0] == 4
            logits, kept = np.asarray(logits)[:3], np.asarray(kept)[:3]
        else:
            outs = [runner.prefill_chunk(p, 0, s, h) for p, s, h in zip(prompts, slots, hist)]
            logits = np.stack([np.asarray(o[0]) for o in outs])
            kept = np.stack([np.asarray(o[1]) for o in outs])
        for slot, p in zip(slots, prompts):
            manager.commit_prefill(slot, len(p))
        tables = manager.block_tables
        pages = [np.asarray(runner.k_pages)[tables[s][tables[s] > 0]] for s in slots]
        results.append((logits, kept, pages))
    (logits1, kept1, pages1), (logits2, kept2, pages2) = results
    np.testing.assert_allclose(logits2, logits1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kept2, kept1)
    np.testing.assert_array_equal(kept1, [LAYOUT.chunk_keep_counts(len(p)) for p in prompts])
    for a, b in zip(pages2, pages1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_prefill_refuses_repeated_sequences():
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager)
    slot = manager.allocate_slot()
    hist = manager.lengths[slot]
    with pytest.raises(ValueError, match="distinct"):
        runner.prefill([np.ones(4), np.ones(4)], [0, 0], [slot, slot], [hist, hist])


def test_warmup_compiles_on_the_null_slot_without_touching_sequences():
    manager = KVCacheManager(LAYOUT, 64, 4, 16, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager)
    slot = manager.allocate_slot()
    assert manager.reserve(slot, 9)
    runner.update_block_tables(*manager.take_table_updates())
    runner.prefill_chunk(np.arange(1, 10), 0, slot, manager.lengths[slot])
    held = manager.block_tables[slot][manager.block_tables[slot] > 0]
    before = np.asarray(runner.k_pages)[held]
    runner.warmup(decode_buckets=(1, 2), max_prefill_rows=2, max_first_tokens=2)
    np.testing.assert_array_equal(np.asarray(runner.k_pages)[held], before)
    # Padding rows of the first-token sampler write to the null slot only.
    tokens_before = np.asarray(runner.slot_state.tokens)
    logits, _ = runner.prefill([np.arange(1, 5)], [0], [slot], [manager.lengths[slot]])
    greedy = (np.zeros(3, np.float32), np.full(3, -1, np.int32), np.ones(3, np.float32),
              np.zeros(3, np.uint32), np.zeros(3, np.int32))
    assert slot == 0
    runner.sample([logits[0]] * 3, [0, 1, 2], *greedy)   # 3 rows, padded to 4
    after = np.asarray(runner.slot_state.tokens)
    assert after[:3].tolist() == [int(np.argmax(logits[0]))] * 3
    assert after[3] == tokens_before[3]   # slot 3 untouched; the padding row went to slot 4


def test_whole_row_prefill_of_a_full_layout_equals_the_dense_model():
    """Full KV: rows are whole pieces (two sequences in one call, one of them in two pieces);
    the last logits equal the dense reference decoder's and the pages hold every token's K."""
    from tangram_jax.models.decoder import DenseKVCache
    full = KVLayout.monolithic(3, 2, 8, page_size=4, chunk_size=16)
    manager = KVCacheManager(full, 64, 4, 16, model_kv_shape=(3, 2, 8))
    model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    dense_model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, CONFIG, full, 64, manager.block_tables.shape,
                         runner_config=RunnerConfig(mode="full", max_prefill_tokens=64))
    assert runner.prefill_whole_rows
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 97, 45), rng.integers(1, 97, 19)]
    slots = [manager.allocate_slot() for _ in prompts]
    for slot, p in zip(slots, prompts):
        assert manager.reserve(slot, len(p))
    runner.update_block_tables(*manager.take_table_updates())
    # Call 1: the first 32 tokens of sequence 0 (two chunks in one row) and all of sequence 1.
    logits, kept = runner.prefill([prompts[0][:32], prompts[1]], [0, 0], slots,
                                  [manager.lengths[s] for s in slots])
    np.testing.assert_array_equal(np.asarray(kept)[:2, 0, 0], [32, 19])
    manager.commit_prefill(slots[0], 32)
    manager.commit_prefill(slots[1], 19)
    last1 = np.asarray(logits)[1]
    logits, _ = runner.prefill([prompts[0][32:]], [32], [slots[0]], [manager.lengths[slots[0]]])
    last0 = np.asarray(logits)[0]
    for p, last in ((prompts[0], last0), (prompts[1], last1)):
        cache = DenseKVCache.create(CONFIG, 1, 64)
        want, cache = dense_model(jnp.asarray(p[None]), jnp.arange(len(p))[None], cache)
        np.testing.assert_allclose(last, np.asarray(want)[0, -1], rtol=2e-4, atol=2e-4)
    # Layer 0's K of sequence 1 sits in its pages in order.
    table = manager.block_tables[slots[1], 0, 0]
    pages = np.asarray(runner.k_pages)[table[:5]]                # [5, G, ps, d]
    got = np.moveaxis(pages, 1, 0).reshape(2, -1, 8)[:, :19]
    np.testing.assert_allclose(got, np.moveaxis(np.asarray(cache.k)[0, 0, :19], 1, 0),
                               rtol=1e-5, atol=1e-5)


def test_configured_prefill_token_buckets_are_aligned_and_end_at_the_token_budget():
    full = KVLayout.monolithic(3, 2, 8, page_size=4, chunk_size=16)
    manager = KVCacheManager(full, 64, 4, 16, model_kv_shape=(3, 2, 8))

    def buckets(configured, rows=1):
        runner = ModelRunner(Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0)), CONFIG, full, 64,
                             manager.block_tables.shape,
                             runner_config=RunnerConfig(mode="full", max_prefill_tokens=100,
                                                        prefill_token_buckets=configured))
        return runner.prefill_token_buckets(rows), row_alignment(runner.prefill_tuning)

    ladder, align = buckets(None)
    cap = -(-100 // align) * align
    # Default: the alignment's doublings below the budget, then the budget.
    assert ladder == [align << i for i in range(len(ladder) - 1)] + [cap]
    assert ladder[-2] < cap <= 2 * ladder[-2] and len(ladder) >= 2
    got, _ = buckets((1, align + 1, 10_000))
    # Rounded up to the alignment, sizes at or past the budget dropped, the budget kept.
    assert got == sorted({align, 2 * align, cap})
    got, _ = buckets((1,), rows=2)
    assert got == [align, cap + align]
    with pytest.raises(EngineConfigError, match="prefill_token_buckets"):
        EngineConfig(prefill_token_buckets=(0, 64))


def test_prefill_of_a_protected_turn_writes_the_layouts_counts_and_keeps_the_tail():
    from tangram_jax.compression.chunk_scoring import chunk_scores
    from tangram_jax.pallas_kernels.chunk_compress import kept_token_sources
    layout = LAYOUT.with_tail("window", 5)
    manager = KVCacheManager(layout, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = ModelRunner(Decoder(CONFIG, rngs=nnx.Rngs(0)), CONFIG, layout, 64,
                         manager.block_tables.shape, runner_config=RunnerConfig(obs_window=5))
    slot = manager.allocate_slot()
    tokens = np.random.default_rng(1).integers(1, 97, 27)
    assert manager.reserve(slot, len(tokens))
    runner.update_block_tables(*manager.take_table_updates())
    for start in (0, 16):
        chunk = tokens[start:start + 16]
        p = layout.chunk_protected(len(tokens), start, len(chunk))
        assert p == (5 if start else 0)
        _, kept = runner.prefill_chunk(chunk, start, slot, manager.lengths[slot], p)
        np.testing.assert_array_equal(kept, layout.chunk_keep_counts(len(chunk), p))
        manager.commit_prefill(slot, len(chunk), start=start, turn_len=len(tokens))
    np.testing.assert_array_equal(manager.lengths[slot], layout.retained_counts(len(tokens)))
    np.testing.assert_array_equal(manager.lengths[slot], manager.reserved_lengths[slot])
    # The scores the runner ranks by keep every protected token, whatever the attention says.
    probs = np.random.default_rng(2).random((4, 5, 16)).astype(np.float32)
    qkv = jnp.asarray(np.random.default_rng(3).normal(size=(16, 4, 8)), jnp.float32)
    scores = chunk_scores("snapkv", jnp.asarray(probs), qkv, qkv[:, :2], qkv[:, :2],
                          jnp.int32(11), jnp.int32(5), jnp.int32(16), q_per_kv=2)
    keep = jnp.asarray(layout.chunk_keep_counts(11, 5)[0], jnp.int32)
    sources, counts = kept_token_sources(scores, keep, jnp.int32(11), 1)
    for h in range(2):
        kept_idx = set(np.asarray(sources[h, :counts[h]]).tolist())
        assert set(range(6, 11)) <= kept_idx


def _kept_layer0_keys(method: str, tokens: np.ndarray):
    """Prefill one chunk with `method` on an identity-permuted layout of budget 0.5; returns the
    layer-0 keys each head kept ([heads] arrays [count, D]) and the chunk's layer-0 keys."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, group_size=1, page_size=4,
                      chunk_size=16, head_perm=np.tile(np.arange(2), (3, 1)),
                      group_budgets=np.full((3, 2), 0.5))
    manager = KVCacheManager(layout, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = ModelRunner(Decoder(CONFIG, rngs=nnx.Rngs(0)), CONFIG, layout, 64,
                         manager.block_tables.shape,
                         runner_config=RunnerConfig(obs_window=4, method=method))
    slot = manager.allocate_slot()
    assert manager.reserve(slot, len(tokens))
    runner.update_block_tables(*manager.take_table_updates())
    _, kept = runner.prefill_chunk(tokens, 0, slot, manager.lengths[slot])
    pages = np.asarray(runner.k_pages)
    kept_keys = [pages[manager.block_tables[slot, 0, h]][:, 0].reshape(-1, 8)[:int(kept[0, h])]
                 for h in range(2)]
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    positions = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    _, k, v = model.layers[0].qkv(model.embed(jnp.asarray(tokens, jnp.int32)[None]), positions)
    return kept_keys, np.asarray(k[0]), np.asarray(v[0])


def test_the_profile_method_is_the_served_scorer():
    """A profile calibrated with KeyDiff is served with KeyDiff: each head keeps KeyDiff's top-k
    of the chunk (in temporal order), which is not what SnapKV keeps."""
    from tangram_jax.compression.scorers import keydiff
    tokens = np.random.default_rng(3).integers(1, 97, 16)
    kept, k, v = _kept_layer0_keys("keydiff", tokens)
    count = len(kept[0])
    assert count == 8
    q_dummy = jnp.zeros((4, 16, 8))
    scores = np.asarray(keydiff(q_dummy, jnp.moveaxis(k, 0, 1), jnp.moveaxis(v, 0, 1),
                                q_per_kv=2))
    for h in range(2):
        top = np.sort(np.argsort(-scores[h], kind="stable")[:count])
        np.testing.assert_allclose(kept[h], k[top, h], rtol=1e-5, atol=1e-6)
    snap, _, _ = _kept_layer0_keys("snapkv", tokens)
    assert any(not np.allclose(a, b) for a, b in zip(kept, snap))


@pytest.mark.parametrize("method", ["expected_attention", "tova", "streaming_llm"])
def test_every_served_method_runs_in_the_chunk_compression(method):
    kept, k, _ = _kept_layer0_keys(method, np.random.default_rng(4).integers(1, 97, 13))
    for h in range(2):   # kept rows are rows of the chunk, in temporal order
        rows = [int(np.argmin(np.abs(k[:, h] - row).sum(-1))) for row in kept[h]]
        assert len(kept[h]) == 7 and rows == sorted(set(rows))
        np.testing.assert_allclose(kept[h], k[rows, h], rtol=1e-5, atol=1e-6)


def test_a_method_the_chunk_compression_cannot_run_is_refused():
    with pytest.raises(ValueError, match="'h2o' cannot be served"):
        RunnerConfig(method="h2o")
    with pytest.raises(ValueError, match="dynamic mode"):
        RunnerConfig(mode="dynamic", method="keydiff")


def test_serving_after_warmup_compiles_nothing():
    """Warm-up compiles the steps for the arrays serving passes (committed to the device, every
    table width of the CPU path): serving then runs no XLA compilation (it compiled every
    step shape again when warm-up lowered uncommitted arrays)."""
    import jax
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager)
    runner.warmup(decode_buckets=(1,), max_prefill_rows=1, max_first_tokens=1)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    slot = manager.allocate_slot()
    tokens = np.arange(1, 40)
    assert manager.reserve(slot, len(tokens))
    runner.update_block_tables(*manager.take_table_updates())
    for start in (0, 16, 32):   # the engine's calls: `prefill`, a row of its logits
        logits, _ = runner.prefill([tokens[start:start + 16]], [start], [slot],
                                   [manager.lengths[slot]])
        manager.commit_prefill(slot, len(tokens[start:start + 16]))
    greedy = (np.zeros(1, np.float32), np.full(1, -1, np.int32), np.ones(1, np.float32),
              np.zeros(1, np.uint32), np.zeros(1, np.int32))
    runner.sample([logits[0]], [slot], *greedy)
    for step in range(2):
        assert manager.grow_for_decode(np.array([slot])).all()
        runner.update_block_tables(*manager.take_table_updates())
        runner.decode(np.array([len(tokens) + step]), np.array([slot]),
                      manager.lengths[[slot]] - 1, *greedy)
    jax.block_until_ready(runner.k_pages)
    assert compiles == []


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled", "switch"])
def test_cpu_prefill_updates_the_pool_in_place(layer_loop):
    """The CPU path's prefill only reads the pool and returns its planned writes, which a
    second program scatters in place: neither compiled program holds a copy of the pool (XLA
    copied it every layer when the loop both read and wrote it, and, unrolled, once more when
    one scatter after the loop could not be ordered after the last layer's read)."""
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = make_runner(manager, layer_loop)
    assert runner.ops.plan_writes is not None and runner.plans_prefill_writes
    args, static = runner._null_prefill_call(1, runner.k_pages, runner.v_pages)
    writes = jax.eval_shape(functools.partial(runner._prefill, **static), *args)[0]
    texts = [runner._prefill.lower(*args, **static).compile().as_text(),
             runner._apply_writes.lower(runner.k_pages, runner.v_pages,
                                        writes).compile().as_text()]
    pool = "f32[" + ",".join(map(str, runner.k_pages.shape)) + "]"
    copies = [line for text in texts for line in text.splitlines()
              if " copy(" in line and pool in line]
    assert not copies, copies


def test_a_short_chunk_row_prefills_over_a_smaller_flat_axis_with_the_same_results():
    """On the CPU path a single compression-chunk row of few tokens (a follow-up turn) takes the
    smallest flat-token size that holds it, not its whole chunk's: same logits, kept counts and
    pages as over the whole chunk's axis."""
    probe = make_runner(KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8)))
    align = row_alignment(probe.prefill_tuning)
    layout = dataclasses.replace(LAYOUT, chunk_size=4 * align)
    max_pages = -(-(4 * align + 16) // LAYOUT.page_size)
    num_pages = LAYOUT.num_layers * LAYOUT.num_groups * max_pages + 8
    results = []
    for small in (True, False):
        manager = KVCacheManager(layout, num_pages, 2, max_pages, model_kv_shape=(3, 2, 8))
        runner = ModelRunner(Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0)), CONFIG, layout,
                             num_pages, manager.block_tables.shape)
        assert runner.chunk_token_buckets(1) == [align, 2 * align, 4 * align]
        assert runner.chunk_token_buckets(2) == [2 * align, 4 * align, 8 * align]
        if not small:
            runner.chunk_token_buckets = lambda rows: [rows * 4 * align]
        tokens = np.random.default_rng(2).integers(1, 97, 4 * align + 9)
        # A whole chunk, then a short piece (9 tokens over the first chunk's history).
        logits, decoded, _ = prefill_then_decode(runner, manager, layout, tokens,
                                                 chunk=4 * align)
        results.append((logits, decoded, np.asarray(runner.k_pages)))
    (small_logits, small_tokens, small_pages), (logits, tokens, pages) = results
    np.testing.assert_allclose(small_logits, logits, rtol=1e-5, atol=1e-5)
    assert small_tokens == tokens
    np.testing.assert_allclose(small_pages, pages, rtol=1e-5, atol=1e-5)


def test_decode_samplers_hold_no_conditional_and_greedy_rows_choose_the_same_tokens():
    """A decode step's sampler is chosen on the host (`_sampling_rows`): rows that neither sample
    nor adjust their logits take the argmax program, and it chooses what the general sampler
    chooses; a sampled or penalised row takes the general one. Neither holds a conditional (a
    device-side branch makes the host wait for its predicate each step)."""
    from tangram_jax.engine.decode_step import _greedy, _greedy_rows, _sampling_rows
    from tangram_jax.sampling import neutral_adjust
    runner = make_runner(KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8)), "scan")
    logits = jax.random.normal(jax.random.key(0), (4, CONFIG.vocab_size), jnp.float32)
    slots = np.array([0, 1, 2, 3], np.int32)
    chosen, texts = {}, {}
    for greedy in (True, False):
        lowered = runner._sample_rows.lower(runner.slot_state, logits, slots, _greedy_rows(4),
                                            logprobs=None, greedy=greedy)
        texts[greedy] = lowered.compile().as_text()
        state = jax.tree.map(jnp.copy, runner.slot_state)
        _, chosen[greedy], _ = runner._sample_rows(state, logits, slots, _greedy_rows(4),
                                                   logprobs=None, greedy=greedy)
    assert " conditional(" not in texts[True] and " conditional(" not in texts[False]
    np.testing.assert_array_equal(chosen[True], chosen[False])
    np.testing.assert_array_equal(chosen[True], np.argmax(np.asarray(logits), -1))

    decision = lambda temperature, **adjust: _sampling_rows(
        temperature, *_greedy(4)[1:], None, neutral_adjust(4)._replace(**{
            k: np.asarray(v) for k, v in adjust.items()}), 4)[1]
    zero = np.zeros(4, np.float32)
    assert decision(zero)
    assert decision(zero, min_p=np.full(4, 0.1, np.float32))   # min-p filters sampled rows only
    assert not decision(np.array([0, 0, 0.7, 0], np.float32))
    assert not decision(zero, repetition=np.array([1, 1.2, 1, 1], np.float32))
    assert not decision(zero, presence=np.array([0, 0, 0, 0.5], np.float32))
    assert not decision(zero, frequency=np.array([0.5, 0, 0, 0], np.float32))
    assert not decision(zero, suppress_stop=np.array([False, True, False, False]))
