"""Continuous-batching scheduler with admission by Budget Reservation.

One engine step is::

    out = scheduler.schedule()            # what to run: prefill pieces + decode batch
    ... the engine feeds the device from the manager (`take_table_updates`,
        `decode_write_lengths`, `retained_lengths`) and runs out.prefill_chunks / decode_slots ...
    scheduler.commit(out, sampled)        # prefill lengths advance, sampled tokens appended
    scheduler.finish(request_id)          # for every request the engine's stop check ended

`schedule` spends the step's token budget (`max_num_batched_tokens`) in this order:

1. Decode: every decoding sequence gets one token. Groups crossing a page boundary take a page
   (`KVCacheManager.grow_for_decode`). When the pool is short, idle sessions are evicted (the
   `SessionTable`'s ranking: most pages freed per expected recompute token first), then the
   newest running sequence is preempted by recompute (pages freed, requeued at the front, its
   whole history re-prefilled later; if that history could never be reserved again, by the pool
   or the block-table width, it ends as CAPPED instead). A sequence that could not grow even
   with the whole pool (or the full block-table width) to itself ends as CAPPED.
2. Prefill of short turns (at most `long_prefill_token_threshold` tokens left when admitted):
   first the admitted ones, oldest admission first, then admission (3). One chunk per long turn
   in prefill is kept back from them, so short turns cannot starve long ones.
3. Admission, FCFS by reservation (`admission.py`): a waiting turn is admitted only if its
   whole post-compression reservation fits (evicting idle sessions if that makes it fit; not
   sessions whose next turn is queued, nor, while other sequences run, sessions that went idle
   under a second ago: `_admission_victims`). A short turn gets its first piece at once. A long
   turn is admitted only while fewer than `max_long_partial_prefills` long turns have more than
   one piece left; until then the turns behind it go first. A turn that does not fit the pool
   is passed over so smaller ones behind it can run, but each time it is overtaken its skip
   count grows; at `fairness_skips` it gets priority and nobody else is admitted until it
   fits. Only smaller ones: a turn needing at least as many pages as an earlier one still
   waiting (passed over, or waiting for a long-prefill slot) waits behind it (a session swapped
   to host memory takes its history's pages back: a short turn with a long turn's pages).
   Requests larger than the whole pool are rejected by `add_request`.
4. Prefill of long turns, oldest admission first, each piece at most the threshold (vLLM's
   `long_prefill_token_threshold` / `max_long_partial_prefills`), from what is left.

So a follow-up of a resident session is never queued behind 100k-token first turns: it starts
in the first step after it arrives whenever it fits ``budget - decodes - chunk_size * (long
turns prefilling)`` and the pool, and long first turns still use the rest of every step.

Parallel samples (`add_request(..., fork_ids=...)`, a request of ``SamplingParams.n > 1``): the
family's first sequence is queued and admitted for all of them: a slot each and, as one
reservation, the prompt's pages once plus the copies of the partly filled decode pages each
other completion takes (`KVCacheManager.reserve(..., forks=k)`). When its prompt prefill is
committed (after the reclaim, in ``reclaim``), `commit` forks the others onto the shared pages
(`KVCacheManager.fork`) and they decode from the next step on like any sequence: each is
finished, aborted, preempted (its pages dropped: a page still shared stays with the siblings;
its own history re-prefilled alone later) or capped on its own. Before the fork: preempting the
first sequence returns the family's slots, stash and pages and requeues the family; aborting a
waiting completion drops it from the family; aborting the first one hands the family to the next
(requeued at the front, its prompt prefilled from the start); capping it caps the family.

Host tier (`host`, a `HostKVPool`): an evicted session is swapped to host memory instead of
dropped when the copy back is cheaper than its re-prefill and the host holds it (`_swap_out`);
its next admission reserves its old pages plus the turn's and copies them back (`_reserve`).

The scheduler talks to the KV-cache manager only through `SCHEDULER_INTERFACE` (slots,
reservations and growth as answers and page counts), never through its arrays; sessions live in
one `SessionTable` (`scheduler.sessions`).

Prefill pieces start on compression-chunk boundaries of their turn (``turn_start + k *
layout.chunk_size``) so the retained count of every piece is `layout.piece_retained_counts` (the
turn's protected tail kept whole) and the sum over a turn is `layout.retained_counts(turn)`,
exactly what was reserved.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from tangram_jax.decode_buckets import DEFAULT_DECODE_BUCKETS, bucket_for
from tangram_jax.scheduler.admission import AdmissionScheduling
from tangram_jax.scheduler.host_pool import HostKVPool, HostTierScheduling
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.metrics import SchedulerMetrics
from tangram_jax.scheduler.output import PrefillChunk, SchedulerOutput
from tangram_jax.scheduler.sequence import Sequence, SequenceStatus
from tangram_jax.scheduler.sessions import SessionTable


class RequestTooLargeError(ValueError):
    """The request can never fit: its reservation exceeds the whole pool or block-table width."""


class Scheduler(AdmissionScheduling, HostTierScheduling):
    """Args:
      manager: the `KVCacheManager` (its layout and policy decide what a reservation is).
      max_num_batched_tokens: per-step token budget (decode tokens + prefill tokens); must be at
        least ``manager.max_seqs + layout.chunk_size`` so prefill always progresses.
      decode_buckets: increasing batch sizes the decode step is compiled for; the largest must be
        at least ``manager.max_seqs``.
      fairness_skips: how many times a request may be overtaken before it blocks admission.
      long_prefill_token_threshold: a turn with more tokens than this left to prefill is long:
        it takes at most this many tokens of a step (whole compression chunks). None: the whole
        budget (no cap; `EngineConfig.resolve` gives the engine its default). Between
        ``chunk_size`` and `max_num_batched_tokens`.
      max_long_partial_prefills: long turns prefilling at once (the others wait, and shorter
        turns behind them go first).
      clock: seconds, monotonic, for the sessions' idle times (tests pass a fake one).
      host: the host tier evicted sessions may be swapped to (None: evictions recompute).
    """

    def __init__(self, manager: KVCacheManager, *, max_num_batched_tokens: int = 4096,
                 decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS,
                 fairness_skips: int = 8, long_prefill_token_threshold: int | None = None,
                 max_long_partial_prefills: int = 1, clock=time.monotonic,
                 host: HostKVPool | None = None):
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        buckets = tuple(int(b) for b in decode_buckets)
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"decode_buckets must be strictly increasing positive ints, got "
                             f"{decode_buckets!r}")
        if buckets[-1] < manager.max_seqs:
            raise ValueError(f"largest decode bucket {buckets[-1]} < max_seqs {manager.max_seqs}")
        chunk = manager.layout.chunk_size
        if max_num_batched_tokens < manager.max_seqs + chunk:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_seqs + chunk_size ({manager.max_seqs + chunk})")
        if fairness_skips < 1:
            raise ValueError(f"fairness_skips must be >= 1, got {fairness_skips}")
        threshold = (max_num_batched_tokens if long_prefill_token_threshold is None
                     else long_prefill_token_threshold)
        if not chunk <= threshold <= max_num_batched_tokens:
            raise ValueError(f"long_prefill_token_threshold must lie in [chunk_size, "
                             f"max_num_batched_tokens] = [{chunk}, {max_num_batched_tokens}], "
                             f"got {long_prefill_token_threshold!r}")
        if host is not None and not isinstance(host, HostKVPool):
            raise TypeError(f"host must be a HostKVPool or None, got {type(host).__name__}")
        if max_long_partial_prefills < 1:
            raise ValueError(f"max_long_partial_prefills must be >= 1, got "
                             f"{max_long_partial_prefills!r}")
        self.manager = manager
        self.layout = manager.layout
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.decode_buckets = buckets
        self.fairness_skips = int(fairness_skips)
        self.long_prefill_token_threshold = int(threshold)
        self.max_long_partial_prefills = int(max_long_partial_prefills)
        self.metrics = SchedulerMetrics()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # PREFILL and DECODE, oldest admission first
        self._requests: dict[str, Sequence] = {}   # live request id -> sequence
        # Eviction ranks sessions by the pages they hold, every tier's together.
        self.host = host if host is not None and host.enabled else None
        self.sessions = SessionTable(lambda slot: int(np.sum(manager.pages_held(slot))),
                                     clock=clock,
                                     eviction_cost=self._eviction_cost if self.host else None)
        self._parked: list[int] = []               # slots of finished requests, pages not freed yet
        self._step = 0
        self._admissions = 0
        self._admission_stalled = False
        self._aborted_since_schedule = False
        # `running` split by status, and the decode slots, rebuilt only after `running` or a
        # status in it changed: a step with no admission, transition or finish reuses them.
        self._batch_stale = True
        self._decoding: list[Sequence] = []
        self._decoding_slots = np.zeros(0, dtype=np.intp)
        self._prefilling: list[Sequence] = []

    # ----- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any = None,
                    *, session_id: str | None = None, arrival_time: float | None = None,
                    fork_ids: tuple[str, ...] = ()) -> Sequence:
        """Queue a request (a new sequence, or the next turn of an idle session).

        fork_ids: request ids of further completions of the same prompt (parallel samples, see
        the module docstring); `get` returns their sequences. Not with a session.

        Raises what `check_request` raises, before anything changes.
        """
        tokens = list(prompt_token_ids)
        if tokens and np.asarray(tokens).dtype.kind not in "iu":
            raise TypeError(f"request {request_id!r}: prompt_token_ids must be ints")
        fork_ids = tuple(fork_ids)
        if fork_ids and session_id is not None:
            raise ValueError(f"request {request_id!r}: parallel samples (fork_ids) cannot "
                             f"continue a session (session_id {session_id!r})")
        ids = (request_id, *fork_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"request {request_id!r}: fork_ids repeat an id: {list(ids)}")
        for fork_id in fork_ids:
            if not isinstance(fork_id, str) or not fork_id or fork_id in self._requests:
                raise ValueError(f"fork id {fork_id!r} must be a fresh non-empty str")
        self.check_request(request_id, len(tokens), session_id, forks=len(fork_ids))
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        seq = self.sessions.get(session_id)
        if seq is not None:
            held = seq.slot if seq.is_cached else seq.host_kv
            if held is not None and not self.manager.fits_ever(
                    held, seq.num_uncomputed_tokens + len(tokens)):
                self._drop_cache(seq)   # the cached path can never fit; re-prefill everything
            seq.start_turn(request_id, tokens, sampling_params, arrival)
        else:
            seq = Sequence(request_id, tokens, sampling_params, session_id=session_id,
                           arrival_time=arrival)
            if session_id is not None:
                self.sessions.add(seq)
        self._requests[request_id] = seq
        for fork_id in fork_ids:
            child = Sequence(fork_id, tokens, sampling_params, arrival_time=arrival)
            child.fork_parent = seq
            seq.fork_children.append(child)
            self._requests[fork_id] = child
        self.waiting.append(seq)
        return seq

    def check_request(self, request_id: str, num_tokens: int, session_id: str | None = None,
                      forks: int = 0) -> None:
        """Raise if `add_request` would refuse this request; queues nothing (a batch checks
        every item before queuing any; a refusal is counted in `metrics.num_rejected`).

        RequestTooLargeError when its reservation (the whole history re-prefilled, plus one
        decode token, and each of `forks` parallel samples' own decode pages) exceeds the pool
        or the block-table width; ValueError for a duplicate request id, an empty prompt or a
        session whose previous turn is still running.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already live")
        if num_tokens < 1:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        seq = self.sessions.get(session_id)
        if seq is not None and seq.status is not SequenceStatus.IDLE:
            raise ValueError(f"session {session_id!r} is still serving request "
                             f"{seq.request_id!r} ({seq.status.value})")
        total = num_tokens + (seq.num_tokens if seq is not None else 0)
        if forks + 1 > self.manager.max_seqs:
            self.metrics.num_rejected += 1
            raise RequestTooLargeError(
                f"request {request_id!r}: {forks + 1} parallel samples need as many sequence "
                f"slots; the engine has {self.manager.max_seqs} (max_num_seqs)")
        if not self.manager.fits_ever(None, total, forks):
            self.metrics.num_rejected += 1
            m = self.manager
            need = m.pages_to_reserve(None, total, forks)
            raise RequestTooLargeError(
                f"request {request_id!r} ({total} tokens of history"
                f"{f', {forks + 1} samples' if forks else ''}) needs {m.describe_pages(need)} "
                f"after compression plus decode room; the pool has "
                f"{m.describe_pages(m.capacity)} and a group at most {m.max_pages_per_group}")

    def get(self, request_id: str) -> Sequence:
        return self._requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request_id: str) -> None:
        """End a running request's turn: a session keeps slot and pages (IDLE); otherwise slot
        and pages are returned, lazily: when admission or decode growth wants them, or when
        nothing else runs (see `_park`).

        A request preempted after its last token was sampled (an engine that learns tokens one
        step late, see `Engine.step`) can be finished from the waiting queue too; it holds no
        cache then, so a session's next turn re-prefills its history."""
        t0 = time.perf_counter()
        seq = self._live(request_id)
        if seq.status.is_running:
            self._stop_running(seq)
        elif seq.status is SequenceStatus.WAITING and seq.num_output_tokens and seq in self.waiting:
            self.waiting.remove(seq)
        else:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not running")
        del self._requests[request_id]
        if seq.session_id is not None:
            self.sessions.mark_idle(seq)
        else:
            self._park(seq)
        if self._parked and not self.running:
            self._release_parked()
        self.metrics.add_to_step(time.perf_counter() - t0)

    def abort(self, request_id: str) -> None:
        """Drop a request in any state, with its session's cache (a family's completion not
        forked yet: see the module docstring)."""
        seq = self._live(request_id)
        del self._requests[request_id]
        self._aborted_since_schedule = True
        if seq.fork_parent is not None:   # a completion waiting for its fork
            seq.fork_parent.fork_children.remove(seq)
            seq.fork_parent = None
        elif seq.fork_children:           # the family's prefill: the next completion takes it
            self._hand_family_on(seq)
        if seq in self.running:
            self._stop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, SequenceStatus.ABORTED)

    def _free_children(self, children) -> None:
        """Drop the slots of a family's completions not forked yet (the family is admitted
        again, slots and all)."""
        for child in children:
            if child.is_cached:
                self.manager.free(child.slot)
                child.drop_cache()

    def _hand_family_on(self, seq: Sequence) -> None:
        """`seq`, prefilling for its family, goes away before the fork: its first waiting
        completion prefills for the rest instead, queued first (from the start of the prompt)."""
        heir, *rest = seq.fork_children
        seq.fork_children = []
        self._free_children((heir, *rest))
        heir.fork_parent = None
        heir.fork_children = rest
        for child in rest:
            child.fork_parent = heir
        heir.status = SequenceStatus.WAITING
        self.waiting.appendleft(heir)

    def close_session(self, session_id: str) -> None:
        """Free an idle session's slot and pages."""
        seq = self.sessions.get(session_id)
        if seq is None:
            raise KeyError(f"no session {session_id!r}")
        if seq.status is not SequenceStatus.IDLE:
            raise ValueError(f"session {session_id!r} is {seq.status.value}, not idle")
        self._release(seq, SequenceStatus.FINISHED)

    def evict_session(self, session_id: str) -> bool:
        """Evict an idle session's cache now, as a full pool would (`_evict`: to host memory
        where the host tier takes it, else dropped). Returns whether it went to host memory."""
        seq = self.sessions.get(session_id)
        if seq is None:
            raise KeyError(f"no session {session_id!r}")
        if seq.status is not SequenceStatus.IDLE or not seq.is_cached:
            raise ValueError(f"session {session_id!r} is {seq.status.value}"
                             f"{'' if seq.is_cached else ' without a cache in the pool'}: only "
                             f"an idle session holding pages can be evicted")
        self._evict(seq)
        return seq.is_swapped

    # ----- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        self._step += 1
        budget = self.max_num_batched_tokens
        preempted: list[Sequence] = []
        capped: list[Sequence] = []

        # (Parked pages never outlive the running sequences: finish and release return them
        # when nothing runs any more, and growth returns them before it preempts.)
        if self._parked and self.waiting:
            self._release_parked()   # admission may need the pages and slots
        self._refresh_batches()
        decode, decode_slots = self._grow_for_decode(preempted, capped)
        budget -= len(decode)

        self._refresh_batches()   # a preemption may have taken a prefilling sequence
        chunks: list[PrefillChunk] = []
        # Short turns first (running, then admitted), long ones take what is left: a follow-up
        # that arrived while long first turns prefill is served in this step. A chunk per
        # running long turn is kept back, so a stream of short turns cannot starve them. A
        # turn admitted as long stays in the long pass until its prefill ends; each of its
        # pieces is at most the threshold, and at most `max_long_partial_prefills` long turns
        # with more than one piece left run at once.
        longs = [s for s in self._prefilling if s.long_prefill]
        kept = min(budget, len(longs) * self.layout.chunk_size)
        budget -= kept
        for seq in self._prefilling:
            if budget > 0 and not seq.long_prefill:
                budget = self._add_piece(seq, budget, chunks)
        # A step that had to preempt is short of pages: admitting now would only thrash.
        if not preempted:
            budget = self._admit(budget, chunks, longs)
            # Nothing runs and nothing could be admitted: the next admission may evict queued
            # sessions too (`_admission_victims`), or the engine would stall.
            self._admission_stalled = not self.running and bool(self.waiting)
        budget += kept
        for seq in longs:
            if budget > 0:
                budget = self._add_piece(seq, budget, chunks)

        n = len(decode)
        bucket = bucket_for(n, self.decode_buckets)
        slots = np.full(bucket, self.manager.null_slot, dtype=np.int32)
        slots[:n] = decode_slots
        out = SchedulerOutput(step=self._step, prefill_chunks=chunks, decode_seqs=decode,
                              decode_slots=slots, preempted=preempted, capped=capped)
        self.metrics.start_step(time.perf_counter() - t0)
        return out

    def commit(self, output: SchedulerOutput, sampled_tokens: Mapping[str, int],
               reclaim_lengths: Mapping[str, np.ndarray] | None = None) -> None:
        """Record what the device did for `output`.

        sampled_tokens: request id -> token sampled this step, for every decode sequence and
          every prefill chunk with `is_last`.
        reclaim_lengths: (reclaim policy only) request id -> int [layers, groups] retained
          counts after the device's dynamic compression of that request's chunk.
        Sequences aborted between `schedule` and `commit` are skipped.
        """
        t0 = time.perf_counter()
        for chunk in output.prefill_chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.PREFILL or seq.num_computed_tokens != chunk.start:
                continue
            seg_start, seg_end, compressed = chunk.segment
            self.manager.commit_prefill(seq.slot, chunk.num_tokens, start=chunk.start - seg_start,
                                        turn_len=seg_end - seg_start, compressed=compressed)
            if reclaim_lengths is not None and seq.request_id in reclaim_lengths:
                self.manager.reclaim(seq.slot, reclaim_lengths[seq.request_id])
            seq.num_computed_tokens = chunk.end
            if chunk.is_last:
                self.manager.finish_prefill(seq.slot)
                seq.token_ids.append(self._sampled(sampled_tokens, seq))
                seq.status = SequenceStatus.DECODE
                self._batch_stale = True
                if seq.fork_children:
                    self._fork(seq, sampled_tokens)
        seqs = output.decode_seqs
        if seqs:
            # (Their KV lengths already count this token: `grow_for_decode` took it.)
            if self._aborted_since_schedule:
                seqs = [q for q in seqs if q.status is SequenceStatus.DECODE]
            try:
                # Values are not checked: an engine that learns tokens a step late commits
                # placeholders and overwrites `token_ids` later.
                tokens = [int(sampled_tokens[q.request_id]) for q in seqs]
            except KeyError:
                for q in seqs:
                    self._sampled(sampled_tokens, q)   # raises, naming the request
                raise
            for seq, token in zip(seqs, tokens):
                seq.num_computed_tokens += 1
                seq.token_ids.append(token)
        self._aborted_since_schedule = False
        self.metrics.add_to_step(time.perf_counter() - t0)

    # ----- internals ---------------------------------------------------------------------
    def _fork(self, seq: Sequence, sampled_tokens: Mapping[str, int]) -> None:
        """`seq`'s prompt is in the cache: its waiting completions become decoding sequences on
        its pages (their slots were taken at admission), right after it in `running`."""
        children = seq.fork_children
        firsts = [self._sampled(sampled_tokens, c) for c in children]
        self.manager.fork(seq.slot, [c.slot for c in children])
        seq.fork_children = []
        for child, token in zip(children, firsts):
            child.fork(seq, token)
            child.status = SequenceStatus.DECODE
        at = self.running.index(seq) + 1
        self.running[at:at] = children

    def _refresh_batches(self) -> None:
        if self._batch_stale:
            self._decoding = [s for s in self.running if s.status is SequenceStatus.DECODE]
            self._prefilling = [s for s in self.running if s.status is SequenceStatus.PREFILL]
            self._decoding_slots = np.array([s.slot for s in self._decoding], dtype=np.intp)
            self._batch_stale = False

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._batch_stale = True

    def _grow_for_decode(self, preempted: list[Sequence],
                         capped: list[Sequence]) -> tuple[list[Sequence], np.ndarray]:
        """Grow every decoding sequence by one token, preempting (or capping) when the pool or
        the table cannot serve; returns the granted sequences (admission order) and slots."""
        decode = self._decoding
        ok = self.manager.grow_for_decode(self._decoding_slots)
        if ok.all():   # the common case: the whole batch, its slot array reused
            return decode, self._decoding_slots
        granted = [s for s, o in zip(decode, ok) if o]
        pending = [s for s, o in zip(decode, ok) if not o]
        while pending:
            first = pending[0]
            own = self.manager.pages_held(first.slot) + self.manager.decode_demand(first.slot)
            if self.manager.at_table_limit(first.slot) or np.any(own > self.manager.capacity):
                self._end_capped(first, capped)
                pending = pending[1:]
            elif self._parked:   # pages of finished requests not returned yet
                self._release_parked()
            else:
                if not self._evict_one():
                    victim = self.running[-1]   # running is in admission order: the newest
                    replay = [(b - a, c) for a, b, c in victim.replay_plan()]
                    if self.manager.fits_ever(None, replay, len(victim.fork_children)):
                        self._preempt(victim)
                        preempted.append(victim)
                    else:   # its history re-prefilled could never be reserved again
                        self._end_capped(victim, capped)
                    granted = [s for s in granted if s is not victim]
                    pending = [s for s in pending if s is not victim]
            if not pending:
                break
            ok = self.manager.grow_for_decode(np.array([s.slot for s in pending]))
            granted += [s for s, o in zip(pending, ok) if o]
            pending = [s for s, o in zip(pending, ok) if not o]
        # Keep the batch in admission order (oldest first) for stable row positions.
        granted.sort(key=lambda s: s.admission_order)
        return granted, np.array([s.slot for s in granted], dtype=np.intp)

    def _is_long(self, seq: Sequence) -> bool:
        """Whether the turn has more than `long_prefill_token_threshold` tokens left to prefill
        (its pieces are capped, and only `max_long_partial_prefills` such turns run at once)."""
        return seq.num_uncomputed_tokens > self.long_prefill_token_threshold

    def _piece_size(self, seq: Sequence, budget: int) -> int:
        """Largest piece from the sequence's next chunk boundary that fits `budget` (and the
        long-prefill cap for a long turn), within its planned segment (a replayed history runs
        segment by segment)."""
        if self._is_long(seq):
            budget = min(budget, self.long_prefill_token_threshold)
        remaining = seq.segment_at(seq.num_computed_tokens)[1] - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        chunk = self.layout.chunk_size
        return (budget // chunk) * chunk

    def _add_piece(self, seq: Sequence, budget: int, chunks: list[PrefillChunk]) -> int:
        """Schedule the sequence's next piece within `budget`; returns the budget left."""
        take = self._piece_size(seq, budget)
        if take:
            chunks.append(self._chunk(seq, take))
        return budget - take

    def _chunk(self, seq: Sequence, take: int) -> PrefillChunk:
        start = seq.num_computed_tokens
        return PrefillChunk(seq, start, start + take, start + take == seq.num_tokens,
                            seq.segment_at(start))

    def _park(self, seq: Sequence) -> None:
        """A finished request without a session: its pages go back to the pool when they are
        wanted (admission, decode growth short of pages) or when nothing else runs. Returning a
        long sequence's thousands of pages is the costliest host work of a step; a step that
        admits also runs prefill on the device, so it hides that work better than a decode-only
        step does."""
        slot = seq.slot
        seq.drop_cache()
        seq.status = SequenceStatus.FINISHED
        if slot >= 0:
            self._parked.append(slot)

    def _release_parked(self) -> None:
        for slot in self._parked:
            self.manager.free(slot)
        self._parked.clear()

    def _evict_one(self) -> bool:
        """Evict the session the table ranks first; False if there is none."""
        order = self.sessions.eviction_order()
        if not order:
            return False
        self._evict(order[0])
        return True

    def _evict(self, seq: Sequence) -> None:
        """Move an idle (or queued) session's cache to the host tier where that is cheaper
        (`_swap_out`), else drop it: its history re-prefills on its next turn. An idle anonymous
        session is forgotten instead (see `SessionTable`)."""
        self.metrics.num_evictions += 1
        if self._swap_out(seq):
            return
        self.metrics.evicted_recompute_tokens += seq.num_tokens
        if seq.status is SequenceStatus.IDLE and self.sessions.is_anonymous(seq.session_id):
            self._release(seq, SequenceStatus.FINISHED)
        else:
            self._drop_cache(seq)

    def _drop_cache(self, seq: Sequence) -> None:
        if seq.is_cached:
            self.sessions.unlist(seq)
            self.manager.free(seq.slot)
        elif seq.is_swapped:
            self.host.remove(seq)
            self.manager.discard_swapped(seq.host_kv)
        seq.drop_cache()
        self._free_children(seq.fork_children)   # a family not forked yet: their slots go too

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        self._drop_cache(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.metrics.num_preemptions += 1

    def _end_capped(self, seq: Sequence, capped: list[Sequence]) -> None:
        """End `seq` for lack of KV room (and its family's completions not forked yet, which
        could not be served either), appending each to `capped`."""
        family = [seq, *seq.fork_children]
        self._stop_running(seq)
        self._release(seq, SequenceStatus.CAPPED)
        for member in family:
            self._requests.pop(member.request_id, None)
            member.status = SequenceStatus.CAPPED
            member.fork_parent = None
            capped.append(member)
            self.metrics.num_capped += 1
        seq.fork_children = []

    def _release(self, seq: Sequence, status: SequenceStatus) -> None:
        self._drop_cache(seq)
        seq.status = status
        if seq.session_id is not None and self.sessions.get(seq.session_id) is seq:
            self.sessions.remove(seq.session_id)
        if self._parked and not self.running:
            self._release_parked()

    @staticmethod
    def _sampled(sampled_tokens: Mapping[str, int], seq: Sequence) -> int:
        try:
            return int(sampled_tokens[seq.request_id])
        except KeyError:
            raise ValueError(f"no sampled token given for request {seq.request_id!r}") from None

    def _live(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise KeyError(f"no live request {request_id!r}")
        return seq

