"""Chunked-prefill attention (interpret mode on CPU) against the full-matrix jnp reference.

History slots a group does not own and the chunk's padding rows are NaN; the output and the
observation-window probabilities must match the reference on valid rows and be finite on all."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.pallas_kernels.prefill_attention import (
    PrefillTuning, chunk_prefill_attention, chunk_prefill_attention_reference, observation_probs,
    pack_rows, prefill_work_items, ragged_prefill_attention, ragged_prefill_attention_reference,
    row_alignment)

GPU_SCALE = os.environ.get("TANGRAM_KERNEL_SCALE") == "gpu"
# (T, Hq, Hkv, head_dim, G, page_size, max_pages, obs_window, block)
SHAPE = (512, 32, 8, 128, 2, 16, 96, 32, 64) if GPU_SCALE else (40, 4, 2, 16, 2, 8, 7, 8, 16)
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}


def _case(rng, chunk_len, hist, dtype):
    chunk, hq, hkv, d, g, ps, max_pages, _, _ = SHAPE
    groups = hkv // g
    num_pages = groups * max_pages + 2
    tables = rng.permutation(num_pages)[:groups * max_pages].reshape(groups, max_pages)
    k_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    owned = np.zeros((num_pages, ps), bool)
    for grp in range(groups):
        t = np.arange(hist[grp])
        owned[tables[grp, t // ps], t % ps] = True
    k_pages[~owned[:, None, :, None].repeat(g, 1).repeat(d, 3)] = np.nan
    v_pages[np.isnan(k_pages)] = np.nan
    q = rng.standard_normal((chunk, hq, d)).astype(np.float32)
    k = rng.standard_normal((chunk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((chunk, hkv, d)).astype(np.float32)
    k[chunk_len:] = np.nan
    v[chunk_len:] = np.nan
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, k_pages, v_pages)) + (
        jnp.asarray(tables.astype(np.int32)), jnp.asarray(np.asarray(hist, np.int32)),
        np.int32(chunk_len))


def _hists(rng):
    chunk, _, hkv, _, g, ps, max_pages, _, _ = SHAPE
    groups = hkv // g
    cap = max_pages * ps
    h = rng.integers(0, cap // 4, size=groups)
    h[0] = cap                                      # one group far longer
    if groups > 1:
        h[1] = 0
    if groups > 2:
        h[2] = ps                                   # exact page boundary
    return h


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_prefill_matches_reference(dtype):
    rng = np.random.default_rng()
    chunk, _, _, _, _, _, _, obs_window, block = SHAPE
    for chunk_len in (chunk, chunk - 7, obs_window // 2, 1):
        args = _case(rng, chunk_len, _hists(rng), dtype)
        out, obs = chunk_prefill_attention(*args, obs_window=obs_window,
                                       tuning=PrefillTuning(block_q=block, block_k=block))
        ref, ref_obs = chunk_prefill_attention_reference(*args, obs_window=obs_window)
        out = np.asarray(out, np.float64)
        assert out.shape == args[0].shape and obs.shape == (args[0].shape[1], obs_window, chunk)
        assert np.isfinite(out).all() and np.isfinite(np.asarray(obs)).all()
        ref = np.asarray(ref, np.float64)[:chunk_len]
        err = np.linalg.norm(out[:chunk_len] - ref) / np.linalg.norm(ref)
        assert err < RTOL[dtype], f"chunk_len {chunk_len}: out relative error {err:.2e}"
        ref_obs = np.asarray(ref_obs, np.float64)
        obs_err = np.abs(np.asarray(obs, np.float64) - ref_obs).max()
        assert obs_err < 10 * RTOL[dtype] * max(ref_obs.max(), 1e-3), obs_err
        assert not np.asarray(obs)[:, :obs_window - chunk_len].any()   # rows before the chunk


def test_prefill_without_any_key_is_zero():
    rng = np.random.default_rng()
    chunk, _, hkv, _, g, _, _, obs_window, block = SHAPE
    args = _case(rng, 0, np.zeros(hkv // g, np.int64), jnp.float32)
    out, obs = chunk_prefill_attention(*args, obs_window=obs_window,
                                       tuning=PrefillTuning(block_q=block, block_k=block))
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(obs).any()


def test_prefill_rejects_bad_inputs():
    rng = np.random.default_rng()
    args = _case(rng, 4, _hists(rng), jnp.float32)
    with pytest.raises(ValueError, match="obs_window"):
        chunk_prefill_attention(*args, obs_window=0)
    with pytest.raises(ValueError, match="block_q"):
        PrefillTuning(block_q=24)


# ----- ragged batch of rows ---------------------------------------------------------------------

# (Hq, Hkv, head_dim, G, page_size, max_pages); q_per_kv 3 exercises the padded head stack.
RAGGED_SHAPE = (12, 4, 16, 2, 8, 6)
RAGGED_TUNING = PrefillTuning(block_q=16, block_k=16, num_warps=4, num_stages=1,
                              max_splits=3, min_split_keys=8)


def _ragged_case(rng, row_lens, dtype, hq=12):
    _, hkv, d, g, ps, max_pages = RAGGED_SHAPE
    rows, groups = len(row_lens), hkv // g
    starts, used = pack_rows(row_lens, row_alignment(RAGGED_TUNING))
    n = used + row_alignment(RAGGED_TUNING)           # a spare tile of bucket padding
    num_pages = rows * groups * max_pages + 1
    tables = rng.permutation(num_pages)[:rows * groups * max_pages].reshape(rows, groups,
                                                                             max_pages)
    hist = rng.integers(0, max_pages * ps + 1, size=(rows, groups))
    hist[0, 0] = max_pages * ps
    hist[-1, -1] = 0
    k_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    owned = np.zeros((num_pages, g, ps), bool)
    for r in range(rows):
        for grp in range(groups):
            t = np.arange(hist[r, grp])
            owned[tables[r, grp, t // ps], :, t % ps] = True
    k_pages[~owned] = np.nan
    v_pages[~owned] = np.nan
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    inside = np.zeros(n, bool)
    for s, ln in zip(starts, row_lens):
        inside[s:s + ln] = True
    for x in (q, k, v):
        x[~inside] = np.nan                           # padding tokens: poison
    arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v, k_pages, v_pages))
    ints = tuple(jnp.asarray(np.asarray(x, np.int32)) for x in (tables, hist, starts, row_lens))
    # Room for 40 more items than query blocks x groups: long histories split (at most 3
    # ways), the rest are no-op padding items.
    items = prefill_work_items(starts, row_lens, hist, tuning=RAGGED_TUNING, num_tokens=n,
                               num_items=(n // RAGGED_TUNING.block_q) * groups + 40)
    assert (items[:, 4] > 1).any() and (items[:, 0] == -1).any()
    return arrays + ints + (jnp.asarray(items),), dict(starts=starts, hist=hist, tables=tables,
                                                       inside=inside)


def _oracle(q, k, v, k_pages, v_pages, tables, hist, starts, lens, window=0, sinks=None):
    """float64 numpy attention of each row, row by row (independent of both jnp paths); a
    window > 0 limits query i (slot hist + i) to keys of slots > hist + i - window; sinks [Hq]
    add a zero-valued key of that logit."""
    q, k, v, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k, v, k_pages, v_pages))
    n, hq, d = q.shape
    hkv, g, ps = k.shape[1], k_pages.shape[1], k_pages.shape[2]
    out = np.zeros_like(q)
    lse = np.full((hq, n), -np.inf)
    for r, (s, ln) in enumerate(zip(starts, lens)):
        for h in range(hq):
            kv = h // (hq // hkv)
            grp, j = divmod(kv, g)
            t = np.arange(hist[r, grp])
            hk = k_pages[tables[r, grp, t // ps], j, t % ps]
            hv = v_pages[tables[r, grp, t // ps], j, t % ps]
            for i in range(ln):
                keys = np.concatenate([hk, k[s:s + i + 1, kv]])
                vals = np.concatenate([hv, v[s:s + i + 1, kv]])
                if window:
                    first = max(0, len(keys) - window)
                    keys, vals = keys[first:], vals[first:]
                logit = keys @ q[s + i, h] / np.sqrt(d)
                if sinks is not None:
                    logit = np.append(logit, sinks[h])
                    vals = np.concatenate([vals, np.zeros((1, d))])
                m = logit.max()
                p = np.exp(logit - m)
                out[s + i, h] = p @ vals / p.sum()
                lse[h, s + i] = m + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ragged_prefill_matches_oracle_and_reference(dtype):
    rng = np.random.default_rng()
    row_lens = [int(rng.integers(20, 40)), 0, 16, int(rng.integers(1, 16))]
    args, meta = _ragged_case(rng, row_lens, dtype)
    out, lse = ragged_prefill_attention(*args, tuning=RAGGED_TUNING)
    ref, ref_lse = ragged_prefill_attention_reference(*args)
    want, want_lse = _oracle(*args[:5], meta["tables"], meta["hist"], meta["starts"], row_lens)
    inside = meta["inside"]
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all() and not out[~inside].any()
    assert np.isneginf(np.asarray(lse)[:, ~inside]).all()
    for got, tol in ((out, RTOL[dtype]), (ref, RTOL[dtype] if dtype == jnp.bfloat16 else 1e-6)):
        err = np.linalg.norm(got[inside] - want[inside]) / np.linalg.norm(want[inside])
        assert err < tol, err
    for got in (lse, ref_lse):
        got = np.asarray(got, np.float64)[:, inside]
        assert np.abs(got - want_lse[:, inside]).max() < 50 * RTOL[dtype]


def test_ragged_prefill_item_order_and_padding_items_do_not_matter():
    rng = np.random.default_rng()
    row_lens = [33, 17]
    args, meta = _ragged_case(rng, row_lens, jnp.float32)
    out, lse = ragged_prefill_attention(*args, tuning=RAGGED_TUNING)
    items = np.asarray(args[-1])
    shuffled = np.concatenate([rng.permutation(items[items[:, 0] >= 0]),
                               items[items[:, 0] < 0]])
    out2, lse2 = ragged_prefill_attention(*args[:-1], jnp.asarray(shuffled), tuning=RAGGED_TUNING)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


def test_prefill_work_items_heaviest_first():
    tuning = PrefillTuning(block_q=16, block_k=16, max_splits=4, min_split_keys=20)
    starts, _ = pack_rows([40, 16], 16)
    hist = np.array([[5, 100], [0, 50]])
    lens = np.array([40, 16])
    causal = lambda it: np.minimum((it[:, 1] - starts[it[:, 0]] // 16 + 1) * 16,  # noqa: E731
                                   lens[it[:, 0]])
    items = prefill_work_items(starts, lens, hist, num_tokens=64, num_items=12, tuning=tuning)
    assert items.shape == (12, 5)
    real = items[items[:, 0] >= 0]
    per_split = hist[real[:, 0], real[:, 2]] / real[:, 4] + np.where(
        real[:, 3] == real[:, 4] - 1, causal(real), 0)
    assert (np.diff(per_split) <= 0).all()
    # Every (row, block, group) is covered by splits 0 .. n-1, exactly once each.
    cover = {}
    for r, b, g, s, n in real.tolist():
        cover.setdefault((r, b, g), []).append((s, n))
    assert sorted(cover) == sorted((r, int(starts[r]) // 16 + b, g) for r, nb in ((0, 3), (1, 1))
                                   for b in range(nb) for g in range(2))
    for parts in cover.values():
        n = parts[0][1]
        assert sorted(s for s, _ in parts) == list(range(n)) and all(m == n for _, m in parts)
    # The 4 spare items went to group 1's long histories (100 -> splits of >= 20 keys).
    assert max(n for parts in cover.values() for _, n in parts) > 1
    assert all(n == 1 for (r, _, g), parts in cover.items() for _, n in parts if g == 0)
    unsplit = prefill_work_items(starts, lens, hist, num_tokens=64, tuning=tuning)
    assert unsplit.shape == (8, 5) and (unsplit[:, 4] == 1).all()
    # A flat axis with unused blocks (N = 96 has 12 blocks x 2 groups = 24 > 12 items): the
    # spare items are padding, not splits (the kernel has one output slot for such a call).
    gaps = prefill_work_items(starts, lens, hist, num_tokens=96, num_items=12, tuning=tuning)
    assert (gaps[:, 4] <= 1).all() and (gaps[8:, 0] == -1).all()
    with pytest.raises(ValueError, match="num_items"):
        prefill_work_items(starts, lens, hist, num_tokens=64, num_items=4, tuning=tuning)


def test_observation_probs_rows_sum_with_history():
    """A row without history: its window queries' probabilities over its own keys sum to 1."""
    rng = np.random.default_rng()
    row_lens = [30, 9]
    args, meta = _ragged_case(rng, row_lens, jnp.float32)
    args = list(args)
    args[6] = jnp.zeros_like(args[6])                 # no history
    out, lse = ragged_prefill_attention(*args, tuning=RAGGED_TUNING)
    obs = np.asarray(observation_probs(args[0], args[1], lse, args[7], args[8], obs_window=12,
                                       chunk=32))
    assert obs.shape == (2, 12, 12, 32)
    np.testing.assert_allclose(obs[0].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(obs[1][:, 3:].sum(-1), 1.0, rtol=1e-5)
    assert not obs[1][:, :3].any() and not obs[1][..., 9:].any()


@pytest.mark.parametrize("precision", ["k8v4", "k4v2"])
def test_ragged_prefill_over_quantised_history(precision):
    """A quantised pool: the kernel and the reference attend over the dequantised history
    (poisoned slots keep NaN scales, so a slot read outside a history still shows), and both
    match the float64 oracle run on the dequantised pages."""
    from tangram_jax import kv_quant
    fmt = kv_quant.page_format(precision)
    rng = np.random.default_rng()
    row_lens = [int(rng.integers(20, 40)), 0, 16, int(rng.integers(1, 16))]
    args, meta = _ragged_case(rng, row_lens, jnp.float32)
    args = list(args)
    args[3] = kv_quant.quantise_pages(args[3], fmt.key_bits)
    args[4] = kv_quant.quantise_pages(args[4], fmt.value_bits)
    out, lse = ragged_prefill_attention(*args, tuning=RAGGED_TUNING)
    ref, _ = ragged_prefill_attention_reference(*args)
    dense = [kv_quant.dequantise_pages(p) for p in args[3:5]]
    want, _ = _oracle(*args[:3], *dense, meta["tables"], meta["hist"], meta["starts"], row_lens)
    inside = meta["inside"]
    for got, tol in ((out, RTOL[jnp.float32]), (ref, 1e-6)):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got[inside] - want[inside]) / np.linalg.norm(want[inside])
        assert err < tol, err


def test_fit_tuning_shrinks_float32_tiles_to_shared_memory():
    """The H100 refused float32 at block_q 64 / block_k 64 with 4 query heads per KV head (289 KiB
    of shared memory asked, 227 available): such tiles are shrunk; bf16 at the default stays."""
    from tangram_jax.pallas_kernels.prefill_attention import PREFILL_TUNING, fit_tuning
    big = PrefillTuning(block_q=64, block_k=64)
    fitted = fit_tuning(big, 4, 128, 4)
    assert fitted.block_q < 64 and fitted.block_k <= 64
    assert fit_tuning(PREFILL_TUNING, 4, 128, 2) == PREFILL_TUNING
    assert fit_tuning(big, 4, 128, 2) == big                   # bf16 fits as it is
    assert fit_tuning(PREFILL_TUNING, 4, 128, 4).block_q == 16  # float32 at the default shrinks


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ragged_prefill_over_precision_tiers(dtype):
    """Precision tiers (`kv_quant.TieredPages`, tables and lengths of tier groups): the kernel
    and the jnp reference equal the float64 oracle over each group's history with its first
    pages in K8V4 and the rest in K4V2; unowned slots stay NaN in both pools; tables of groups
    instead of tier groups are one clear error."""
    from tangram_jax import kv_quant
    rng = np.random.default_rng()
    row_lens = [int(rng.integers(20, 40)), 0, 16, int(rng.integers(1, 16))]
    args, meta = _ragged_case(rng, row_lens, jnp.float32)
    q, k, v, k_dense, v_dense = args[:5]
    tables, hist = meta["tables"], meta["hist"]
    ps, width = RAGGED_SHAPE[4], RAGGED_SHAPE[5]
    rows, groups = hist.shape
    tier_tables = np.zeros((rows, 2 * groups, width), np.int32)
    tier_hist = np.zeros((rows, 2 * groups), np.int32)
    in_high = np.zeros(k_dense.shape[0], bool)
    for r in range(rows):
        for g in range(groups):
            pages = -(-hist[r, g] // ps)
            high = (pages + 1) // 2                       # the first pages: the high tier
            tier_hist[r, 2 * g] = min(hist[r, g], high * ps)
            tier_hist[r, 2 * g + 1] = hist[r, g] - tier_hist[r, 2 * g]
            tier_tables[r, 2 * g, :high] = tables[r, g, :high]
            tier_tables[r, 2 * g + 1, :pages - high] = tables[r, g, high:pages]
            in_high[tables[r, g, :high]] = True
    pools = [(kv_quant.quantise_pages(x, kb), kv_quant.quantise_pages(y, vb))
             for kb, vb in ((8, 4), (4, 2)) for x, y in [(k_dense, v_dense)]]
    k_tiers = kv_quant.TieredPages(pools[0][0], pools[1][0])
    v_tiers = kv_quant.TieredPages(pools[0][1], pools[1][1])
    # The oracle's pool: each page dequantised from the tier its table puts it in.
    pick = lambda hi, lo: np.where(in_high[:, None, None, None],  # noqa: E731
                                   np.asarray(kv_quant.dequantise_pages(hi)),
                                   np.asarray(kv_quant.dequantise_pages(lo)))
    want, want_lse = _oracle(q, k, v, pick(k_tiers.high, k_tiers.low),
                             pick(v_tiers.high, v_tiers.low), tables, hist, meta["starts"],
                             row_lens)
    cast = [x.astype(dtype) for x in (q, k, v)]
    tier_args = (*cast, k_tiers, v_tiers, jnp.asarray(tier_tables), jnp.asarray(tier_hist),
                 *args[7:])
    out, lse = ragged_prefill_attention(*tier_args, tuning=RAGGED_TUNING)
    ref, _ = ragged_prefill_attention_reference(*tier_args)
    inside = meta["inside"]
    tol = RTOL[dtype]
    for got in (out, ref):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got[inside] - want[inside]) / np.linalg.norm(want[inside])
        assert err < tol, err
    np.testing.assert_allclose(np.asarray(lse)[:, inside], want_lse[:, inside],
                               rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="tier groups"):
        ragged_prefill_attention(*cast, k_tiers, v_tiers, jnp.asarray(tables, jnp.int32),
                                 *args[6:], tuning=RAGGED_TUNING)


@pytest.mark.parametrize("window, sinks", [(5, False), (21, True), (0, True)],
                         ids=["window_in_row", "window_into_history_sinks", "sinks"])
def test_ragged_prefill_window_and_sinks(window, sinks):
    """A local layer's window (`attention_terms`: slots > slot - window) and attention sinks:
    the kernel (interpreted), its reference and the CPU serving path equal the oracle (NaN
    history slots and padding: the kernel and the reference never read them); the
    window is traced (one compiled kernel serves every layer's window, 0 for a global one)."""
    import jax
    from tangram_jax.engine.xla_attention import ragged_prefill_attention_xla
    rng = np.random.default_rng(7)
    row_lens = [37, 0, 16, 9]
    args, meta = _ragged_case(rng, row_lens, jnp.float32)
    sink = rng.standard_normal(args[0].shape[1]).astype(np.float32) * 2 if sinks else None
    terms = dict(window=jnp.int32(window), sinks=None if sink is None else jnp.asarray(sink))
    want, want_lse = _oracle(*args[:5], meta["tables"], meta["hist"], meta["starts"], row_lens,
                             window, sink)
    inside = meta["inside"]
    kernel = jax.jit(lambda *a, window, sinks: ragged_prefill_attention(
        *a, tuning=RAGGED_TUNING, window=window, sinks=sinks))
    for name, fn in (("kernel", kernel),
                     ("reference", lambda *a, **t: ragged_prefill_attention_reference(*a, **t)),
                     # (the CPU path reads finite pools only: the engine's are)
                     ("xla", lambda *a, **t: ragged_prefill_attention_xla(
                         *(jnp.nan_to_num(x) for x in a), tuning=RAGGED_TUNING, **t))):
        out, lse = fn(*args, **terms)
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all() and not out[~inside].any(), name
        err = np.linalg.norm(out[inside] - want[inside]) / np.linalg.norm(want[inside])
        assert err < 2e-5, (name, err)
        assert np.abs(np.asarray(lse, np.float64)[:, inside] - want_lse[:, inside]).max() < 1e-3


def _greedy_splits_one_at_a_time(h, c, spare, tuning):
    """The split rule as its docstring states it, one split at a time off a heap: the item of
    largest per-split work (the lower item on a tie) takes one more split while its splits
    keep ``min_split_keys`` history keys each and number at most ``max_splits``."""
    import heapq
    splits = np.ones(len(h), np.int64)
    heap = [(-(hk + ck), i) for i, (hk, ck) in enumerate(zip(h, c))]
    heapq.heapify(heap)
    while spare and heap:
        _, i = heapq.heappop(heap)
        s = splits[i] + 1
        if s > tuning.max_splits or h[i] / s < tuning.min_split_keys:
            continue
        splits[i], spare = s, spare - 1
        heapq.heappush(heap, (-(h[i] / s + c[i]), i))
    return splits - 1


def test_prefill_work_items_split_as_the_one_at_a_time_greedy():
    """`prefill_work_items` takes its splits in one sort (`_greedy_splits`: the host's share of
    a prefill step, 2-3x faster than a heap at a 2048-token call's 528 items); every split
    count equals the one-at-a-time greedy's, ties and limits included."""
    from tangram_jax.pallas_kernels.prefill_attention import _greedy_splits
    rng = np.random.default_rng(0)
    for trial in range(200):
        tuning = PrefillTuning(block_q=16, block_k=16, max_splits=int(rng.integers(2, 17)),
                               min_split_keys=int(rng.choice([1, 20, 100, 512])))
        layers, count = int(rng.integers(1, 4)), int(rng.integers(1, 40))
        h = rng.integers(0, 3000, (layers, count)).astype(np.float64)
        if trial % 3 == 0:
            h = (h // 500) * 500                               # equal histories: ties
        c = np.repeat(rng.integers(1, 5, -(-count // 2)) * 16, 2)[:count].astype(np.float64)
        spare = int(rng.integers(1, 300))
        want = np.stack([_greedy_splits_one_at_a_time(h[i], c, spare, tuning)
                         for i in range(layers)])
        np.testing.assert_array_equal(_greedy_splits(h, c, spare, tuning), want)
