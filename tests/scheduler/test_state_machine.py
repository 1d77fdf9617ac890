"""Randomized whole-scheduler test: arrivals, multi-turn continuations, families of parallel
samples (forked onto shared pages), finishes, aborts, preemptions and evictions on a small pool, with the device simulated by committing exactly what
each step scheduled. Invariants are checked after every step; teardown drains the queue. The
same machine runs with precision tiers (a pool of page ids per tier: every page is held in its
own tier's pool, and reservations are the tiered formula)."""

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tangram_jax.kv_layout import KVLayout, TieredLayout, pages_for
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import RequestTooLargeError, Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

NUM_LAYERS, NUM_HEADS, HEAD_DIM, PAGE, CHUNK = 2, 4, 8, 4, 8
BUDGETS = np.array([[0.25, 0.6], [0.4, 1.0]])
NUM_PAGES, MAX_SEQS, MAX_PAGES, TOKEN_BUDGET = 48, 4, 16, 28
BUCKETS = (1, 2, 4)
# Tiered: high shares of every group (one group keeps all in the high tier, one none), and
# the two tiers' pools (null pages included): small enough that either tier runs short.
HIGH_SHARE = np.array([[0.5, 0.2], [1.0, 0.0]])
TIER_PAGES = (24, 30)


def tangram_layout():
    return KVLayout(num_layers=NUM_LAYERS, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM,
                    group_size=2, page_size=PAGE, chunk_size=CHUNK,
                    head_perm=np.tile([1, 3, 0, 2], (NUM_LAYERS, 1)), group_budgets=BUDGETS)


def tiered_layout():
    return TieredLayout(tangram_layout(), HIGH_SHARE)


def monolithic_layout():
    return KVLayout.monolithic(NUM_LAYERS, NUM_HEADS, HEAD_DIM, page_size=PAGE, chunk_size=CHUNK)


class SchedulerMachine(RuleBasedStateMachine):
    policy = "reserve"
    tiered = False
    # Long prefills capped at two chunks, one at a time (the engine's kind of default).
    long_prefill_kwargs = dict(long_prefill_token_threshold=2 * CHUNK, max_long_partial_prefills=1)

    @initialize()
    def setup(self):
        layout = (tiered_layout() if self.tiered else
                  tangram_layout() if self.policy == "reserve" else monolithic_layout())
        # Pool sizes per tier (one tier untiered), the null page included; the tier of each
        # group, and the groups a decode token goes to.
        self.pool_sizes = np.array(TIER_PAGES if self.tiered else (NUM_PAGES,))
        self.group_tier = np.arange(layout.num_groups) % 2 if self.tiered else \
            np.zeros(layout.num_groups, int)
        self.decode_inc = (layout.decode_tier_groups if self.tiered
                           else np.ones(layout.num_groups, bool)).astype(np.int32)
        self.manager = KVCacheManager(layout, tuple(self.pool_sizes) if self.tiered
                                      else NUM_PAGES, MAX_SEQS, MAX_PAGES,
                                      model_kv_shape=(NUM_LAYERS, NUM_HEADS, HEAD_DIM),
                                      policy=self.policy)
        self.now = 0.0   # the sessions' clock: half a second a step
        self.sched = Scheduler(self.manager, max_num_batched_tokens=TOKEN_BUDGET,
                               decode_buckets=BUCKETS, fairness_skips=3,
                               clock=lambda: self.now, **self.long_prefill_kwargs)
        self.layout = layout
        self.device_table = self.manager.block_tables.copy()
        self.counter = 0
        self.max_new: dict[str, int] = {}      # live request -> tokens it generates
        self.admitted: set[str] = set()
        self.ended: dict[str, str] = {}        # request -> how it ended
        self.idle_sessions: set[str] = set()
        self.turn_target: dict[str, np.ndarray] = {}   # request -> lengths after its prefill
        self.rng = np.random.default_rng(0)

    # ----- rules -------------------------------------------------------------------------
    def _by_tier(self, cell_pages):
        """int [tiers]: pages per cell [layers, groups] summed per tier."""
        return np.bincount(np.broadcast_to(self.group_tier, cell_pages.shape).ravel(),
                           weights=cell_pages.ravel(), minlength=len(self.pool_sizes))

    def _expect_fits(self, total_tokens):
        need = pages_for(self.layout.retained_counts(total_tokens) + self.decode_inc, PAGE)
        return need.max() <= MAX_PAGES and (self._by_tier(need) <= self.pool_sizes - 1).all()

    @rule(length=st.integers(1, 90), max_new=st.integers(1, 6), with_session=st.booleans())
    def arrive(self, length, max_new, with_session):
        self.counter += 1
        rid = f"r{self.counter}"
        session = f"s{self.counter}" if with_session else None
        try:
            self.sched.add_request(rid, list(range(length)), session_id=session)
        except RequestTooLargeError:
            assert not self._expect_fits(length)
            return
        assert self._expect_fits(length)
        self.max_new[rid] = max_new

    @rule(length=st.integers(1, 60), max_new=st.integers(1, 6), n=st.integers(2, 3))
    def arrive_family(self, length, max_new, n):
        """A request of n parallel samples: the first prefills, the others fork its pages."""
        self.counter += 1
        rid = f"r{self.counter}"
        forks = [f"{rid}.{i}" for i in range(1, n)]
        try:
            self.sched.add_request(rid, list(range(length)), fork_ids=forks)
        except RequestTooLargeError:
            decode_cells = self._by_tier(np.broadcast_to(self.decode_inc, (NUM_LAYERS, 4 if
                                                                     self.tiered else 2)))
            assert not self._expect_fits(length) or np.any(self.manager.pages_to_reserve(
                None, length, n - 1) + n * decode_cells > self.pool_sizes - 1)
            return
        for r in (rid, *forks):
            self.max_new[r] = max_new

    @precondition(lambda self: self.idle_sessions)
    @rule(data=st.data(), length=st.integers(1, 30), max_new=st.integers(1, 6))
    def next_turn(self, data, length, max_new):
        session = data.draw(st.sampled_from(sorted(self.idle_sessions)))
        seq = self.sched.sessions.get(session)
        history = seq.num_tokens + length
        self.counter += 1
        rid = f"r{self.counter}"
        try:
            self.sched.add_request(rid, [7] * length, session_id=session)
        except RequestTooLargeError:
            assert not self._expect_fits(history)
            return
        assert self._expect_fits(history)
        self.idle_sessions.discard(session)
        self.max_new[rid] = max_new

    @precondition(lambda self: self.max_new)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.max_new)))
        session = self.sched.get(rid).session_id
        self.sched.abort(rid)
        del self.max_new[rid]
        self.ended[rid] = "aborted"
        self.idle_sessions.discard(session)

    @precondition(lambda self: self.idle_sessions)
    @rule(data=st.data())
    def close_session(self, data):
        session = data.draw(st.sampled_from(sorted(self.idle_sessions)))
        self.sched.close_session(session)
        self.idle_sessions.discard(session)

    @rule()
    def step(self):
        self._step()

    # ----- the simulated device ----------------------------------------------------------
    def _step(self):
        m, sched = self.manager, self.sched
        self.now += 0.5
        out = sched.schedule()
        # The device copy of the block table follows the host through the update log.
        index, value = m.take_table_updates()
        self.device_table.reshape(-1)[index] = value
        assert (self.device_table == m.block_tables).all()
        assert out.num_scheduled_tokens <= TOKEN_BUDGET
        # Long prefills: each piece within the cap, at most max_long_partial_prefills of them.
        threshold = sched.long_prefill_token_threshold
        longs = [c for c in out.prefill_chunks if c.seq.num_uncomputed_tokens > threshold]
        assert all(c.num_tokens <= threshold for c in longs)
        assert len(longs) <= sched.max_long_partial_prefills
        running_long = [s for s in sched.running if s.status is SequenceStatus.PREFILL
                        and s.num_uncomputed_tokens > threshold]
        assert len(running_long) <= sched.max_long_partial_prefills
        assert out.decode_bucket in (0,) + BUCKETS and out.decode_bucket >= len(out.decode_seqs)
        assert (out.decode_slots[len(out.decode_seqs):] == m.null_slot).all()
        assert len({s.slot for s in out.decode_seqs}) == len(out.decode_seqs)
        # The cached decode batch is every decoding sequence, oldest admission first.
        decoding = [s for s in sched.running if s.status is SequenceStatus.DECODE]
        assert out.decode_seqs == decoding
        assert out.decode_slots[:len(decoding)].tolist() == [s.slot for s in decoding]
        for seq in out.capped:
            self.ended[seq.request_id] = "capped"
            self.max_new.pop(seq.request_id, None)
        sampled = {}
        reclaim = {}
        for chunk in out.prefill_chunks:
            seq = chunk.seq
            rid = seq.request_id
            self.admitted.add(rid)
            # Pieces start on compression-chunk boundaries of their planned segment (the turn,
            # or a replayed turn / generated span after a preemption or eviction).
            assert chunk.segment in seq.segments
            assert (chunk.start - chunk.segment[0]) % CHUNK == 0
            assert chunk.is_last == (chunk.end == seq.num_tokens)
            if chunk.start == seq.turn_start:
                # Admitted this step: nothing written yet, so lengths are the turn's base.
                assert seq.segments[0][0] == seq.turn_start
                assert seq.segments[-1][1] == seq.num_tokens
                self.turn_target[rid] = (m.lengths[seq.slot].astype(np.int64)
                                         + self.layout.segments_retained_counts(
                                             [(b - a, c) for a, b, c in seq.segments]))
            if self.policy == "reserve":
                assert (m.reserved_lengths[seq.slot] == self.turn_target[rid]).all()
                assert (m.table.num_pages[seq.slot] == pages_for(self.turn_target[rid], PAGE)).all()
            if chunk.is_last:
                sampled[rid] = 1
                for child in seq.fork_children:   # forked at this commit
                    sampled[child.request_id] = 2
            if self.policy == "reclaim":
                written = m.lengths[seq.slot] + chunk.num_tokens
                keep = np.ceil(written * self.rng.uniform(0.2, 1.0, written.shape)).astype(int)
                reclaim[rid] = np.maximum(keep, m.lengths[seq.slot])
        # Growth has counted this step's token already; the device writes it at the old length.
        write_lengths = m.decode_write_lengths(out.decode_slots)
        assert (write_lengths[len(out.decode_seqs):] == 0).all()
        for row, seq in enumerate(out.decode_seqs):
            assert (m.lengths[seq.slot] == write_lengths[row] + self.decode_inc).all()
        decode_before = {s.request_id: write_lengths[row].copy()
                         for row, s in enumerate(out.decode_seqs)}
        for row, seq in enumerate(out.decode_seqs):
            sampled[seq.request_id] = 100 + row
        sched.commit(out, sampled, reclaim_lengths=reclaim or None)
        for chunk in out.prefill_chunks:
            seq = chunk.seq
            if chunk.is_last and self.policy == "reserve":
                # What the prefill wrote is exactly what was reserved.
                assert (m.lengths[seq.slot] == self.turn_target[seq.request_id]).all()
        for row, seq in enumerate(out.decode_seqs):
            assert (m.lengths[seq.slot] == decode_before[seq.request_id] + self.decode_inc).all()
            assert seq.token_ids[-1] == 100 + row      # row i of the batch got token i
            if len(seq.output_token_ids) >= self.max_new[seq.request_id]:
                session = seq.session_id
                sched.finish(seq.request_id)
                del self.max_new[seq.request_id]
                self.ended[seq.request_id] = "finished"
                if session is not None:
                    self.idle_sessions.add(session)
        # Sessions evicted or capped are no longer idle-cached but stay continuable if idle.
        self.idle_sessions = {s for s in self.idle_sessions if s in sched.sessions}

    # ----- invariants --------------------------------------------------------------------
    @invariant()
    def pages_are_conserved_and_unique(self):
        if not hasattr(self, "manager"):
            return
        m = self.manager
        # Forked sequences share pages: each page is counted by its holders (block tables and
        # fork stashes), and the pool's free pages are the rest; with tiers, per tier's pool:
        # a tier group's pages are held in its tier's pool (fork copies in the high tier's).
        for tier, pool in enumerate(m.pools):
            tables = [np.concatenate([m.block_tables[s, layer, g, :m.table.num_pages[s, layer, g]]
                                      for layer in range(NUM_LAYERS)
                                      for g in np.flatnonzero(self.group_tier == tier)])
                      for s in range(MAX_SEQS + 1)]
            assert all(np.unique(t).size == t.size for t in tables), "a slot holds a page twice"
            owned = np.concatenate(tables + (list(m._fork_stash.values()) if tier == 0 else []))
            pages, holders = np.unique(owned, return_counts=True)
            assert pool.num_free + pages.size == self.pool_sizes[tier] - 1
            assert (pool.holders(pages) == holders).all(), "reference counts disagree"
            assert (owned != 0).all(), "the null page was handed out"
            assert (owned < self.pool_sizes[tier]).all(), "a page of another tier's pool"
        assert (m.block_tables[m.null_slot] == 0).all() and (m.lengths[m.null_slot] == 0).all()

    @invariant()
    def lengths_within_reservation(self):
        if not hasattr(self, "manager"):
            return
        m = self.manager
        assert (m.lengths <= m.reserved_lengths).all()
        assert (m.table.num_pages == pages_for(m.reserved_lengths, PAGE)).all()
        assert (m.lengths <= m.table.num_pages * PAGE).all()
        table = self.sched.sessions
        listed = [s for s in table.sequences() if s.is_cached and not s.status.is_running]
        order = table.eviction_order()
        assert set(map(id, order)) == set(map(id, listed)) and len(order) == len(listed)
        assert table.num_evictable == len(listed)
        # Idle sessions by score, then those whose next turn is queued.
        queued = [s.status is not SequenceStatus.IDLE for s in order]
        assert queued == sorted(queued)
        idle_scores = [table.eviction_score(s) for s, q in zip(order, queued) if not q]
        assert idle_scores == sorted(idle_scores, reverse=True), "eviction order is not by score"
        assert table.evictable_pages == sum(int(np.sum(m.pages_held(s.slot))) for s in listed)
        assert all(s.session_id in table for s in listed)
        holders = [s for s in table.sequences() if s.is_cached]
        holders += [s for s in self.sched.running if s.session_id is None]
        # Completions waiting for their family's fork hold a slot from its admission on.
        family = list(self.sched.running) + list(self.sched.waiting)
        waiting_forks = [c for s in family for c in s.fork_children]
        assert all(c.is_cached == s.is_cached for s in family for c in s.fork_children)
        assert all(not m.table.num_pages[c.slot].any() for c in waiting_forks if c.is_cached)
        holders += [c for c in waiting_forks if c.is_cached]
        # Finished requests' slots whose pages are returned lazily.
        parked = list(self.sched._parked)
        assert sorted([s.slot for s in holders] + parked) == sorted(
            np.flatnonzero(m._slot_in_use[:MAX_SEQS]).tolist())
        if parked:
            assert self.sched.running, "pages parked while nothing runs"

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self._step()
        assert not self.sched.has_unfinished(), "requests left unfinished after draining"
        for rid in self.admitted:
            assert rid in self.ended, f"admitted request {rid} never ended"
        assert not self.max_new
        for session in list(self.idle_sessions):
            self.sched.close_session(session)
        assert [p.num_free for p in self.manager.pools] == list(self.pool_sizes - 1)
        for name in ("num_preemptions", "num_evictions", "num_capped", "num_rejected"):
            if getattr(self.sched.metrics, name):
                event(name)


class ReclaimMachine(SchedulerMachine):
    policy = "reclaim"
    long_prefill_kwargs = dict(long_prefill_token_threshold=None, max_long_partial_prefills=2)


_settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestReserveStateMachine = SchedulerMachine.TestCase
TestReserveStateMachine.settings = _settings
TestReclaimStateMachine = ReclaimMachine.TestCase
TestReclaimStateMachine.settings = settings(_settings, max_examples=20)


class TieredMachine(SchedulerMachine):
    tiered = True


TestTieredStateMachine = TieredMachine.TestCase
TestTieredStateMachine.settings = _settings
