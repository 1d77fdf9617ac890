"""Precision tiers (`kv_layout.TieredLayout`): the tiered retained-count formula, and the
KV-cache manager reserving exactly it per (layer, group, tier)."""

import math

import numpy as np
import pytest

from tangram_jax.kv_layout import KVLayout, TieredLayout, chunk_keep_count, pages_for
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager


def _layout(tail_rule="window", tail_window=5, chunk=16):
    rng = np.random.default_rng(3)
    layers, heads, g = 3, 4, 2
    budgets = np.round(rng.uniform(0.1, 1.0, (layers, heads // g)), 3)
    budgets[0, 0] = 1.0
    base = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=8, group_size=g,
                    page_size=4, chunk_size=chunk,
                    head_perm=np.tile(np.arange(heads), (layers, 1)), group_budgets=budgets,
                    tail_rule=tail_rule, tail_window=tail_window)
    high = np.round(rng.uniform(0, 1, budgets.shape), 3)
    high[1, 0], high[2, 1] = 0.0, 1.0
    return TieredLayout(base, high)


def _by_chunks(tiered, n):
    """The tier rule chunk by chunk, as the prefill writes them (independent of the class's
    closed form): [layers, groups, 2] (high, low)."""
    base = tiered.base
    out = np.zeros((*base.group_budgets.shape, 2), np.int64)
    for start in range(0, n, base.chunk_size):
        length = min(base.chunk_size, n - start)
        p = base.chunk_protected(n, start, length)
        kept = chunk_keep_count(base.group_budgets, length - p)
        for idx in np.ndindex(kept.shape):
            k = int(kept[idx])
            high = min(k, max(0, math.ceil(tiered.high_share[idx] * k - 1e-6)))
            out[idx] += (high + p, k - high)
    return out


@pytest.mark.parametrize("tail", [("window", 5), ("final_chunk", 0), ("none", 0)])
def test_tier_counts_follow_the_chunk_rule_and_sum_to_the_budget(tail):
    tiered = _layout(*tail)
    for n in (0, 1, 5, 15, 16, 17, 40, 64, 100):
        counts = tiered.retained_counts(n)
        assert counts.shape == (3, 4)
        split = counts.reshape(3, 2, 2)
        np.testing.assert_array_equal(split, _by_chunks(tiered, n))
        np.testing.assert_array_equal(split.sum(-1), tiered.base.retained_counts(n))
    # Share 0: the low tier takes every compressed token, share 1: none.
    counts = tiered.retained_counts(100).reshape(3, 2, 2)
    tail_len = tiered.base.protected_tail(100)
    assert counts[1, 0, 0] == tail_len and counts[2, 1, 1] == 0


def test_tiered_layout_rejects_bad_shares():
    base = _layout().base
    with pytest.raises(ValueError, match="high_share has shape"):
        TieredLayout(base, np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"high_share must lie in \[0, 1\]"):
        TieredLayout(base, np.full((3, 2), 1.5))
    with pytest.raises(ValueError, match="precision must be one of"):
        TieredLayout(base, np.zeros((3, 2)), precision="k8v8-k2v2")


def test_manager_reserves_each_tier_exactly_and_decode_fills_the_high_tier():
    tiered = _layout()
    manager = KVCacheManager(tiered, num_pages=400, max_seqs=2, max_pages_per_group=40,
                             model_kv_shape=(3, 4, 8))
    assert manager.lengths.shape == (3, 3, 4)              # [rows, layers, groups * tiers]
    slot = manager.allocate_slot()
    turn = 70
    assert manager.reserve(slot, turn)
    want = _by_chunks(tiered, turn).reshape(3, 4)
    np.testing.assert_array_equal(manager.reserved_lengths[slot], want)
    np.testing.assert_array_equal(manager.table.num_pages[slot], pages_for(want, 4))
    # The prefill's pieces (chunk boundaries) commit exactly the reservation.
    for start in range(0, turn, 32):
        manager.commit_prefill(slot, min(32, turn - start), start=start, turn_len=turn)
    np.testing.assert_array_equal(manager.lengths[slot], want)
    # Decode tokens go to the high tier only.
    for _ in range(6):
        assert manager.grow_for_decode(np.array([slot])).all()
    grown = manager.lengths[slot] - want
    assert (grown[:, 0::2] == 6).all() and (grown[:, 1::2] == 0).all()
    np.testing.assert_array_equal(manager.table.num_pages[slot],
                                  pages_for(manager.lengths[slot], 4))
    # A second turn on top: the reservation grows by the formula of the new tokens.
    before = manager.lengths[slot].copy()
    assert manager.reserve(slot, 23)
    np.testing.assert_array_equal(manager.reserved_lengths[slot],
                                  before + _by_chunks(tiered, 23).reshape(3, 4))
    manager.free(slot)
    assert manager.pool.num_used == 0
