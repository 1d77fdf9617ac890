"""Split maps (AOT / uniform, untiered and over precision tiers' tier groups) and the runtime
planner: shapes, proportionality, and that the decode kernel's share rule (a group's blocks cut
into equal runs) covers every page of every group exactly once, with one pool or a launch per
tier."""

import dataclasses

import numpy as np
import pytest

from tangram_jax.pallas_kernels import split_map as sm


def _shares(length, split, num_splits, page_size, pages_per_block):
    """The decode kernel's share rule, written out independently in numpy: the pages of item
    `split` of `num_splits` of a group of `length` tokens, whose B blocks are cut into the
    runs [floor(split B / n), floor((split + 1) B / n))."""
    if num_splits == 0:
        return range(0)
    pages = -(-int(length) // page_size)
    blocks = -(-pages // pages_per_block)
    lo, hi = split * blocks // num_splits, (split + 1) * blocks // num_splits
    return range(lo * pages_per_block, min(hi * pages_per_block, pages))


def _covered_once(work, lengths, page_size, pages_per_block):
    """work [batch, items, 3] over lengths [batch, groups]: every page read by one item."""
    batch, groups = lengths.shape
    for b in range(batch):
        seen = [[] for _ in range(groups)]
        for g, k, n in work[b]:
            if n:
                seen[g].extend(_shares(lengths[b, g], k, n, page_size, pages_per_block))
        for g in range(groups):
            pages = -(-int(lengths[b, g]) // page_size)
            assert sorted(seen[g]) == list(range(pages)), (b, g)


def test_aot_map_is_proportional_and_same_size_per_layer():
    rng = np.random.default_rng()
    budgets = rng.uniform(0.02, 1.0, size=(6, 4))
    budgets[0] = [0.05, 0.1, 0.25, 0.85]
    for batch in (1, 4, 64):
        m = sm.build_split_map(budgets, 528, batch, group_size=2)
        assert m.num_items >= sm.items_per_row(528, batch, 2, 4, 256)
        lists = m.work_lists()
        assert lists.shape == (6, m.num_items, 3) and lists.dtype == np.int32
        for layer, s in enumerate(m.splits):
            s = np.array(s)
            assert (s >= 1).all() and s.sum() <= m.num_items
            # min-max optimal: moving one split from any group to the worst one cannot help.
            worst = (budgets[layer] / s).max()
            for g in range(4):
                if s[g] > 1:
                    t = s.copy()
                    t[g] -= 1
                    t[np.argmax(budgets[layer] / s)] += 1
                    assert (budgets[layer] / t).max() >= worst - 1e-12
    m = sm.build_split_map(budgets[:1], 528, 1, group_size=2)
    assert m.splits[0][3] > 10 * m.splits[0][0]          # skew follows the budgets
    assert hash(m) == hash(sm.build_split_map(budgets[:1], 528, 1, group_size=2))


def test_uniform_map_and_validation():
    m = sm.uniform_split_map(3, 4, 5)
    assert m.splits == ((5,) * 4,) * 3 and m.num_items == 20
    with pytest.raises(ValueError):
        sm.build_split_map(np.array([[0.0, 0.5]]), 64, group_size=2)
    with pytest.raises(ValueError):
        sm.build_split_map(np.array([0.5, 0.5]), 64, group_size=2)
    with pytest.raises(ValueError):
        sm.uniform_split_map(1, 4, 0)
    with pytest.raises(ValueError):
        sm.plan_runtime_work(np.array([[-1, 3]]), 64, 16, group_size=2)


@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_every_work_list_covers_every_page_once(pages_per_block):
    rng = np.random.default_rng()
    ps = 16
    lengths = rng.integers(0, 3000, size=(5, 4))
    lengths[0] = [0, 1, ps, 4 * ps]
    lengths[1, 3] = 20000
    budgets = np.array([[0.05, 0.1, 0.25, 0.85]])
    aot = sm.build_split_map(budgets, 200, 5, group_size=2).work_list(0)
    uniform = sm.uniform_split_map(1, 4, 7).work_list(0)
    for work in (np.broadcast_to(aot, (5, *aot.shape)), np.broadcast_to(uniform, (5, 28, 3)),
                 sm.plan_runtime_work(lengths, 200, ps, group_size=2)):
        _covered_once(work, lengths, ps, pages_per_block)
    # Precision tiers: each tier's launch covers its tier groups (``2 g + t``) of every row,
    # ragged, some empty; the tiered AOT map (shares 0 and 1 included) and uniform splits.
    tier_lengths = rng.integers(0, 1500, size=(5, 8))
    tier_lengths[0] = [0, 0, 0, 5 * ps, 3 * ps + 1, 0, 1, 20000]
    tiered_aot = sm.build_tier_split_map(budgets, np.array([[0.0, 0.3, 0.7, 1.0]]), (208, 112),
                                         200, 5, group_size=2)
    for smap in (tiered_aot, sm.uniform_split_map(1, 8, 3, tiered=True)):
        for tier, work in enumerate(smap.tier_work_lists()):
            _covered_once(np.broadcast_to(work[0], (5, *work.shape[1:])),
                          tier_lengths[:, tier::2], ps, pages_per_block)


def _item_shares(work, budgets):
    """Each active row's expected tokens (its group's budget over its splits), in list order."""
    rows = work[work[:, 2] > 0]
    return budgets[rows[:, 0]] / rows[:, 2]


def test_aot_work_lists_put_the_longest_items_first():
    """AOT maps list items longest first (untiered, and each tier's list by its tier groups'
    expected work a split); a uniform map and a map without group_orders keep group order;
    group_orders must be a permutation per layer."""
    budgets = np.array([[0.8, 0.2, 0.6, 0.4], [0.1, 0.9, 0.3, 0.5]])
    m = sm.build_split_map(budgets, 200, 4, group_size=2)
    for layer in range(2):
        shares = _item_shares(m.work_list(layer), budgets[layer])
        assert (np.diff(shares) <= 1e-12).all(), shares
    assert m.group_orders[1] == tuple(sm.longest_first(budgets[1], m.splits[1]))
    # The same splits in group order: rows sorted by group.
    plain = dataclasses.replace(m, group_orders=None).work_list(0)
    active = plain[plain[:, 2] > 0]
    assert (np.diff(active[:, 0]) >= 0).all()
    assert sorted(map(tuple, active)) == sorted(map(tuple, m.work_list(0)[:len(active)]))
    assert (sm.uniform_split_map(1, 4, 3).work_list(0)[:, 0] == np.repeat(np.arange(4), 3)).all()
    share = np.array([[0.9, 0.1, 0.5, 0.5]])
    tiered = sm.build_tier_split_map(budgets[:1], share, (208.0, 112.0), 200, 4, group_size=2)
    tier_work = np.stack([budgets[0] * share[0] * 208, budgets[0] * (1 - share[0]) * 112],
                         axis=-1)                                        # [groups, tier]
    for tier, lists in enumerate(tiered.tier_work_lists()):
        shares = _item_shares(lists[0], tier_work[:, tier])
        assert (np.diff(shares) <= 1e-9).all(), (tier, shares)
    with pytest.raises(ValueError, match="group_orders"):
        dataclasses.replace(m, group_orders=((0, 1, 2, 2), (0, 1, 2, 3)))


def test_runtime_plan_balances_by_actual_length():
    lengths = np.array([[100, 100, 100, 100_000], [0, 0, 0, 0]])
    work = sm.plan_runtime_work(lengths, 256, 16, group_size=2)
    assert work.shape == (2, 64, 3)
    splits_long = (work[0, :, 0] == 3) & (work[0, :, 2] > 0)
    assert splits_long.sum() >= 55                      # nearly all items go to the long group
    assert ((work[1, :, 2] > 0).sum()) == 4             # empty row: one no-op split per group


def test_split_map_weighs_groups_by_bytes_to_read():
    """Equal budgets but one group's tokens cost 4x the bytes (bf16 against K4V2-like pages):
    that group gets ~4x the splits; a uniform byte cost leaves the map unchanged."""
    budgets = np.array([[0.5, 0.5], [0.2, 0.8]])
    plain = sm.build_split_map(budgets, 528, 4, group_size=2)
    assert sm.build_split_map(budgets, 528, 4, group_size=2, bytes_per_token=3.5) == plain
    cost = np.array([[4.0, 1.0], [1.0, 1.0]])
    m = sm.build_split_map(budgets, 528, 4, group_size=2, bytes_per_token=cost)
    a, b = m.splits[0]
    assert 3.5 <= a / b <= 4.5, m.splits[0]
    assert m.splits[1] == plain.splits[1]
    with pytest.raises(ValueError, match="bytes_per_token"):
        sm.build_split_map(budgets, 528, group_size=2, bytes_per_token=np.ones((2, 3)))


def test_tier_split_map_weighs_tier_groups_by_bytes_and_cuts_by_tier():
    """Over the tier groups (2 g high, 2 g + 1 low) the splits follow budget x share x the
    tier's bytes; the two tiers' lists hold exactly the map's splits of their tier groups, as
    rows of the base groups; empty tiers get one item each without raising the item count
    (the floor); each launch is sized for about num_programs programs."""
    budgets = np.array([[0.2, 0.4, 0.6, 0.8], [0.5, 0.5, 0.5, 0.5]])
    share = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.5, 0.25]])
    m = sm.build_tier_split_map(budgets, share, (208.0, 112.0), 528, 4, group_size=2)
    assert m.tiered and m.num_groups == 8 and m.num_layers == 2
    work = np.stack([budgets * share * 208, budgets * (1 - share) * 112], -1).reshape(2, 8)
    s0 = np.array(m.splits[0])
    ratio = work[0] / s0                          # bytes per item: balanced across both tiers
    assert ratio.max() <= 1.3 * ratio.min(), m.splits[0]
    s1 = m.splits[1]
    assert s1[1] == 1 and s1[2] == 1                   # the empty tiers: one no-op item each
    assert s1[0] > 1.5 * s1[3]                         # 104 B-units against 56
    # Each launch sized for ~num_programs: the untiered rule at twice the programs.
    assert m.num_items >= sm.items_per_row(2 * 528, 4, 2, 8, 256)
    # At a large batch the items are raised for balance, bounded by the floor (empty tiers
    # would otherwise ask for sum(w) / 0 and get 8 x max_splits).
    big = sm.build_tier_split_map(budgets, share, (208.0, 112.0), 528, 64, group_size=2)
    assert sm.items_per_row(2 * 528, 64, 2, 8, 256) < big.num_items <= 8 / sm.TIER_WORK_FLOOR
    high, low = m.tier_work_lists()
    for tier, lists in ((0, high), (1, low)):
        assert lists.dtype == np.int32 and lists.shape[0] == 2
        for layer in range(2):
            rows = lists[layer][lists[layer, :, 2] > 0]
            for g in range(4):
                mine = rows[rows[:, 0] == g]
                n = m.splits[layer][2 * g + tier]
                assert sorted(mine[:, 1]) == list(range(n)) and (mine[:, 2] == n).all()
    with pytest.raises(ValueError, match="tier_work_lists"):
        sm.build_split_map(budgets, 528, 4, group_size=2).tier_work_lists()
    with pytest.raises(ValueError, match="tier_work_lists"):
        m.work_lists()
    with pytest.raises(ValueError, match="high_share"):
        sm.build_tier_split_map(budgets, share[:1], (208.0, 112.0), 528, group_size=2)
    with pytest.raises(ValueError, match="tier_bytes_per_token"):
        sm.build_tier_split_map(budgets, share, (208.0,), 528, group_size=2)
    with pytest.raises(ValueError, match="two tier groups"):
        sm.uniform_split_map(1, 3, 2, tiered=True)
