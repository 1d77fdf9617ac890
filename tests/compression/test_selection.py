"""Dynamic (Ada-SnapKV), cross-layer and uniform selection; budget-aware vs adjacent clustering."""

import itertools
import math

import jax
import numpy as np
import pytest

from tangram_jax.compression.clustering import (adjacent_groups, budget_aware_groups,
                                                compare_groupings, group_heads, grouping_memory)
from tangram_jax.compression.selection import (cross_layer_select, dynamic_select,
                                               implicit_retention, uniform_select)


def ref_dynamic(scores, ratio, safeguard):
    """Loop reference: each head's top floor(sg*r*T) first, then the best of the rest overall."""
    h, t = scores.shape
    total = min(math.ceil(ratio * h * t - 1e-6), h * t)
    floor = min(math.floor(safeguard * ratio * t + 1e-6), total // h)
    keep = np.zeros((h, t), bool)
    for i in range(h):
        for j in sorted(range(t), key=lambda j: (-scores[i, j], j))[:floor]:
            keep[i, j] = True
    rest = sorted(((-scores[i, j], j, i) for i in range(h) for j in range(t) if not keep[i, j]))
    for _, j, i in rest[:total - keep.sum()]:
        keep[i, j] = True
    return keep


@pytest.mark.parametrize("seed,heads,t,ratio,safeguard", [
    (0, 3, 50, 0.25, 0.2), (1, 4, 33, 0.5, 0.2), (2, 3, 64, 0.1, 0.5), (3, 2, 17, 0.3, 1.0),
    (4, 5, 20, 1.0, 0.2)])
def test_dynamic_select_properties_and_reference(seed, heads, t, ratio, safeguard):
    rng = np.random.default_rng(seed)
    # Heavy-tailed scores so heads differ strongly: the safeguard actually binds.
    scores = (rng.pareto(1.0, size=(heads, t)) * rng.uniform(0.01, 10, size=(heads, 1))).astype(np.float32)
    sel = dynamic_select(scores, ratio, safeguard=safeguard)
    keep, counts = np.asarray(sel.keep), np.asarray(sel.counts)
    assert counts.sum() == math.ceil(ratio * heads * t - 1e-6)
    assert (counts >= math.floor(safeguard * ratio * t + 1e-6)).all()
    np.testing.assert_array_equal(keep.sum(axis=1), counts)
    np.testing.assert_array_equal(keep, ref_dynamic(scores, ratio, safeguard))
    # Within a head the kept tokens are its best ones.
    for i in range(heads):
        if 0 < counts[i] < t:
            assert scores[i][keep[i]].min() >= scores[i][~keep[i]].max()


def test_dynamic_select_is_non_uniform_and_jittable():
    rng = np.random.default_rng(5)
    scores = rng.uniform(size=(3, 100)).astype(np.float32)
    scores[0] *= 100  # head 0 dominates the shared top-k
    sel = jax.jit(lambda s, r: dynamic_select(s, r, safeguard=0.2))(scores, 0.25)
    counts = np.asarray(sel.counts)
    assert counts.sum() == 75 and counts[1] == counts[2] == 5 and counts[0] == 65
    np.testing.assert_allclose(np.asarray(implicit_retention(sel.counts, 100)), counts / 100)


def test_equal_scores_share_the_budget_across_heads():
    scores = np.tile(np.arange(40, dtype=np.float32), (3, 1))  # every head scores alike
    counts = np.asarray(dynamic_select(scores, 0.25, safeguard=0.0).counts)
    assert counts.sum() == 30 and counts.max() - counts.min() <= 1
    tied = np.ones((3, 40), np.float32)
    sel = dynamic_select(tied, 0.25, safeguard=0.0)
    np.testing.assert_array_equal(np.asarray(sel.counts), [10, 10, 10])
    np.testing.assert_array_equal(sel.keep, ref_dynamic(tied, 0.25, 0.0))


def test_cross_layer_select():
    rng = np.random.default_rng(6)
    scores = rng.exponential(size=(4, 3, 40)).astype(np.float32) * np.array([1, 5, 0.1, 1])[:, None, None]
    sel = cross_layer_select(scores, 0.3, safeguard=0.2)
    counts = np.asarray(sel.counts)
    assert counts.shape == (4, 3) and counts.sum() == math.ceil(0.3 * 4 * 3 * 40)
    assert (counts >= math.floor(0.2 * 0.3 * 40)).all()
    np.testing.assert_array_equal(np.asarray(sel.keep).reshape(12, 40),
                                  ref_dynamic(scores.reshape(12, 40), 0.3, 0.2))
    assert counts[1].sum() > counts[2].sum()  # the high-scoring layer takes more


def test_uniform_select():
    rng = np.random.default_rng(7)
    scores = rng.normal(size=(2, 3, 21)).astype(np.float32)
    sel = uniform_select(scores, 0.3)
    assert (np.asarray(sel.counts) == math.ceil(0.3 * 21)).all()
    for l, h in itertools.product(range(2), range(3)):
        kept = set(np.flatnonzero(np.asarray(sel.keep)[l, h]))
        assert kept == set(np.argsort(-scores[l, h])[:7])


def test_selection_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 2"):
        dynamic_select(np.zeros((2, 3, 4)), 0.5)
    with pytest.raises(ValueError, match="ratio"):
        dynamic_select(np.zeros((2, 4)), 1.5)
    with pytest.raises(ValueError, match="safeguard"):
        dynamic_select(np.zeros((2, 4)), 0.5, safeguard=-0.1)


# -- clustering ------------------------------------------------------------------------------------

def _best_partition_total(budgets_row, g):
    """Brute force: the least sum of group maxima over all partitions into groups of g."""
    heads = list(range(len(budgets_row)))

    def best(rest):
        if not rest:
            return 0.0
        first, others = rest[0], rest[1:]
        return min(max(budgets_row[i] for i in (first,) + combo) +
                   best(tuple(x for x in others if x not in combo))
                   for combo in itertools.combinations(others, g - 1))
    return best(tuple(heads))


@pytest.mark.parametrize("heads,g", [(6, 2), (6, 3), (4, 2), (8, 4), (3, 1), (3, 3)])
def test_budget_aware_is_optimal_and_never_worse_than_adjacent(heads, g):
    rng = np.random.default_rng(heads * 10 + g)
    budgets = rng.uniform(0.02, 1.0, size=(5, heads))
    perm, gb = budget_aware_groups(budgets, g)
    aperm, agb = adjacent_groups(budgets, g)
    assert gb.shape == agb.shape == (5, heads // g)
    np.testing.assert_array_equal(aperm, np.tile(np.arange(heads), (5, 1)))
    for layer in range(5):
        assert sorted(perm[layer]) == list(range(heads))
        for grp in range(heads // g):
            members = perm[layer, grp * g:(grp + 1) * g]
            assert gb[layer, grp] == budgets[layer, members].max()  # group budget = max
            assert agb[layer, grp] == budgets[layer, grp * g:(grp + 1) * g].max()
        assert gb[layer].sum() <= agb[layer].sum() + 1e-12
        assert gb[layer].sum() == pytest.approx(_best_partition_total(budgets[layer], g))
    aware = grouping_memory(budgets, gb, g)
    adjacent = grouping_memory(budgets, agb, g)
    assert aware.head_budget_total <= aware.allocated <= adjacent.allocated
    if g == 1:
        assert aware.relative_to_budgets == pytest.approx(1.0)


def test_compare_groupings_figures():
    budgets = np.array([[0.1, 0.9, 0.2, 0.8]])  # adjacent pairs {0.1,0.9},{0.2,0.8}; sorted {.9,.8},{.2,.1}
    c = compare_groupings(budgets, 2)
    assert c["adjacent_of_full"] == pytest.approx(2 * (0.9 + 0.8) / 4)
    assert c["budget_aware_of_full"] == pytest.approx(2 * (0.9 + 0.2) / 4)
    assert c["reclaimed_vs_adjacent_of_full"] == pytest.approx(0.3)
    assert c["budget_aware_relative_to_budgets"] == pytest.approx(2.2 / 2.0)


def test_clustering_rejects_bad_group_size():
    with pytest.raises(ValueError, match=r"group size 2 does not divide the 3 KV heads.*\[1, 3\]"):
        budget_aware_groups(np.full((2, 3), 0.5), 2)
    with pytest.raises(ValueError, match="unknown grouping"):
        group_heads(np.full((2, 3), 0.5), 1, "random")
