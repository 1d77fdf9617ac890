"""Split maps (AOT / uniform) and the runtime planner: shapes, proportionality, and that the
decode kernel's share rule (a group's blocks cut by cost) covers every page of every group
exactly once, with one pool or precision tiers."""

import numpy as np
import pytest

from tangram_jax.pallas_kernels import split_map as sm


def _shares(lengths, split, num_splits, page_size, pages_per_block, costs=(1,)):
    """The decode kernel's share rule, written out independently in numpy: per tier, the pages
    of item `split` of `num_splits`. A group's blocks are its tiers' (`lengths`, one per tier)
    one after the other, block b of tier t costing costs[t]; the item takes the blocks whose
    cost starts in [split W / n, (split + 1) W / n), W the group's total cost."""
    if num_splits == 0:
        return [range(0) for _ in lengths]
    pages = [-(-int(n) // page_size) for n in lengths]
    blocks = [-(-p // pages_per_block) for p in pages]
    starts = np.cumsum([0] + [b * c for b, c in zip(blocks, costs)])[:-1]
    total = sum(b * c for b, c in zip(blocks, costs))
    lo, hi = split * total // num_splits, (split + 1) * total // num_splits
    out = []
    for p, b, c, start in zip(pages, blocks, costs, starts):
        mine = [i for i in range(b) if lo <= start + i * c < hi]
        out.append(range(0) if not mine else
                   range(mine[0] * pages_per_block, min((mine[-1] + 1) * pages_per_block, p)))
    return out


def _covered_once(work, lengths, page_size, pages_per_block, costs=(1,)):
    """lengths [batch, groups * tiers] (tier t of group g at g * tiers + t)."""
    tiers = len(costs)
    batch, groups = lengths.shape[0], lengths.shape[1] // tiers
    for b in range(batch):
        seen = [[[] for _ in range(tiers)] for _ in range(groups)]
        for g, k, n in work[b]:
            if n:
                lens = lengths[b, g * tiers:(g + 1) * tiers]
                for t, pages in enumerate(_shares(lens, k, n, page_size, pages_per_block, costs)):
                    seen[g][t].extend(pages)
        for g in range(groups):
            for t in range(tiers):
                pages = -(-int(lengths[b, g * tiers + t]) // page_size)
                assert sorted(seen[g][t]) == list(range(pages)), (b, g, t)


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
    # Precision tiers (K8V4 : K4V2 bytes 13 : 7): each group's two tiers, ragged, one empty.
    tier_lengths = rng.integers(0, 1500, size=(5, 8))
    tier_lengths[0] = [0, 0, 0, 5 * ps, 3 * ps + 1, 0, 1, 20000]
    for work in (np.broadcast_to(aot, (5, *aot.shape)), np.broadcast_to(uniform, (5, 28, 3))):
        _covered_once(work, tier_lengths, ps, pages_per_block, costs=(13, 7))


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
