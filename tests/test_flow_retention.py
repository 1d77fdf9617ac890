"""Flow retention (`kv_layout` retention "flow", `compression.flow`): a turn's reservation is
filled first, then later chunks displace weaker held tokens; the counts are the layout's, and
the destinations and their writes are exact against loop-by-loop numpy."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax import kv_quant
from tangram_jax.compression.flow import flow_destinations
from tangram_jax.kv_layout import KVLayout
from tangram_jax.pallas_kernels.chunk_compress import (page_writes, scattered_dirty_pages,
                                                       write_chunk_into_pages,
                                                       write_chunk_into_pages_reference)


def _layout(budgets, chunk=16, retention="flow", tail=4):
    budgets = np.asarray(budgets, float)
    layers, groups = budgets.shape
    return KVLayout(num_layers=layers, num_kv_heads=groups, head_dim=8, group_size=1,
                    page_size=4, chunk_size=chunk, head_perm=np.tile(np.arange(groups),
                                                                     (layers, 1)),
                    group_budgets=budgets, tail_rule="window", tail_window=tail,
                    retention=retention)


@pytest.mark.parametrize("turn_len", [1, 5, 16, 17, 60, 100, 257])
def test_flow_counts_fill_the_reservation_first_and_do_not_depend_on_the_chunking(turn_len):
    budgets = [[0.25, 0.5, 1.0], [0.1, 0.33, 0.7]]
    totals = []
    for chunk in (8, 16, 64):
        layout = _layout(budgets, chunk)
        tail = layout.protected_tail(turn_len)
        u = turn_len - tail
        final = layout.retained_counts(turn_len)
        want = np.minimum(u, np.ceil(np.asarray(budgets) * u - 1e-6)).astype(int)
        want = np.where(u > 0, np.maximum(want, 1), 0) + tail
        np.testing.assert_array_equal(final, want)
        totals.append(final)
        # Pieces on the chunk grid add up to the turn, each at most its tokens, never shrinking.
        edges = list(range(0, turn_len, chunk)) + [turn_len]
        pieces = [layout.piece_retained_counts(turn_len, a, b) for a, b in zip(edges, edges[1:])]
        assert all(((p >= 0) & (p <= b - a)).all() for p, a, b in zip(pieces, edges, edges[1:]))
        np.testing.assert_array_equal(sum(pieces), final)
        # Fill first: a piece keeps everything until the reservation of the unprotected part
        # is full.
        held = np.zeros_like(final)
        for p, a, b in zip(pieces, edges, edges[1:]):
            room = np.minimum(np.ceil(np.asarray(budgets) * u - 1e-6), u) - held
            np.testing.assert_array_equal(p, np.minimum(b - a, np.maximum(room, 0)
                                                        + max(0, b - max(a, u)))
                                          if u else p)
            held = held + p
    for t in totals[1:]:
        np.testing.assert_array_equal(t, totals[0])


def test_chunk_retention_keeps_a_share_of_every_chunk():
    layout = _layout([[0.25]], chunk=16, retention="chunk", tail=4)
    # 64 tokens: 60 unprotected = 3 chunks of 16 (4 each) + 12 (3) + 4 protected.
    np.testing.assert_array_equal(layout.retained_counts(64), [[4 * 3 + 3 + 4]])
    np.testing.assert_array_equal(_layout([[0.25]], chunk=16).retained_counts(64), [[15 + 4]])


def _numpy_flow(held_scores, held, new, chunk_len, append, hist):
    """Per head: take the chunk tokens best first; the first `append` get new slots, each later
    one displaces the weakest remaining held token if it scores strictly higher."""
    heads, t = new.shape
    out = np.full((heads, t), -1)
    for h in range(heads):
        ranked = sorted(range(chunk_len), key=lambda i: (-new[h, i], i))
        weakest = sorted((s for s in range(held.shape[1]) if held[h, s]),
                         key=lambda s: (held_scores[h, s], s))
        for r, i in enumerate(ranked):
            if r < append[h]:
                out[h, i] = hist[h] + r
            elif r - append[h] < len(weakest) and new[h, i] > held_scores[h, weakest[r - append[h]]]:
                out[h, i] = weakest[r - append[h]]
            else:
                break
    return out


@pytest.mark.parametrize("seed", range(6))
def test_flow_destinations_match_numpy(seed):
    rng = np.random.default_rng(seed)
    heads, t, slots = 3, 12, 40
    chunk_len = int(rng.integers(1, t + 1))
    hist = rng.integers(5, 28, heads)
    start = np.array([int(rng.integers(0, h)) for h in hist])
    held = (np.arange(slots)[None] >= start[:, None]) & (np.arange(slots)[None] < hist[:, None])
    # Few distinct values: ties between held and new tokens must keep the held one.
    held_scores = rng.integers(0, 6, (heads, slots)).astype(np.float32)
    new = rng.integers(0, 6, (heads, t)).astype(np.float32)
    append = rng.integers(0, chunk_len + 1, heads)
    got = flow_destinations(jnp.asarray(held_scores), jnp.asarray(held), jnp.asarray(new),
                            jnp.int32(chunk_len), jnp.asarray(append, jnp.int32),
                            jnp.asarray(hist, jnp.int32))
    want = _numpy_flow(held_scores, held, new, chunk_len, append, hist)
    np.testing.assert_array_equal(np.asarray(got), want)
    got = np.asarray(got)
    for h in range(heads):       # every slot written once, new slots exactly `append`
        slots_h = got[h][got[h] >= 0]
        assert len(set(slots_h)) == len(slots_h)
        assert ((slots_h >= hist[h]).sum()) == append[h]


@pytest.mark.parametrize("precision", ["bf16", "k8v4", "k4v2"])
@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_scattered_writes_touch_only_their_slots(precision, use_kernel):
    """Rows written to scattered slots (what flow retention produces): exactly those slots of
    K, V and the score pool change, on a NaN-poisoned pool, kernel (interpreted on a CPU,
    compiled on a GPU) and reference."""
    rng = np.random.default_rng(0)
    t, heads, d, g, ps, max_pages = 12, 4, 16, 2, 4, 8
    groups = heads // g
    num_pages = groups * max_pages + 2
    table = rng.permutation(num_pages)[:groups * max_pages].reshape(groups, max_pages)
    dest = np.full((heads, t), -1)
    for h in range(heads):
        chosen = rng.choice(t, size=int(rng.integers(0, t + 1)), replace=False)
        dest[h, chosen] = rng.choice(max_pages * ps, size=len(chosen), replace=False)
    k = rng.standard_normal((t, heads, d)).astype(np.float32)
    v = rng.standard_normal((t, heads, d)).astype(np.float32)
    s = rng.standard_normal((heads, t)).astype(np.float32)
    pool = np.full((num_pages, g, ps, d), np.nan, np.float32)
    fmt = kv_quant.page_format(precision)
    pools = [kv_quant.quantise_pages(jnp.asarray(pool), bits, jnp.float32, groups,
                                     fmt.code_unit, fmt.slot_pairs)
             for bits, groups in ((fmt.key_bits, 1), (fmt.value_bits, fmt.value_groups))]
    scores = jnp.full((num_pages, g, ps), jnp.nan, jnp.float32)
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(dest, jnp.int32), *pools,
            jnp.asarray(table, jnp.int32))
    if use_kernel:
        out = write_chunk_into_pages(*args, max_dirty=scattered_dirty_pages(t, ps),
                                     score_rows=jnp.asarray(s), score_pages=scores)
    else:
        out = write_chunk_into_pages_reference(*args, jnp.asarray(s), scores)
    k_out, v_out = (np.asarray(kv_quant.dequantise_pages(x, jnp.float32)) for x in out[:2])
    s_out = np.asarray(out[2])
    want_k = np.full_like(pool, np.nan)
    want_s = np.full((num_pages, g, ps), np.nan, np.float32)
    for h in range(heads):
        grp, j = divmod(h, g)
        for i in range(t):
            if dest[h, i] >= 0:
                page, off = table[grp, dest[h, i] // ps], dest[h, i] % ps
                want_k[page, j, off] = k[i, h]
                want_s[page, j, off] = s[h, i]
    np.testing.assert_array_equal(np.isnan(k_out).any(-1), np.isnan(want_k).any(-1))
    tol = {"bf16": 0, "k8v4": 0.05, "k4v2": 0.5}[precision]   # quantisation error of keys
    written = ~np.isnan(want_k).any(-1)
    np.testing.assert_allclose(k_out[written], want_k[written], atol=tol)
    np.testing.assert_array_equal(s_out, want_s)
    assert not np.isnan(v_out[written]).any()


def test_page_writes_list_each_dirty_page_once():
    dest = jnp.asarray([[5, -1, 0, 13, 6, -1], [-1, -1, -1, -1, -1, -1]], jnp.int32)
    dirty, rows = page_writes(dest, 4, 5)
    np.testing.assert_array_equal(np.asarray(dirty), [[0, 1, 3, -1, -1], [-1] * 5])
    np.testing.assert_array_equal(np.asarray(rows)[0, :3],
                                  [[2, -1, -1, -1], [-1, 0, 4, -1], [-1, 3, -1, -1]])
    assert (np.asarray(rows)[1] == -1).all()
