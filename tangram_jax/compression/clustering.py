"""Head grouping: which KV heads of a layer share one page table, and the budget of each group.

Every member of a group keeps the group's count of tokens, so a group allocates ``G * max(b)``
of its members' budgets b. Grouping heads of similar budget wastes least:

- budget-aware (Tangram): per layer, sort heads by budget and cut the order into runs of G. For
  equal-size groups this minimises the sum of group maxima (exchange argument: any grouping can be
  turned into the sorted one without raising a group's max).
- adjacent: heads in index order (what a layout oblivious to budgets does).

Both return ``head_perm [layers, kv_heads]`` (group g of layer l holds heads
``head_perm[l, g*G:(g+1)*G]``, as `KVLayout` reads it) and ``group_budgets [layers, groups]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

GROUPINGS = ("budget", "adjacent")


def _check(budgets: np.ndarray, group_size: int) -> np.ndarray:
    b = np.asarray(budgets, dtype=np.float64)
    if b.ndim != 2:
        raise ValueError(f"head budgets must be [layers, kv_heads], got shape {b.shape}")
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"group size must be a positive int, got {group_size!r}")
    if b.shape[1] % group_size:
        divisors = [g for g in range(1, b.shape[1] + 1) if b.shape[1] % g == 0]
        raise ValueError(f"group size {group_size} does not divide the {b.shape[1]} KV heads of "
                         f"each layer; valid group sizes: {divisors}")
    return b


def _group_max(budgets: np.ndarray, head_perm: np.ndarray, group_size: int) -> np.ndarray:
    ordered = np.take_along_axis(budgets, head_perm, axis=1)
    layers, heads = budgets.shape
    return ordered.reshape(layers, heads // group_size, group_size).max(axis=2)


def budget_aware_groups(budgets: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """budgets [layers, kv_heads] -> (head_perm int32 [layers, kv_heads], group_budgets [layers, groups]).

    Heads are sorted by descending budget (ties by index), so group 0 is the largest.
    """
    b = _check(budgets, group_size)
    perm = np.argsort(-b, axis=1, kind="stable").astype(np.int32)
    return perm, _group_max(b, perm, group_size)


def adjacent_groups(budgets: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Heads grouped in index order: head_perm is the identity."""
    b = _check(budgets, group_size)
    perm = np.tile(np.arange(b.shape[1], dtype=np.int32), (b.shape[0], 1))
    return perm, _group_max(b, perm, group_size)


def group_heads(budgets: np.ndarray, group_size: int,
                grouping: str = "budget") -> tuple[np.ndarray, np.ndarray]:
    """Dispatch on `grouping` ('budget' or 'adjacent')."""
    if grouping == "budget":
        return budget_aware_groups(budgets, group_size)
    if grouping == "adjacent":
        return adjacent_groups(budgets, group_size)
    raise ValueError(f"unknown grouping {grouping!r}; expected one of {GROUPINGS}")


@dataclasses.dataclass(frozen=True)
class GroupingMemory:
    """What one grouping allocates, in units of one head's full cache.

    allocated: G * sum of group budgets; head_budget_total: sum of head budgets (the ideal);
    full: layers * kv_heads (the uncompressed cache).
    """

    allocated: float
    head_budget_total: float
    full: float

    @property
    def relative_to_budgets(self) -> float:
        """allocated / sum of head budgets (1 = no waste)."""
        return self.allocated / self.head_budget_total

    @property
    def waste_of_full(self) -> float:
        """(allocated - sum of head budgets) / full cache."""
        return (self.allocated - self.head_budget_total) / self.full

    @property
    def relative_to_full(self) -> float:
        return self.allocated / self.full


def grouping_memory(budgets: np.ndarray, group_budgets: np.ndarray, group_size: int) -> GroupingMemory:
    """Memory a grouping allocates for head `budgets` [layers, kv_heads]."""
    b = _check(budgets, group_size)
    gb = np.asarray(group_budgets, dtype=np.float64)
    if gb.shape != (b.shape[0], b.shape[1] // group_size):
        raise ValueError(f"group_budgets has shape {gb.shape}, expected "
                         f"{(b.shape[0], b.shape[1] // group_size)}")
    return GroupingMemory(allocated=float(group_size * gb.sum()), head_budget_total=float(b.sum()),
                          full=float(b.size))


def compare_groupings(budgets: np.ndarray, group_size: int) -> dict:
    """Budget-aware vs adjacent memory at `group_size`; fractions of the full cache saved."""
    aware = grouping_memory(budgets, budget_aware_groups(budgets, group_size)[1], group_size)
    adjacent = grouping_memory(budgets, adjacent_groups(budgets, group_size)[1], group_size)
    return dict(
        group_size=group_size,
        budget_aware_relative_to_budgets=aware.relative_to_budgets,
        adjacent_relative_to_budgets=adjacent.relative_to_budgets,
        budget_aware_of_full=aware.relative_to_full,
        adjacent_of_full=adjacent.relative_to_full,
        budget_aware_waste_of_full=aware.waste_of_full,
        adjacent_waste_of_full=adjacent.waste_of_full,
        # The paper's figure: memory of the full cache that clustering reclaims over adjacent.
        reclaimed_vs_adjacent_of_full=adjacent.relative_to_full - aware.relative_to_full,
    )
