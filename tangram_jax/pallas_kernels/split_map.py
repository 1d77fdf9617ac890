"""Workload split maps: how the decode attention grid's work items are cut across head groups.

The decode kernel (`decode_attention.py`) runs a grid of ``(batch, item, head_in_group)``; a work
item is one row ``(group, split, num_splits)`` of a *work list*, and covers share ``split`` of
``num_splits`` of that group's compute blocks, found at run time from the group's length.
Three ways of making the work list feed that one kernel:

- `build_split_map` (Tangram, ahead of time): from the calibrated group budgets, per layer, the
  splits of group g are proportional to its expected work ``G * r_g`` times the bytes of one of
  its tokens (quantised pages read fewer; apportioned so that the
  largest expected tokens-per-split ``r_g / s_g`` is as small as possible, each ``s_g >= 1``).
  Static: hashed into the jitted decode step, never recomputed while serving.
  With precision tiers (`build_tier_split_map`) the map is over the tier groups, weighed by
  their tiers' bytes, and cut into one work list per tier (`SplitMap.tier_work_lists`).
- `uniform_split_map` (FlashDecoding-style baseline): the same number of splits for every group.
- `plan_runtime_work` (FlashInfer-style baseline): recomputed on the host at every decode step for
  every layer from the actual lengths, then copied to the device as an int32 array.

Batch-bucket rule (documented choice): the grid should hold about `num_programs` programs
(``num_programs ~ SMs x resident programs per SM``). The grid is ``batch x items x G``, so a map is
built per batch bucket with ``items = clamp(round(num_programs / (batch * G)), groups,
groups * max_splits)``, raised to ``ceil(sum_g r_g / min_g r_g)`` for the AOT map so that large
batches still split in proportion; every layer of one map has the same item count (layers
whose capped splits fall short are padded with no-op items, ``num_splits = 0``), so one compiled
kernel serves all layers. The engine keeps one map per batch bucket (e.g. 1, 2, 4, ... 64),
padding the batch up.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

# Columns of a work list row.
WORK_GROUP, WORK_SPLIT, WORK_NUM_SPLITS = 0, 1, 2


def items_per_row(num_programs: int, batch: int, group_size: int, num_groups: int,
                  max_splits: int) -> int:
    """Work items per batch row for a grid of about `num_programs` programs (the bucket rule)."""
    for name, v in (("num_programs", num_programs), ("batch", batch), ("group_size", group_size),
                    ("num_groups", num_groups), ("max_splits", max_splits)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    items = int(round(num_programs / (batch * group_size)))
    return int(min(max(items, num_groups), num_groups * max_splits))


@dataclasses.dataclass(frozen=True)
class SplitMap:
    """Splits per (layer, group) for one batch bucket; hashable (a static jit argument).

    Attributes:
      splits: per layer, a tuple of splits per group (each >= 1).
      num_items: work items per batch row, the same for every layer (>= max sum of a layer).
      batch: the batch bucket the map was sized for (informational; any batch works).
      name: label for reports (``aot``, ``uniform``).
      tiered: the groups are the tier groups of precision tiers (``2 g`` group g's high tier,
        ``2 g + 1`` its low tier), each tier's items a list of their own: `tier_work_lists`.
      group_orders: per layer, the order of its groups' items in a work list (a
        permutation of the groups): the AOT maps' is longest item first (`longest_first`);
        None (uniform maps): group order.
    """

    splits: tuple[tuple[int, ...], ...]
    num_items: int
    batch: int = 1
    name: str = "aot"
    tiered: bool = False
    group_orders: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if not self.splits or len({len(s) for s in self.splits}) != 1:
            raise ValueError("splits must be a non-empty tuple of equal-length per-layer tuples")
        for layer, s in enumerate(self.splits):
            if min(s) < 1:
                raise ValueError(f"layer {layer}: every group needs >= 1 split, got {s}")
            if sum(s) > self.num_items:
                raise ValueError(f"layer {layer}: {sum(s)} splits exceed num_items "
                                 f"{self.num_items}")
        if self.tiered and len(self.splits[0]) % 2:
            raise ValueError(f"a tiered map has two tier groups per group, got "
                             f"{len(self.splits[0])} groups")
        if self.group_orders is not None and (
                len(self.group_orders) != len(self.splits) or
                any(sorted(o) != list(range(len(s)))
                    for o, s in zip(self.group_orders, self.splits))):
            raise ValueError(f"group_orders must be a permutation of the groups "
                             f"0..{len(self.splits[0]) - 1} for each of the "
                             f"{len(self.splits)} layers, got {self.group_orders!r}")

    @property
    def num_layers(self) -> int:
        return len(self.splits)

    @property
    def num_groups(self) -> int:
        return len(self.splits[0])

    def group_order(self, layer: int) -> list[int]:
        """The layer's groups in the order their items are listed (`group_orders`)."""
        if self.group_orders is None:
            return list(range(len(self.splits[layer])))
        return list(self.group_orders[layer])

    def _rows(self, layer: int, groups: list[int], group_id=lambda g: g) -> list[tuple]:
        return [(group_id(g), k, self.splits[layer][g]) for g in groups
                for k in range(self.splits[layer][g])]

    def work_list(self, layer: int) -> np.ndarray:
        """int32 [num_items, 3] rows (group, split, num_splits), in `group_order`; padding
        rows are (0, 0, 0)."""
        rows = self._rows(layer, self.group_order(layer))
        out = np.zeros((self.num_items, 3), np.int32)
        out[:len(rows)] = rows
        return out

    def work_lists(self) -> np.ndarray:
        """int32 [layers, num_items, 3]: every layer's work list (scan-friendly)."""
        if self.tiered:
            raise ValueError("a tiered map's groups are tier groups: use tier_work_lists")
        return np.stack([self.work_list(layer) for layer in range(self.num_layers)])

    def tier_work_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """A tiered map cut into the work lists of its tiers: (high, low), each int32
        [layers, items, 3] rows (group g of the base layout, split, num_splits) in
        `group_order`, padded with (0, 0, 0) rows (no-ops) to the most items a layer has in
        that tier."""
        if not self.tiered:
            raise ValueError("tier_work_lists needs a tiered map (build_tier_split_map)")
        out = []
        for tier in (0, 1):
            rows = [self._rows(layer, [g for g in self.group_order(layer) if g % 2 == tier],
                               lambda g: g // 2) for layer in range(self.num_layers)]
            lists = np.zeros((self.num_layers, max(len(r) for r in rows), 3), np.int32)
            for layer, r in enumerate(rows):
                lists[layer, :len(r)] = r
            out.append(lists)
        return out[0], out[1]


def _min_max_apportion(weights: np.ndarray, total: int, cap: int) -> list[int]:
    """Integers s >= 1, s <= cap, sum <= total, minimising max(weights / s) (greedy is optimal)."""
    s = [1] * len(weights)
    heap = [(-float(w), g) for g, w in enumerate(weights)]
    heapq.heapify(heap)
    left = total - len(weights)
    while left > 0 and heap:
        _, g = heapq.heappop(heap)
        if s[g] >= cap:
            continue
        s[g] += 1
        left -= 1
        if s[g] < cap:
            heapq.heappush(heap, (-float(weights[g]) / s[g], g))
    return s


def build_split_map(group_budgets: np.ndarray, num_programs: int, batch: int = 1, *,
                    group_size: int, max_splits: int = 256,
                    bytes_per_token: float | np.ndarray = 1.0) -> SplitMap:
    """The ahead-of-time split map from calibrated budgets.

    group_budgets: float [layers, groups] in (0, 1]. Per layer the splits are proportional to
    the bytes a group's share reads, ``G * r_g * bytes_per_token_g`` (min-max apportionment of
    `items_per_row(...)` items, each group >= 1 split, at most `max_splits`).
    bytes_per_token: KV bytes one retained token of a group costs (a scalar, or [layers,
    groups] when groups hold pages of different precisions, `kv_quant.page_bytes` per slot;
    precision tiers: `build_tier_split_map`);
    decode attention is bound by the bytes it reads, not the tokens. A scalar leaves the map
    as the budgets alone make it.
    """
    budgets = np.asarray(group_budgets, dtype=np.float64)
    if budgets.ndim != 2 or budgets.shape[1] < 1:
        raise ValueError(f"group_budgets must be [layers, groups], got shape {budgets.shape}")
    if not (np.isfinite(budgets).all() and (budgets > 0).all() and (budgets <= 1).all()):
        raise ValueError("group budgets must lie in (0, 1]")
    cost = np.asarray(bytes_per_token, dtype=np.float64)
    if not (np.isfinite(cost).all() and (cost > 0).all()) or (
            cost.ndim and cost.shape != budgets.shape):
        raise ValueError(f"bytes_per_token must be a positive scalar or [layers, groups] = "
                         f"{budgets.shape}, got {bytes_per_token!r}")
    return _apportion(budgets * cost, num_programs, batch, group_size, max_splits, "aot")


def _apportion(work: np.ndarray, num_programs: int, batch: int, group_size: int,
               max_splits: int, name: str, tiered: bool = False,
               work_floor: float = 0.0) -> SplitMap:
    """The map of expected work [layers, groups] >= 0, each layer's sum > 0 (the bucket rule,
    then min-max splits; every group gets at least one). work_floor: a group's work counts at
    least this share of its layer's mean for the items raised for balance."""
    num_groups = work.shape[1]
    items = items_per_row(num_programs, batch, group_size, num_groups, max_splits)
    # Large batches leave few items per row; the least-work group still needs one, so keep
    # enough items that the others can get splits in proportion (sum(w) / min(w) per layer).
    least = np.maximum(work.min(axis=1), work_floor * work.mean(axis=1))
    balance = int(np.ceil((work.sum(axis=1) / least).max() - 1e-9))
    items = min(max(items, balance), num_groups * max_splits)
    splits = tuple(tuple(_min_max_apportion(group_size * row, items, max_splits))
                   for row in work)
    return SplitMap(splits=splits, num_items=items, batch=int(batch), name=name, tiered=tiered,
                    group_orders=tuple(longest_first(row, s) for row, s in zip(work, splits)))


def longest_first(work: np.ndarray, splits) -> tuple[int, ...]:
    """Groups by expected work a split (``work / splits``), the longest first (ties in group
    order): the order of an AOT map's work items.

    Why: the decode grid's programs start in list order (its axes are (batch, item, head of
    the group), the batch fastest) and an SM that frees a slot takes the next program. In
    group order the calibrated budgets can put the longest items last, so a launch of more
    programs than slots ends on a round of its longest ones; longest first (LPT list
    scheduling) ends it on the shortest."""
    return tuple(sorted(range(len(splits)), key=lambda g: -float(work[g]) / splits[g]))


# For the items raised for balance, sum(w) / min(w), a tier group expected to read less than
# this share of its layer's mean tier group counts as that much: an empty tier (a high share of
# 0 or 1) would otherwise raise them without bound, and its one work item is cheap anyway.
TIER_WORK_FLOOR = 1 / 8


def build_tier_split_map(group_budgets: np.ndarray, high_share: np.ndarray,
                         tier_bytes_per_token: tuple[float, float], num_programs: int,
                         batch: int = 1, *, group_size: int, max_splits: int = 256) -> SplitMap:
    """The ahead-of-time split map of precision tiers (`kv_layout.TieredLayout`), whose tiers
    are read by one decode launch each (`SplitMap.tier_work_lists` cuts it into their lists).

    Over the tier groups (``2 g`` high, ``2 g + 1`` low), each weighed by the bytes it is
    expected to read: ``G r_g h_g b_high`` and ``G r_g (1 - h_g) b_low``, so the items of both
    tiers are apportioned by bytes, not tokens, as one map (the rule the tiered decode
    benchmark measured); every tier group gets at least one item (a no-op where its tier is
    empty). Sized for about 2 x `num_programs` programs (the bucket rule over 2 x
    num_programs): the size measured fastest for the tiers' one launch on an H100 (2x and 4x
    the programs are 4% slower at 32 x 32k), as it was when each tier had a launch of its own.

    group_budgets: float [layers, groups] in (0, 1]; high_share: float [layers, groups] in
    [0, 1], the calibrated share of a group's retained tokens in the high tier;
    tier_bytes_per_token: (high, low) bytes of one retained (token, head) slot of each tier's
    page format (`kv_quant.page_bytes` per slot).
    """
    budgets = np.asarray(group_budgets, dtype=np.float64)
    share = np.asarray(high_share, dtype=np.float64)
    if budgets.ndim != 2 or budgets.shape[1] < 1:
        raise ValueError(f"group_budgets must be [layers, groups], got shape {budgets.shape}")
    if not (np.isfinite(budgets).all() and (budgets > 0).all() and (budgets <= 1).all()):
        raise ValueError("group budgets must lie in (0, 1]")
    if share.shape != budgets.shape or not (np.isfinite(share).all() and (share >= 0).all()
                                             and (share <= 1).all()):
        raise ValueError(f"high_share must be [layers, groups] = {budgets.shape} in [0, 1], got "
                         f"shape {share.shape}")
    cost = np.asarray(tier_bytes_per_token, dtype=np.float64)
    if cost.shape != (2,) or not (np.isfinite(cost).all() and (cost > 0).all()):
        raise ValueError(f"tier_bytes_per_token must be positive (high, low) bytes, got "
                         f"{tier_bytes_per_token!r}")
    work = np.stack([budgets * share * cost[0], budgets * (1 - share) * cost[1]],
                    axis=-1).reshape(budgets.shape[0], -1)
    return _apportion(work, 2 * num_programs, batch, group_size, max_splits, "aot",
                      tiered=True, work_floor=TIER_WORK_FLOOR)


def uniform_split_map(num_layers: int, num_groups: int, splits: int, *,
                      tiered: bool = False) -> SplitMap:
    """FlashDecoding-style: `splits` splits for every group of every layer (with `tiered`, of
    every tier group: `num_groups` counts them)."""
    if min(num_layers, num_groups, splits) < 1:
        raise ValueError(f"num_layers ({num_layers}), num_groups ({num_groups}) and splits "
                         f"({splits}) must be >= 1")
    return SplitMap(splits=((int(splits),) * num_groups,) * num_layers,
                    num_items=num_groups * int(splits), name="uniform", tiered=tiered)


def plan_runtime_work(lengths: np.ndarray, num_programs: int, page_size: int, *, group_size: int,
                      max_splits: int = 256, num_items: int | None = None) -> np.ndarray:
    """FlashInfer-style host planning for ONE layer at ONE decode step, from the actual lengths.

    lengths: int [batch, groups] retained tokens per (sequence, group) this step.
    num_programs, group_size, max_splits: as for `build_split_map`; the row's item count is
      `items_per_row(num_programs, batch, ...)` unless `num_items` is given (pass the AOT map's
      `num_items` for the same grid).
      Each (row, group) gets ``1 + floor((num_items - groups) * pages_g / pages_row)``
      splits (pages = ceil(length / page_size)), so rows are balanced by their true work; the
      rest of the row is padded with no-op items.
    Returns int32 [batch, num_items, 3] rows (group, split, num_splits), vectorised numpy.
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 2:
        raise ValueError(f"lengths must be [batch, groups], got shape {lengths.shape}")
    if (lengths < 0).any():
        raise ValueError("lengths must be >= 0")
    batch, num_groups = lengths.shape
    if num_items is None:
        num_items = items_per_row(num_programs, batch, group_size, num_groups, max_splits)
    elif num_items < num_groups:
        raise ValueError(f"num_items ({num_items}) must be >= groups ({num_groups})")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = (lengths.astype(np.int64) + page_size - 1) // page_size
    row_pages = np.maximum(pages.sum(axis=1, keepdims=True), 1)
    splits = 1 + ((num_items - num_groups) * pages) // row_pages          # [batch, groups]
    ends = np.cumsum(splits, axis=1)                                      # [batch, groups]
    item = np.arange(num_items)
    group = (ends[:, None, :] <= item[None, :, None]).sum(axis=2)         # [batch, items]
    active = group < num_groups
    group = np.where(active, group, 0)
    start = np.take_along_axis(ends - splits, group, axis=1)
    nsplit = np.take_along_axis(splits, group, axis=1)
    work = np.stack([group, np.where(active, item[None] - start, 0), np.where(active, nsplit, 0)],
                    axis=-1)
    return work.astype(np.int32)
