"""KV-cache manager: sequence slots, Budget Reservation, decode growth, reclaim.

One manager, configured by a `KVLayout` and a policy, serves every mode of the engine:

- ``policy="reserve"`` with a Tangram layout: Budget Reservation. `reserve` takes, for every
  (layer, group), exactly ``pages_for(lengths + layout.peak_retained_counts(n))`` pages, all or
  nothing: what the turn holds at most while it is prefilled (under the layout's ``"turn"``
  retention the whole turn, which its last chunk compresses; `finish_prefill` then returns the
  pages above ``lengths + layout.retained_counts(n)``, the count the prefill keeps).
  `layout.retained_counts` is the same rule the prefill uses to decide how many tokens to keep,
  so what is reserved is what the prefill writes, by construction.
- ``policy="reserve"`` with ``KVLayout.monolithic(...)``: full KV (what vLLM's PagedAttention
  does): one group of all heads, budget 1, so the reservation is the uncompressed length.
- ``policy="reclaim"`` with a monolithic layout: the published dynamic method. Reserve for the
  uncompressed prompt, let the device compress with its per-input selection, then `reclaim`
  cuts every (layer, group) down to the actual retained count and returns the pages above it.
- adjacent grouping: ``policy="reserve"`` with a layout whose groups are heads in index order.

Parallel samples (``SamplingParams.n``) share the prompt's pages, as vLLM does: the prompt is
prefilled (and compressed, and in ``reclaim`` reclaimed) once in the family's first slot, then
`fork` gives every other completion a block table pointing at the same pages (reference-counted
in the pool) except the partly filled last page of each (layer, group) a decode token is
appended to, which it gets a copy of (the device copies it: `take_page_copies`), so decode
writes never land in a page another sequence reads. The copies are reserved with the prompt
(`reserve(..., forks=k)` sets them aside; they are exactly the partly filled decode cells of the
reserved lengths under ``reserve``, one per decode cell under ``reclaim``, whose lengths are
known only after the device compressed: the fork returns what it does not use). Full pages are
never written again (no sequence of a family continues a session), so they need no
copy-on-write.

Arrays (row ``max_seqs`` is the *null slot*: always empty, padded decode rows point at it):

    block_tables:     int32 [max_seqs + 1, layers, groups, max_pages]
    lengths:          int32 [max_seqs + 1, layers, groups]   retained tokens written so far
                      (a decode token counts from `grow_for_decode`, the step that writes it)
    reserved_lengths: int32 [max_seqs + 1, layers, groups]   tokens the held pages are reserved
                      for; always ``num_pages == pages_for(reserved_lengths)`` and
                      ``lengths <= reserved_lengths``.

Precision tiers (`TieredLayout`): a tier group's pages are of its tier's page format, so each
tier has its own pool of page ids (`pools`, high first; page 0 is the null page of each) and
its block-table entries index its own tier's pool array. A reservation takes from each tier's
pool what the tier's cells need, all or nothing; decode growth and fork copies take from the
high tier (decode tokens go there); freeing, truncating and forks return or share each page in
its own tier. Page counts the scheduler sees (`PageCounts`) are then int64 ``[tiers]`` arrays
(an int for an untiered layout), and a request fits only when every tier's entry does.

Two narrow interfaces (as vLLM v1's `KVCacheManager.allocate_slots` / `KVCacheBlocks` keep its
scheduler away from block tables):

- the scheduler's (`SCHEDULER_INTERFACE`): slots, reservations and decode growth as yes/no
  answers and page counts, by slot; it never reads the arrays above;
- the device feed, for the engine and runner that build a step: `take_table_updates` (the block
  table's writes for a device-resident copy), `take_page_copies` (the pages forks copied),
  `take_host_transfers` (pages of sessions swapped to host memory and back),
  `decode_write_lengths` (where each decode row writes its token) and `retained_lengths` (a
  slot's history lengths for prefill).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC

import numpy as np

from tangram_jax.kv_layout import KVLayout, TieredLayout, pages_for
from tangram_jax.scheduler.block_table import BlockTable
from tangram_jax.scheduler.host_pool import HostTierPages, HostTransfer, SwappedKV
from tangram_jax.scheduler.page_pool import PagePool

POLICIES = ("reserve", "reclaim")

# Everything `Scheduler` uses of the manager (tests check it stays within this).
SCHEDULER_INTERFACE = frozenset({
    "layout", "max_seqs", "null_slot", "capacity", "num_free_pages", "num_free_slots",
    "pages_held", "allocate_slot", "free", "pages_to_reserve", "fits_ever", "reserve",
    "commit_prefill", "finish_prefill", "reclaim", "grow_for_decode", "decode_demand",
    "at_table_limit",
    "max_pages_per_group", "fork", "describe_pages",
    "swap_out", "swap_in", "discard_swapped",
})

# Pages per tier: an int for an untiered layout, int64 [tiers] (high, low) for a tiered one.
# Compare them with np.any / np.all (a request fits when every tier's count does).
PageCounts = int | np.ndarray


class LayoutMismatchError(ValueError):
    """The KV layout (or the profile it came from) does not describe this model."""


class NoFreeSlotError(RuntimeError):
    """Every sequence slot is taken."""


def check_layout_matches(layout: KVLayout, num_layers: int, num_kv_heads: int,
                         head_dim: int) -> None:
    """Raise `LayoutMismatchError` unless `layout` has the model's KV shape."""
    got = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    want = (int(num_layers), int(num_kv_heads), int(head_dim))
    if got != want:
        names = ("layers", "kv_heads", "head_dim")
        diff = ", ".join(f"{n}: layout {g} vs model {w}"
                         for n, g, w in zip(names, got, want) if g != w)
        raise LayoutMismatchError(f"KV layout {layout.name!r} does not match the model ({diff})")


class KVCacheManager(HostTierPages):
    """Pages and block tables for up to `max_seqs` sequences under one `KVLayout`.

    Args:
      layout: the KV layout (groups, budgets, page and chunk size).
      num_pages: pool size including the null page 0; for a `TieredLayout` a pair (high,
        low): each tier's pool, its own null page included.
      max_seqs: sequence slots.
      max_pages_per_group: width of the block table (pages one (layer, group) can hold).
      model_kv_shape: the model's ``(num_layers, num_kv_heads, head_dim)``; a layout that does
        not match is refused with `LayoutMismatchError`.
      policy: ``"reserve"`` or ``"reclaim"`` (see the module docstring).
    """

    def __init__(self, layout: KVLayout | TieredLayout, num_pages: int | SequenceABC[int],
                 max_seqs: int,
                 max_pages_per_group: int, *, model_kv_shape: SequenceABC[int],
                 policy: str = "reserve"):
        if not isinstance(layout, (KVLayout, TieredLayout)):
            raise TypeError(f"layout must be a KVLayout or TieredLayout, got "
                            f"{type(layout).__name__}")
        if len(model_kv_shape) != 3:
            raise ValueError("model_kv_shape must be (num_layers, num_kv_heads, head_dim), got "
                             f"{model_kv_shape!r}")
        check_layout_matches(layout, *model_kv_shape)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "reclaim" and layout.compresses:
            raise ValueError("the reclaim policy reserves for the uncompressed prompt: give it a "
                             "layout with every budget 1 (KVLayout.monolithic)")
        if max_seqs <= 0 or max_pages_per_group <= 0:
            raise ValueError(f"max_seqs ({max_seqs}) and max_pages_per_group "
                             f"({max_pages_per_group}) must be positive")
        self.layout = layout
        self.policy = policy
        self.page_size = layout.page_size
        self.max_seqs = int(max_seqs)
        self.null_slot = self.max_seqs
        tiered = isinstance(layout, TieredLayout)
        if tiered and policy == "reclaim":
            raise ValueError("precision tiers are reserved with static budgets: policy must be "
                             "'reserve' with a TieredLayout")
        num_tiers = 2 if tiered else 1
        if tiered:
            if isinstance(num_pages, (int, np.integer)) or len(num_pages) != 2:
                raise ValueError(f"num_pages must be a (high, low) pair of pool sizes for a "
                                 f"tiered layout ({layout.precision}), got {num_pages!r}")
        elif not isinstance(num_pages, (int, np.integer)) or isinstance(num_pages, bool):
            raise TypeError(f"num_pages must be an int for an untiered layout, got "
                            f"{num_pages!r}")
        # One pool of page ids per tier (high first); an untiered layout has one.
        self.pools = tuple(PagePool(n) for n in ((num_pages,) if not tiered else num_pages))
        # Tier of each group (a tiered layout's groups are (group, tier) pairs, 2 g + tier),
        # and its one-hot [groups, tiers] for per-tier sums of per-group page counts.
        self._group_tier = (np.arange(layout.num_groups) % 2 if tiered
                            else np.zeros(layout.num_groups, np.int64))
        self._tier_onehot = (self._group_tier[:, None] == np.arange(num_tiers)).astype(np.int64)
        rows = self.max_seqs + 1
        self.table = BlockTable(rows, layout.num_layers, layout.num_groups, max_pages_per_group)
        self.lengths = np.zeros((rows, layout.num_layers, layout.num_groups), dtype=np.int32)
        self.reserved_lengths = np.zeros_like(self.lengths)
        # Free slots as a stack, lowest id on top.
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self._slot_in_use = np.zeros(rows, dtype=bool)
        # Preallocated outputs of grow_for_decode's whole-array passes.
        self._scratch_int = np.zeros_like(self.lengths)
        self._scratch_bool = np.zeros(self.lengths.shape, dtype=bool)
        self._all_granted = np.ones(rows, dtype=bool)   # grow_for_decode's answer, read-only
        self._all_granted.flags.writeable = False
        self.pages_reclaimed = 0
        self.reclaim_seconds = 0.0
        # Pages `reserve(..., forks=k)` set aside for a slot's fork (the copies of its partly
        # filled decode pages), and the (source, destination) page copies forks made since the
        # device feed last took them.
        self._fork_stash: dict[int, np.ndarray] = {}
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []
        # Moves of the host tier since the device feed last took them, and the last handle.
        self._host_transfers: list[HostTransfer] = []
        self._last_handle = 0
        # Groups a decode token is appended to: all, or the high tier of a TieredLayout (whose
        # groups are (group, tier) pairs, reserved like groups).
        self._decode_groups = (layout.decode_tier_groups if isinstance(layout, TieredLayout)
                               else np.ones(layout.num_groups, dtype=bool))
        # Decode tokens and fork copies take pages of one tier (the high one), whose pool
        # `grow_for_decode` and the fork stash use.
        assert (self._group_tier[self._decode_groups] == 0).all()
        self._decode_pool = self.pools[0]

    # ----- views -------------------------------------------------------------------------
    @property
    def block_tables(self) -> np.ndarray:
        """int32 [max_seqs + 1, layers, groups, max_pages]; last row is the null slot."""
        return self.table.tables

    @property
    def max_pages_per_group(self) -> int:
        return self.table.max_pages

    @property
    def pool(self) -> PagePool:
        """The page pool of an untiered layout (a tiered one has one per tier: `pools`)."""
        if len(self.pools) != 1:
            raise AttributeError(f"a tiered layout ({self.layout.name}) has a pool per tier: "
                                 f"use KVCacheManager.pools")
        return self.pools[0]

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Page format of each tier's pool (an untiered pool: ``("pages",)``)."""
        return self.layout.tiers if isinstance(self.layout, TieredLayout) else ("pages",)

    def _counts(self, by_tier: np.ndarray) -> PageCounts:
        """`PageCounts` of int64 [tiers]: an int for one tier, else the array."""
        return int(by_tier[0]) if len(self.pools) == 1 else by_tier.astype(np.int64)

    def _by_tier(self, cell_pages: np.ndarray) -> np.ndarray:
        """int64 [tiers]: pages per cell (int [..., layers, groups]) summed per tier."""
        per_group = np.asarray(cell_pages, np.int64).reshape(-1, self._group_tier.size).sum(0)
        return per_group @ self._tier_onehot

    def describe_pages(self, counts: PageCounts) -> str:
        """`PageCounts` in words: ``"12 pages"``, or ``"12 k8v4 + 30 k4v2 pages"``."""
        counts = np.atleast_1d(np.asarray(counts, np.int64))
        if len(self.pools) == 1:
            return f"{int(counts[0])} pages"
        return " + ".join(f"{int(c)} {name}" for c, name in zip(counts, self.tier_names)) \
            + " pages"

    def limit_pages(self, num_pages: int | SequenceABC[int]) -> None:
        """Serve from the first `num_pages` pages of each tier's pool (null page included; a
        (high, low) pair for a tiered layout), the arrays unchanged (`PagePool.limit`); no
        page may be allocated."""
        counts = (num_pages,) if len(self.pools) == 1 else tuple(num_pages)
        if len(counts) != len(self.pools):
            raise ValueError(f"num_pages must give {len(self.pools)} pool sizes, got "
                             f"{num_pages!r}")
        for pool, n in zip(self.pools, counts):
            pool.limit(n)

    @property
    def capacity(self) -> PageCounts:
        """Pages each tier's pool can hand out (null pages excluded)."""
        return self._counts(np.array([p.capacity for p in self.pools]))

    @property
    def num_free_pages(self) -> PageCounts:
        return self._counts(np.array([p.num_free for p in self.pools]))

    @property
    def num_used_pages(self) -> PageCounts:
        return self._counts(np.array([p.num_used for p in self.pools]))

    @property
    def fullest_pool_use(self) -> float:
        """Fraction of its pages in use of the fullest tier's pool (the pool's, untiered): what
        admission and decode growth run out of first (a tiered pool is full when one tier
        is)."""
        return max(p.num_used / max(p.capacity, 1) for p in self.pools)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_held(self, slot: int) -> PageCounts:
        """Pages in `slot`'s block table (those shared with forked siblings included)."""
        if len(self.pools) == 1:
            return int(self.table.num_pages[slot].sum())
        return self._by_tier(self.table.num_pages[slot])

    def distinct_pages_held(self, slots: SequenceABC[int]) -> PageCounts:
        """Pages the block tables of `slots` hold together, a shared page counted once."""
        held = np.zeros(len(self.pools), np.int64)
        if len(slots):
            pages = np.concatenate([self.table.pages_of(s) for s in slots])
            tiers = np.concatenate([self._page_tiers(self.table.num_pages[s]) for s in slots])
            for t in range(len(self.pools)):
                held[t] = np.unique(pages[tiers == t]).size
        return self._counts(held)

    # ----- pages of several tiers ------------------------------------------------------------
    def _page_tiers(self, cell_pages: np.ndarray) -> np.ndarray:
        """Tier of each page of cells holding `cell_pages` (int [..., layers, groups]) pages,
        listed in C order of (..., layer, group, page) as the block table lists them."""
        counts = np.asarray(cell_pages, np.int64)
        return np.repeat(np.broadcast_to(self._group_tier, counts.shape).ravel(),
                         counts.ravel())

    def _allocate(self, cell_pages: np.ndarray) -> np.ndarray:
        """int32 page ids for cells needing `cell_pages` (int [..., layers, groups]) pages, in
        the block table's C order, each from its cell's tier pool (the caller has checked
        every tier has them free)."""
        if len(self.pools) == 1:
            return self.pools[0].allocate(int(np.sum(cell_pages)))
        tiers = self._page_tiers(cell_pages)
        pages = np.empty(tiers.size, np.int32)
        for t, pool in enumerate(self.pools):
            mine = tiers == t
            pages[mine] = pool.allocate(int(mine.sum()))
        return pages

    def _release(self, pages: np.ndarray, tiers: np.ndarray | None, *,
                 distinct: bool = False) -> None:
        """Drop a holder of each of `pages` in its tier's pool (`tiers`: the tier of each,
        None for an untiered layout)."""
        if len(self.pools) == 1:
            self.pools[0].release(pages, distinct=distinct)
            return
        for t, pool in enumerate(self.pools):
            pool.release(pages[tiers == t], distinct=distinct)

    # ----- slots -------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise NoFreeSlotError(f"all {self.max_seqs} sequence slots are in use")
        slot = self._free_slots.pop()
        self._slot_in_use[slot] = True
        return slot

    def free(self, slot: int) -> int:
        """Return the slot and every page it holds (a page shared with a forked sibling stays
        with the sibling). Returns the number of pages the slot held (its unused fork stash
        included)."""
        self._check_slot(slot)
        tiers = self._page_tiers(self.table.num_pages[slot]) if len(self.pools) > 1 else None
        released = self.table.clear(slot)
        # A slot holds each of its pages once.
        self._release(released, tiers, distinct=True)
        stash = self._fork_stash.pop(slot, None)
        if stash is not None:
            self._decode_pool.release(stash, distinct=True)
            released = np.concatenate([released, stash])
        self.lengths[slot] = 0
        self.reserved_lengths[slot] = 0
        self._slot_in_use[slot] = False
        self._free_slots.append(slot)
        return int(released.size)

    # ----- reservation -------------------------------------------------------------------
    def reservation_target(self, base_lengths: np.ndarray, num_new_tokens, *,
                           peak: bool = True) -> np.ndarray:
        """int64 [layers, groups]: tokens to hold at most while a turn of `num_new_tokens` new
        tokens is prefilled on top of `base_lengths` (the session's retained lengths, 0 for a
        fresh sequence); with ``peak=False`` what it holds after it. `num_new_tokens` may also
        be a prefill plan, a list of ``(length, compressed)`` segments
        (`KVLayout.segments_retained_counts`: a history replayed after preemption)."""
        layout = self.layout
        if isinstance(num_new_tokens, (list, tuple)):
            counts = (layout.segments_peak_counts if peak else
                      layout.segments_retained_counts)(num_new_tokens)
        else:
            counts = (layout.peak_retained_counts if peak else
                      layout.retained_counts)(num_new_tokens)
        return counts + base_lengths

    def _base_lengths(self, slot: int | SwappedKV | None) -> np.ndarray:
        """int [layers, groups]: what `slot` holds (zeros for None: a fresh slot; a swapped
        slot's lengths for a `SwappedKV`)."""
        if slot is None:
            return np.zeros(self.lengths.shape[1:], dtype=np.int64)
        if isinstance(slot, SwappedKV):
            return slot.lengths
        return self.lengths[slot]

    def pages_to_reserve(self, slot: int | SwappedKV | None, num_new_tokens,
                         forks: int = 0) -> PageCounts:
        """Extra pages `reserve(slot, num_new_tokens, forks=forks)` would take (slot None: a
        fresh one; a `SwappedKV`: its pages taken back by `swap_in` and the turn's on top),
        per tier."""
        return self._counts(self._reservation(slot, num_new_tokens, forks)[-1])

    def _reservation(self, slot: int | None, num_new_tokens, forks: int) -> tuple:
        """What `reserve` takes: (target tokens [layers, groups], pages held after it, new pages
        per cell, the forks' stash pages, int64 [tiers] of all the pages it takes)."""
        swapped = isinstance(slot, SwappedKV)
        held = (0 if slot is None else slot.num_pages.astype(np.int64) if swapped
                else self.table.num_pages[slot].astype(np.int64))
        target = self.reservation_target(self._base_lengths(slot), num_new_tokens)
        new_held = np.maximum(pages_for(target, self.page_size), held)
        need = new_held - held
        # Forks copy the partly filled last pages of what the prefill keeps, not of its peak.
        stash = self._fork_pages(self.reservation_target(
            self._base_lengths(slot), num_new_tokens, peak=False), forks)
        by_tier = self._by_tier(need) + (self._by_tier(held) if swapped else 0)
        by_tier[0] += stash                             # fork copies come from the decode tier
        return target, new_held, need, stash, by_tier

    def _fork_pages(self, target: np.ndarray, forks: int) -> int:
        """Pages `forks` forks of a slot holding `target` tokens [layers, groups] copy: each
        decode cell whose last page is partly filled (under ``reclaim`` every decode cell: the
        device decides the lengths after this is reserved)."""
        if forks <= 0:
            return 0
        decode_cells = np.broadcast_to(self._decode_groups, target.shape)
        if self.policy == "reclaim":
            return forks * int(decode_cells.sum())
        return forks * int((decode_cells & (target % self.page_size != 0)).sum())

    def fits_ever(self, slot: int | SwappedKV | None, num_new_tokens, forks: int = 0) -> bool:
        """Whether a turn of `num_new_tokens` (or a prefill plan) on top of what `slot` holds
        (None: from nothing; a `SwappedKV`: what the swapped slot held), plus one decode token
        (for each of `forks` forks too: a page per decode cell), could be held by an otherwise
        empty pool and the block table."""
        need = pages_for(self.reservation_target(self._base_lengths(slot), num_new_tokens)
                         + self._decode_groups, self.page_size)
        per_fork = int(np.broadcast_to(self._decode_groups, need.shape).sum())
        by_tier = self._by_tier(need)
        by_tier[0] += forks * per_fork                  # the decode tier's copies
        capacity = np.array([p.capacity for p in self.pools])
        return bool(need.max() <= self.max_pages_per_group and (by_tier <= capacity).all())

    def reserve(self, slot: int, num_new_tokens, forks: int = 0) -> bool:
        """Reserve, for every (layer, group), the pages a turn of `num_new_tokens` new tokens (or
        a prefill plan, see `reservation_target`) ends up retaining on top of what the slot
        already holds, and the pages `forks` later `fork`s of the slot copy (set aside until
        then). All or nothing: returns False (and changes nothing) when the pool or the block
        table cannot hold it."""
        self._check_slot(slot)
        if (self.reserved_lengths[slot] != self.lengths[slot]).any():
            raise ValueError(f"slot {slot} still has reserved room it has not written; "
                             "commit the previous turn first")
        if forks and (self.table.num_pages[slot].any() or slot in self._fork_stash):
            raise ValueError(f"slot {slot}: only a fresh slot can be reserved for forks")
        target, new_held, need, stash, by_tier = self._reservation(slot, num_new_tokens, forks)
        if new_held.max() > self.max_pages_per_group or \
                (by_tier > np.array([p.num_free for p in self.pools])).any():
            return False
        pages = self._allocate(need)
        self.table.append(np.array([slot]), need[None], pages)
        self.reserved_lengths[slot] = target
        if forks:
            self._fork_stash[slot] = self._decode_pool.allocate(stash)
        return True

    def fork(self, parent: int, children: SequenceABC[int]) -> int:
        """Give each slot of `children` (fresh, allocated) the KV `parent` holds: its block
        table points at the parent's pages (one more holder each) but for the partly filled
        last page of every decode cell, which it gets a copy of (pages from the parent's fork
        stash; the device copies their contents: `take_page_copies`). The parent's whole turn
        must be written. What the stash does not use goes back to the pool. Returns the pages
        copied."""
        self._check_slot(parent)
        children = np.asarray(children, dtype=np.intp).ravel()
        for c in children:
            self._check_slot(int(c))
            if self.table.num_pages[c].any() or c in self._fork_stash:
                raise ValueError(f"fork: slot {c} already holds pages")
        if (self.reserved_lengths[parent] != self.lengths[parent]).any():
            raise ValueError(f"fork: slot {parent} has reserved room it has not written")
        stash = self._fork_stash.pop(parent, np.zeros(0, np.int32))
        counts = self.table.num_pages[parent].astype(np.int64)
        lengths = self.lengths[parent]
        pages = self.table.pages_of(parent)                   # C order of (layer, group, page)
        partial = ((lengths % self.page_size != 0) & self._decode_groups & (counts > 0)).ravel()
        last = (np.cumsum(counts.ravel()) - 1)[partial]       # each partly filled last page
        per_child = last.size
        if per_child * children.size > stash.size:
            self._decode_pool.release(stash, distinct=True)
            raise ValueError(f"fork: {children.size} forks of slot {parent} copy "
                             f"{per_child * children.size} pages; {stash.size} were reserved")
        shared = np.delete(pages, last)
        # Each shared page gains a holder in its own tier's pool (the copies are all of the
        # decode tier, as is the stash they come from).
        shared_tiers = (np.delete(self._page_tiers(counts), last) if len(self.pools) > 1
                        else None)
        used = stash[:per_child * children.size]
        self._decode_pool.release(stash[used.size:], distinct=True)
        copies = used.reshape(children.size, per_child)
        for c, own in zip(children, copies):
            if shared_tiers is None:
                self.pools[0].share(shared)
            else:
                for t, pool in enumerate(self.pools):
                    pool.share(shared[shared_tiers == t])
            child_pages = pages.copy()
            child_pages[last] = own
            self.table.append(np.array([c]), counts[None], child_pages)
            self.lengths[c] = lengths
            self.reserved_lengths[c] = lengths
        if used.size:
            self._copies.append((np.tile(pages[last], children.size), used))
        return int(used.size)

    def commit_prefill(self, slot: int, num_tokens: int, *, start: int = 0,
                       turn_len: int | None = None, compressed: bool = True) -> None:
        """The device has written a prefill piece of `num_tokens` new tokens starting at token
        `start` of a turn of `turn_len` new tokens (default: the piece is the whole turn),
        `start` on a compression-chunk boundary of the turn: lengths grow by what
        ``layout.piece_retained_counts`` says the piece keeps (by `num_tokens` in every decode
        group for a segment that is not `compressed`)."""
        turn_len = start + num_tokens if turn_len is None else turn_len
        # A segment kept whole (decode tokens replayed) goes where decode tokens go: every
        # group, or a tiered layout's high tier (`segments_retained_counts`).
        kept = (self.layout.piece_retained_counts(turn_len, start, start + num_tokens)
                if compressed else num_tokens * self._decode_groups)
        new = self.lengths[slot] + kept
        if (new > self.reserved_lengths[slot]).any():
            raise ValueError(f"slot {slot}: prefill of {num_tokens} tokens exceeds its reservation")
        self.lengths[slot] = new

    def finish_prefill(self, slot: int) -> int:
        """`slot`'s prefill is written: return the pages reserved above what it keeps (the
        staging of a turn its last chunk compressed, `KVLayout.peak_retained_counts`). Returns
        the number of pages released."""
        self._check_slot(slot)
        if self.policy == "reclaim" or (self.reserved_lengths[slot] == self.lengths[slot]).all():
            return 0
        held = self.table.num_pages[slot].astype(np.int64)
        keep = np.minimum(pages_for(self.lengths[slot], self.page_size), held)
        released = self.table.truncate(np.array([slot]), keep[None])
        self._release(released, self._page_tiers(held - keep) if len(self.pools) > 1 else None)
        self.reserved_lengths[slot] = self.lengths[slot]
        return int(released.size)

    def reclaim(self, slot: int, actual_lengths: np.ndarray) -> int:
        """Dynamic compress-and-reclaim: after compression every (layer, group) of `slot` keeps
        `actual_lengths` ([layers, groups], at most the written lengths) tokens; find and return
        the pages above them, keeping room for the turn's tokens not written yet.
        Returns the number of pages released (time spent goes to `reclaim_seconds`)."""
        if self.policy != "reclaim":
            raise ValueError("reclaim() belongs to the 'reclaim' policy; Budget Reservation "
                             "never reclaims")
        t0 = time.perf_counter()
        actual = np.asarray(actual_lengths, dtype=np.int64)
        if actual.shape != self.lengths.shape[1:]:
            raise ValueError(f"actual_lengths has shape {actual.shape}, expected "
                             f"{self.lengths.shape[1:]} [layers, groups]")
        written = self.lengths[slot].astype(np.int64)
        if (actual < 0).any() or (actual > written).any():
            raise ValueError("actual_lengths must lie in [0, written lengths]")
        unwritten = self.reserved_lengths[slot] - written
        new_reserved = actual + unwritten
        released = self.table.truncate(np.array([slot]),
                                       pages_for(new_reserved, self.page_size)[None])
        self.pool.release(released)        # reclaim's layouts are untiered (`__init__`)
        self.lengths[slot] = actual
        self.reserved_lengths[slot] = new_reserved
        self.pages_reclaimed += int(released.size)
        self.reclaim_seconds += time.perf_counter() - t0
        return int(released.size)

    # ----- decode ------------------------------------------------------------------------
    def grow_for_decode(self, slots: np.ndarray) -> np.ndarray:
        """Take this decode step's token for every (layer, group) of `slots`.

        slots: int [n] distinct slots whose prefill is complete (lengths == reserved_lengths).
        Groups whose token crosses a page boundary take a page; then lengths and reserved
        lengths count the token (the device writes it at the old length, which the scheduler
        hands the engine with the step's decode rows). Sequences are served in the order given,
        all or nothing each, while the pool lasts (so the ones that fail are the last ones); a
        sequence that would overflow the block-table width fails too. Returns bool [n]
        (read-only): which got their token (the others are unchanged).
        """
        # Runs every step, so it is written for few numpy calls (each costs microseconds when
        # the caches are cold, more than the work): whole [rows, layers, groups] passes masked
        # to the batch, with preallocated outputs, instead of gathering the batch's rows out and
        # scattering them back; the batch is most of the slots when serving is busy.
        slots = np.asarray(slots, dtype=np.intp)
        n = slots.size
        if n == 0:
            return np.zeros(0, dtype=bool)
        rows = self._row_mask(slots)
        # The token at index `lengths` needs a new page iff every held slot is already used.
        np.multiply(self.table.num_pages, np.int32(self.page_size), out=self._scratch_int)
        crossing = np.greater_equal(self.lengths, self._scratch_int, out=self._scratch_bool)
        crossing &= rows[:, None, None] & self._decode_groups
        # Array methods, not np.flatnonzero/np.ones: their Python wrappers cost more here.
        cells = crossing.reshape(-1).nonzero()[0]     # global cell ids, in slot order
        columns = self.table.num_pages.reshape(-1)[cells]
        ok = self._all_granted[:n]
        if cells.size > self._decode_pool.num_free or (
                cells.size and columns.max() >= self.max_pages_per_group):
            ok = self._grant_prefix(slots, cells, columns)
            rows = self._row_mask(slots[ok])
            keep = rows[cells // self.table.cells_per_row]
            cells, columns = cells[keep], columns[keep]
        if cells.size:   # every decode cell is of the decode tier
            self.table.append_to_cells(cells, self._decode_pool.allocate(cells.size),
                                       columns=columns)
        granted = (rows[:, None, None] & self._decode_groups).astype(np.int32)  # bools would cast
        self.lengths += granted
        self.reserved_lengths += granted
        return ok

    def _grant_prefix(self, slots: np.ndarray, cells: np.ndarray,
                      columns: np.ndarray) -> np.ndarray:
        """bool [n]: the slots `grow_for_decode` can serve when the pool or the table falls
        short: in the order given, while the pool lasts, skipping those over the table width
        (a prefix greedy, so the failing ones are the trailing ones: the newest when the caller
        orders oldest first, which is who gets preempted)."""
        num_rows = self.lengths.shape[0]
        row = cells // self.table.cells_per_row
        over = columns >= self.max_pages_per_group
        fits_table = np.bincount(row[over], minlength=num_rows)[slots] == 0
        demand = np.where(fits_table, np.bincount(row, minlength=num_rows)[slots], 0)
        return fits_table & (np.cumsum(demand) <= self._decode_pool.num_free)

    def _row_mask(self, slots: np.ndarray) -> np.ndarray:
        """bool [rows]: True at `slots`."""
        mask = np.zeros(self.lengths.shape[0], dtype=bool)
        mask[slots] = True
        return mask

    def decode_demand(self, slot: int) -> PageCounts:
        """Pages `slot`'s next decode token takes (one per group crossing a page boundary),
        per tier."""
        want = pages_for(self.lengths[slot].astype(np.int64) + self._decode_groups,
                         self.page_size)
        return self._counts(self._by_tier(np.maximum(want - self.table.num_pages[slot], 0)))

    def at_table_limit(self, slot: int) -> bool:
        """Whether one more decode token would overflow the block table width."""
        want = self.lengths[slot].astype(np.int64) + self._decode_groups
        return bool(pages_for(want, self.page_size).max() > self.max_pages_per_group)

    # ----- device feed -------------------------------------------------------------------
    def take_table_updates(self) -> tuple[np.ndarray, np.ndarray]:
        """Block-table writes since the last call, for a device-resident copy (see BlockTable)."""
        return self.table.take_updates()

    def take_page_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """Page copies `fork` made since the last call: (int32 source pages, int32 destination
        pages) whose K/V the device must copy before a forked sequence decodes."""
        if not self._copies:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        src = np.concatenate([c[0] for c in self._copies]).astype(np.int32)
        dst = np.concatenate([c[1] for c in self._copies]).astype(np.int32)
        self._copies.clear()
        return src, dst

    def decode_write_lengths(self, slots: np.ndarray) -> np.ndarray:
        """int32 [rows, layers, groups]: where each decode row of this step writes its token,
        the lengths before it (`grow_for_decode` has counted it already); rows of the null slot
        (padding) are 0 (groups a decode token is not appended to, a tiered layout's low
        tier: their lengths, where attention reads up to)."""
        slots = np.asarray(slots, dtype=np.intp)
        lengths = self.lengths.take(slots, axis=0)
        lengths[slots != self.null_slot] -= self._decode_groups.astype(np.int32)
        return lengths

    def retained_lengths(self, slot: int) -> np.ndarray:
        """int64 [layers, groups]: tokens `slot` holds now (a prefill piece's history)."""
        return self.lengths[slot].astype(np.int64)

    def usage(self) -> dict:
        """Pool utilisation and fragmentation (allocated vs occupied token slots)."""
        allocated = int(self.table.num_pages.sum()) * self.page_size
        occupied = int(self.lengths.sum())
        total = sum(p.capacity for p in self.pools)
        used = sum(p.num_used for p in self.pools)
        return {
            "pages_total": total,
            "pages_used": used,
            "pool_utilisation": used / total,
            "fullest_pool_utilisation": self.fullest_pool_use,
            # Per tier's pool (one entry untiered): a tiered pool is full when one tier is.
            "tiers": {name: {"pages_total": p.capacity, "pages_used": p.num_used}
                      for name, p in zip(self.tier_names, self.pools)},
            "allocated_token_slots": allocated,
            "occupied_token_slots": occupied,
            "fragmentation": 1.0 - occupied / allocated if allocated else 0.0,
            "pages_reclaimed": self.pages_reclaimed,
            "reclaim_seconds": self.reclaim_seconds,
        }

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.max_seqs) or not self._slot_in_use[slot]:
            raise ValueError(f"slot {slot} is not an allocated sequence slot")
