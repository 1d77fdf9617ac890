"""Admission by Budget Reservation, the `Scheduler`'s third pass of a step (see
`scheduler.py`): waiting turns admitted FCFS when their whole post-compression reservation
fits the pool, evicting idle sessions where that makes it fit."""

from __future__ import annotations

import numpy as np

from tangram_jax.scheduler.output import PrefillChunk
from tangram_jax.scheduler.sequence import Sequence, SequenceStatus


class AdmissionScheduling:
    """The `Scheduler`'s admission steps (a part of `Scheduler`): which waiting turns start,
    the reservation each takes, and the idle sessions an admission may evict for it."""

    def _admit(self, budget: int, chunks: list[PrefillChunk], longs: list[Sequence]) -> int:
        """Admit waiting turns (FCFS by reservation) while the budget lasts: a short turn gets
        its piece now, a long one is appended to `longs` (the long turns prefilling, which get
        their pieces after every short turn). Returns the budget left."""
        # With every slot held by a running sequence (and no idle session to evict) nobody can
        # be admitted: return before walking a possibly long queue.
        slots_exhausted = self.manager.num_free_slots == 0 and not self.sessions.num_evictable
        if not self.waiting or slots_exhausted or budget <= 0:
            return budget
        # A long turn whose rest fits one piece ends this step (oldest first): the next long
        # turn may start beside it instead of a step later.
        num_long = sum(self._is_long(s) for s in longs)
        priority = next((s for s in self.waiting if s.num_skips >= self.fairness_skips), None)
        candidates = [priority] if priority is not None else list(self.waiting)
        passed_over: list[Sequence] = []
        # The fewest pages an earlier turn still waits for (passed over for pages, or waiting
        # for a long-prefill slot): a turn behind it that needs as many would overtake it only
        # by taking those pages (a session swapped to host memory takes its whole history's
        # back: a short turn with a long turn's pages), so it waits its turn too; smaller ones
        # go on.
        blocked_at = None

        def waits(s: Sequence) -> None:
            nonlocal blocked_at
            need = self._pages_needed(s)
            blocked_at = need if blocked_at is None else min(blocked_at, need)

        for seq in candidates:
            if seq.status is not SequenceStatus.WAITING:
                continue
            if slots_exhausted and not seq.is_cached:
                passed_over.append(seq)
                continue
            # A cached session evicted by an earlier admission this step re-prefills everything,
            # so the plan and size are read here, not before the loop.
            seq.plan_prefill()
            long = self._is_long(seq)
            if long and num_long >= self.max_long_partial_prefills:
                waits(seq)
                continue   # waits for a long turn to finish; not a skip (pages are not short)
            take = self._piece_size(seq, budget)
            if take == 0:   # less than a chunk left: only a turn that fits whole can start
                continue
            if long and budget < self.layout.chunk_size:
                continue
            if blocked_at is not None and self._pages_needed(seq) >= blocked_at:
                continue   # not a skip of its own: it waits behind a turn as large
            if not self._reserve(seq):
                passed_over.append(seq)
                waits(seq)
                continue
            for other in passed_over:
                other.num_skips += 1
            self.waiting.remove(seq)
            self.running.append(seq)
            self._batch_stale = True
            seq.status = SequenceStatus.PREFILL
            seq.turn_start = seq.num_computed_tokens
            seq.long_prefill = long
            seq.admission_order = self._admissions
            self._admissions += 1
            self.metrics.num_admitted += 1
            if long:
                longs.append(seq)   # its piece comes after the short turns'
                num_long += 1
            else:
                chunks.append(self._chunk(seq, take))
                budget -= take
            if budget <= 0:
                break
            slots_exhausted = (self.manager.num_free_slots == 0
                               and not self.sessions.num_evictable)
        return budget

    def _pages_needed(self, seq: Sequence) -> int:
        """Pages (all tiers) `seq`'s admission would take: its reservation, plus the pages of
        its host copy for a swapped session; the same cached answer `_reserve` uses."""
        return int(np.sum(self._reservation_need(seq)))

    def _reservation_need(self, seq: Sequence):
        """Pages per tier `seq`'s admission takes, computed once per cache and token state."""
        # A request that does not fit is tried again every step; what it needs changes only
        # with its cache (an eviction drops the slot) or its tokens, so it is computed once.
        # A family (parallel samples) is admitted whole: a slot per completion, and the pages
        # its forks will copy reserved with the prompt's.
        # A session swapped to host memory takes its old pages back too (`swap_in`).
        forks = len(seq.fork_children)
        held = seq.slot if seq.is_cached else seq.host_kv
        key = (seq.slot, id(seq.host_kv), seq.num_uncomputed_tokens, forks)
        if seq.reservation_need is None or seq.reservation_need[0] != key:
            seq.reservation_need = (key, self.manager.pages_to_reserve(held, self._plan(seq),
                                                                       forks))
        return seq.reservation_need[1]

    def _reserve(self, seq: Sequence) -> bool:
        """Slot + the turn's whole reservation, evicting idle sessions only if that suffices."""
        m = self.manager
        forks = len(seq.fork_children)
        # Page counts are per tier with precision tiers: every tier must have its pages.
        need = self._reservation_need(seq)
        need_slots = (not seq.is_cached) + forks
        if np.any(m.num_free_pages < need) or m.num_free_slots < need_slots:
            # Victims are listed sessions: when all of them together are not enough, skip
            # ranking them (this runs for every waiting turn short of room, every step).
            if (np.any(need > m.num_free_pages + self.sessions.evictable_pages)
                    or m.num_free_slots + self.sessions.num_evictable < need_slots):
                return False
            victims = self._admission_victims(seq)
            if np.any(need > m.num_free_pages + sum(m.pages_held(v.slot) for v in victims)):
                return False
            if m.num_free_slots + len(victims) < need_slots:
                return False
            for victim in victims:
                if np.all(m.num_free_pages >= need) and m.num_free_slots >= need_slots:
                    break
                self._evict(victim)
        self.sessions.unlist(seq)   # before its page count changes
        if not seq.is_cached:
            seq.slot = m.allocate_slot()
            if seq.is_swapped:
                self._swap_in(seq)
        if not m.reserve(seq.slot, self._plan(seq), forks):
            raise AssertionError("reservation failed after the pool was checked")
        for child in seq.fork_children:
            child.slot = m.allocate_slot()
        seq.reservation_need = None   # the slot's contents change from here on
        return True

    def _admission_victims(self, seq: Sequence) -> list[Sequence]:
        """The sessions an admission of `seq` may evict, the first to go first.

        A session whose next turn is queued is kept: that turn is work the device can do now
        and would otherwise re-prefill the session's whole history (a closed-loop client sends
        it the moment the answer arrives). While other sequences run, so is a session that went
        idle less than the table's idle prior ago (its next turn is the likeliest to come); the
        admission waits for pages the running sequences will return. With nothing running,
        waiting would idle the device, so every idle session is a candidate, and after a step
        that admitted nothing with nothing running, queued sessions too (admission cannot
        stall)."""
        order = [v for v in self.sessions.eviction_order() if v is not seq]
        if self._admission_stalled and not self.running:
            return order
        idle = [v for v in order if v.status is SequenceStatus.IDLE]
        if not self.running:
            return idle
        now = self.sessions.clock()
        grace = self.sessions.idle_prior_seconds
        return [v for v in idle if now - v.idle_since >= grace]

    @staticmethod
    def _plan(seq: Sequence) -> list[tuple[int, bool]]:
        """The admission's prefill plan as ``(length, compressed)`` segments (what to reserve)."""
        return [(b - a, c) for a, b, c in seq.plan_prefill()]
