"""`HostKVPool`: the host-memory tier of session KV, the scheduler's side of it.

Without a host tier the engine's answer to a full pool is to evict an idle session and
re-prefill its whole history when its next turn comes. With one, the evicted session's pages
(every (layer, group) and every precision tier, in the page format the pool stores them:
quantised codes and scales as they are) are copied to host memory and its device pages freed;
at its next turn's admission they are copied back into freshly reserved pages (exactly the
pages it held, so Budget Reservation stays exact) before its prefill runs. The restored slot
holds the same retained lengths and page contents as before, so the next turn's output is the
same as if the session had never left the pool.

This module decides and accounts; the pages move elsewhere (`KVCacheManager.swap_out` /
`swap_in` / `discard_swapped` log `HostTransfer`s of page ids, which the step plan carries to
`engine/host_offload.py`). An eviction swaps instead of recomputing when

    bytes / host_bandwidth  <  history_tokens / prefill_rate

(the copy back is on the next turn's path; the copy out overlaps the step's compute) and the
host budget (`capacity_bytes`, the engine's `host_kv_cache_bytes`) holds it, counting the host
copies of sessions idle longer than the victim as room (they are dropped, oldest first: a
least-recently-idle host cache). A session whose host copy is dropped, or that the host could
not hold, falls back to recompute. Both rates are measured by the engine (`observe_transfer`,
`observe_prefill`); the priors below serve until then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC

import numpy as np

from tangram_jax.scheduler.sequence import Sequence, SequenceStatus

# Priors of the measured rates: a PCIe-class host link and a modest prefill rate.
DEFAULT_HOST_BANDWIDTH = 10e9      # bytes / second
DEFAULT_PREFILL_RATE = 10_000.0    # tokens / second
# Weight of a new measurement in the rates' moving averages.
RATE_SMOOTHING = 0.2


@dataclasses.dataclass(frozen=True)
class SwappedKV:
    """What a slot held when its KV went to host memory (`KVCacheManager.swap_out`).

    handle: names the host copy (`HostTransfer.handle`); num_pages: int32 [layers, groups]
    pages of each cell; lengths: int32 [layers, groups] retained tokens (the reserved lengths
    too: only a slot whose turn is written is swapped); pages: the pages per tier
    (`PageCounts`) it takes back."""

    handle: int
    num_pages: np.ndarray
    lengths: np.ndarray
    pages: int | np.ndarray


@dataclasses.dataclass(frozen=True)
class HostTransfer:
    """One move of the host tier, for the device (in the order logged).

    kind: ``"out"`` (copy pages ``pages[t]`` of each tier t's pool to host memory under
    `handle`; the pages are free once the copy is queued), ``"in"`` (copy the host copy
    `handle` into pages ``pages[t]``, then forget it) or ``"drop"`` (forget it; `pages` empty).
    pages: one int32 array per tier's pool (high first), in block-table order of the slot's
    cells, so an "in" writes row i of the copy to the page that takes the place of row i."""

    kind: str
    handle: int
    pages: tuple[np.ndarray, ...] = ()


class HostKVPool:
    """The host budget, who holds host copies, and swap-or-recompute by measured rates.

    Args:
      capacity_bytes: host memory for swapped KV (0: no host tier, every eviction recomputes).
      page_bytes: bytes of one page (K and V, all devices' shares) of each tier's pool.
      host_bandwidth / prefill_rate: priors of the rates (bytes/s, tokens/s).
    """

    def __init__(self, capacity_bytes: int, page_bytes: SequenceABC[int], *,
                 host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
                 prefill_rate: float = DEFAULT_PREFILL_RATE):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) \
                or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        page_bytes = np.atleast_1d(np.asarray(page_bytes, np.int64))
        if page_bytes.ndim != 1 or not 1 <= page_bytes.size <= 2 or (page_bytes <= 0).any():
            raise ValueError(f"page_bytes must be 1 or 2 positive ints (one per tier), got "
                             f"{page_bytes.tolist()}")
        for name, rate in (("host_bandwidth", host_bandwidth), ("prefill_rate", prefill_rate)):
            if not rate > 0:
                raise ValueError(f"{name} must be > 0, got {rate!r}")
        self.capacity_bytes = int(capacity_bytes)
        self.page_bytes = page_bytes
        self.host_bandwidth = float(host_bandwidth)
        self.prefill_rate = float(prefill_rate)
        self.used_bytes = 0
        # Sessions holding a host copy -> its bytes, in the order they were swapped out.
        self._held: dict[object, int] = {}
        self._measured = {"host_bandwidth": False, "prefill_rate": False}
        # Steps dispatched and not yet known finished (`step_dispatched`, `steps_done`):
        # (step, prefill tokens, decode rows, dispatch time); when the host last saw the device
        # done with everything it had been given.
        self._undone: list[tuple[int, int, int, float]] = []
        self._synced_at = float("-inf")

    # ----- accounting ------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_held(self) -> int:
        return len(self._held)

    def bytes_of(self, pages) -> int:
        """Host bytes of `pages` (`PageCounts`: an int, or int [tiers])."""
        return int(np.atleast_1d(np.asarray(pages, np.int64)) @ self.page_bytes)

    def add(self, seq, nbytes: int) -> None:
        """`seq`'s KV (`nbytes`) is in host memory now; the caller checked the room."""
        if seq in self._held or nbytes > self.free_bytes:
            raise ValueError(f"host tier: cannot add {seq!r} ({nbytes} bytes, "
                             f"{self.free_bytes} free)")
        self._held[seq] = int(nbytes)
        self.used_bytes += int(nbytes)

    def remove(self, seq) -> int:
        """`seq`'s host copy is gone (copied back, or dropped); returns its bytes."""
        nbytes = self._held.pop(seq)
        self.used_bytes -= nbytes
        return nbytes

    def holds(self, seq) -> bool:
        return seq in self._held

    # ----- decisions -------------------------------------------------------------------------
    def swap_seconds(self, nbytes: int) -> float:
        """Expected seconds to copy `nbytes` back (the measured host bandwidth)."""
        return nbytes / self.host_bandwidth

    def recompute_seconds(self, num_tokens: int) -> float:
        """Expected seconds to re-prefill `num_tokens` (the measured prefill rate)."""
        return num_tokens / self.prefill_rate

    def prefers_swap(self, nbytes: int, num_tokens: int) -> bool:
        """Whether evicting a session of `nbytes` pages and `num_tokens` of history should
        swap it (the host could ever hold it and the copy back is cheaper than recompute)."""
        return (self.enabled and nbytes <= self.capacity_bytes
                and self.swap_seconds(nbytes) < self.recompute_seconds(num_tokens))

    def room_for(self, nbytes: int, idle_since: float, evictable) -> list | None:
        """The host copies to drop so `nbytes` fit: none when they fit already, else those of
        sessions `evictable` accepts that went idle before `idle_since`, oldest first, as few
        as suffice. None: even dropping all of them would not make room."""
        if nbytes <= self.free_bytes:
            return []
        older = sorted((s for s in self._held if evictable(s) and s.idle_since < idle_since),
                       key=lambda s: s.idle_since)
        drop, free = [], self.free_bytes
        for seq in older:
            drop.append(seq)
            free += self._held[seq]
            if nbytes <= free:
                return drop
        return None

    # ----- measured rates --------------------------------------------------------------------
    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A host<->device copy of `nbytes` took `seconds`."""
        self._observe("host_bandwidth", nbytes, seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` prefill tokens took `seconds`."""
        self._observe("prefill_rate", num_tokens, seconds)

    def step_dispatched(self, step: int, prefill_tokens: int, decode_rows: int,
                        at: float) -> None:
        """Step `step` (numbered in dispatch order) was queued on the device at `at`."""
        self._undone.append((int(step), int(prefill_tokens), int(decode_rows), float(at)))

    def steps_done(self, step: int, at: float) -> None:
        """The host saw at `at` that every step up to `step` has finished on the device (it
        blocked on that step's tokens). The steps finished since the last such point measure
        the prefill rate when they were mostly prefill: their prefill tokens over the time from
        the later of that point and their first dispatch. Under asynchronous scheduling the
        host learns of a step's end only when it fetches tokens, and a step of prefill chunks
        alone has none, so a rate is taken over every step between two fetches, never from
        one step's dispatch to the next (which, with the host running a step ahead, times the
        step before it)."""
        done = [d for d in self._undone if d[0] <= step]
        self._undone = [d for d in self._undone if d[0] > step]
        if done:
            tokens = sum(d[1] for d in done)
            if tokens >= sum(d[2] for d in done):     # mostly prefill
                self.observe_prefill(tokens, at - max(self._synced_at, done[0][3]))
        self._synced_at = float(at)

    def _observe(self, name: str, amount: float, seconds: float) -> None:
        if amount <= 0 or not seconds > 0:
            return
        rate = amount / seconds
        if self._measured[name]:   # a moving average; the first measurement replaces the prior
            rate = (1 - RATE_SMOOTHING) * getattr(self, name) + RATE_SMOOTHING * rate
        setattr(self, name, rate)
        self._measured[name] = True

    def summary(self) -> dict:
        return {"host_kv_capacity_bytes": self.capacity_bytes,
                "host_kv_used_bytes": self.used_bytes, "host_kv_sessions": self.num_held,
                "host_bandwidth_bytes_per_s": self.host_bandwidth,
                "prefill_tokens_per_s": self.prefill_rate}


class HostTierPages:
    """The `KVCacheManager`'s host-tier moves (a part of `KVCacheManager`, kept here with the
    tier): a slot's pages out to host memory, back into fresh pages, a host copy let go, each
    logged for the device (`take_host_transfers`); `pages_to_reserve` and `fits_ever` take a
    `SwappedKV` where they take a slot."""

    def swap_out(self, slot: int) -> SwappedKV:
        """Move `slot`'s KV to host memory (`scheduler.host_pool`): log the copy of every page
        it holds, of each tier's pool, for the device (`take_host_transfers`), then free the
        slot and its pages (the device copies them out before anything of the step that reuses
        them runs). Only a slot whose turn is written (no unwritten reserved room) and whose
        pages no other slot shares (no forked family) can go. Returns what `swap_in` restores."""
        self._check_slot(slot)
        if (self.reserved_lengths[slot] != self.lengths[slot]).any() or slot in self._fork_stash:
            raise ValueError(f"swap_out: slot {slot} has reserved room it has not written")
        counts = self.table.num_pages[slot].copy()
        pages = self.table.pages_of(slot)
        by_tier = self._pages_by_tier(pages, counts)
        if any((pool.holders(p) > 1).any() for pool, p in zip(self.pools, by_tier)):
            raise ValueError(f"swap_out: slot {slot} shares pages with a forked sibling")
        self._last_handle += 1
        swapped = SwappedKV(self._last_handle, counts, self.lengths[slot].copy(),
                            self.pages_held(slot))
        self._host_transfers.append(HostTransfer("out", swapped.handle, by_tier))
        self.free(slot)
        return swapped

    def swap_in(self, slot: int, swapped: SwappedKV) -> bool:
        """Give fresh slot `slot` back the KV `swapped` held: as many pages of each (layer,
        group), of its tier's pool, with the same retained (and reserved) lengths, and log
        their copy from host memory (`take_host_transfers`). All or nothing: False (nothing
        changes) when a tier's pool is short."""
        self._check_slot(slot)
        if self.table.num_pages[slot].any() or slot in self._fork_stash:
            raise ValueError(f"swap_in: slot {slot} already holds pages")
        counts = swapped.num_pages
        if (self._by_tier(counts) > np.array([p.num_free for p in self.pools])).any():
            return False
        pages = self._allocate(counts)
        self.table.append(np.array([slot]), counts[None], pages)
        self.lengths[slot] = swapped.lengths
        self.reserved_lengths[slot] = swapped.lengths
        self._host_transfers.append(HostTransfer("in", swapped.handle,
                                                 self._pages_by_tier(pages, counts)))
        return True

    def discard_swapped(self, swapped: SwappedKV) -> None:
        """The host copy of `swapped` will not be restored (its session is closed or falls back
        to recompute): log its release for the device."""
        self._host_transfers.append(HostTransfer("drop", swapped.handle))

    def _pages_by_tier(self, pages: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
        """`pages` (of cells holding `counts` pages, block-table order) split by tier's pool."""
        if len(self.pools) == 1:
            return (np.asarray(pages, np.int32),)
        tiers = self._page_tiers(counts)
        return tuple(np.asarray(pages[tiers == t], np.int32) for t in range(len(self.pools)))

    def take_host_transfers(self) -> list[HostTransfer]:
        """Moves of the host tier since the last call, in order: the device runs them before
        anything else of the step (`engine/host_offload.py`)."""
        transfers, self._host_transfers = self._host_transfers, []
        return transfers


class HostTierScheduling:
    """The `Scheduler`'s host-tier steps (a part of `Scheduler`, kept here with the tier):
    the eviction cost its session table ranks by, swapping an evicted session out, and back
    in at its admission."""

    def _eviction_cost(self, seq: Sequence) -> float:
        """The expected cost of evicting `seq`, in recompute tokens: its history's, or the copy
        back's at the measured rates where the host tier would take it (`SessionTable`)."""
        host = self.host
        nbytes = host.bytes_of(self.manager.pages_held(seq.slot))
        if not host.prefers_swap(nbytes, seq.num_tokens):
            return float(seq.num_tokens)
        return host.swap_seconds(nbytes) * host.prefill_rate

    def _swap_out(self, seq: Sequence) -> bool:
        """Swap an evicted session's KV to host memory when copying it back is cheaper than
        its re-prefill and the host holds it, dropping the host copies of sessions idle longer
        (oldest first; not of sessions whose next turn is queued) if that makes room. False:
        the caller recomputes."""
        host = self.host
        if host is None:
            return False
        nbytes = host.bytes_of(self.manager.pages_held(seq.slot))
        if not host.prefers_swap(nbytes, seq.num_tokens):
            return False
        room = host.room_for(nbytes, seq.idle_since,
                             lambda s: s.status is SequenceStatus.IDLE)
        if room is None:
            return False
        for old in room:   # falls back to recompute (an anonymous one is forgotten)
            self.metrics.num_host_drops += 1
            if self.sessions.is_anonymous(old.session_id):
                self._release(old, SequenceStatus.FINISHED)
            else:
                self._drop_cache(old)
        self.sessions.unlist(seq)
        seq.host_kv = self.manager.swap_out(seq.slot)
        seq.slot = -1
        seq.reservation_need = None
        host.add(seq, nbytes)
        self.metrics.num_swapped_out += 1
        self.metrics.swapped_out_bytes += nbytes
        return True

    def _swap_in(self, seq: Sequence) -> None:
        """Give a swapped session (on its fresh slot) its pages back; the caller checked the
        pool holds them."""
        if not self.manager.swap_in(seq.slot, seq.host_kv):
            raise AssertionError("swap-in failed after the pool was checked")
        self.host.remove(seq)
        seq.host_kv = None
        self.metrics.num_swapped_in += 1
