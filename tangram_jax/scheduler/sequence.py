"""Per-request (and per-session) state the scheduler tracks.

A `Sequence` is one conversation's KV-cache owner. A single-turn request is a sequence that is
freed when its turn ends; a multi-turn session keeps the same `Sequence` across turns (new
`request_id` per turn) together with its slot and pages, so the next turn only prefills what
is not in the cache yet.

Token bookkeeping (indices into `token_ids`, the full history of every turn):

- ``num_computed_tokens``: the prefix whose KV has been written to the cache. While decoding it
  is ``len(token_ids) - 1``: the last sampled token is written by the next decode step.
- ``turn_start``: where this turn's uncached tokens began when it was admitted.
- ``turns``: the span ``[start, end)`` of every turn's prompt prefill as first admitted: what
  chunked compression cut, from the span's start (`KVLayout.retained_counts` of its length).
  Tokens outside every span were generated and kept whole by decode.
- ``segments``: the prefill plan of the current admission, ``(start, end, compressed)`` spans
  covering the uncomputed tokens; prefill pieces start on ``start + k * chunk_size`` of their
  segment. Normally one segment, the new turn. After an eviction or a preemption everything is
  uncached and the history is re-prefilled *as it was first written* (`plan_prefill`): every
  recorded turn compressed with its own chunking, generated tokens kept whole, so the retained
  KV (and hence greedy output) does not depend on whether the pool ran short.
- ``prompt_start``: where this turn's new prompt tokens begin; ``token_ids[prompt_start:
  prompt_start + num_prompt_tokens]`` is the prompt, what follows is this turn's output.

The completions of a request of ``SamplingParams.n > 1`` are a family: the first is queued and
prefills the prompt once; the others wait in its ``fork_children`` (holding a slot from the
family's admission on, but no pages and no place in any queue) until its prefill ends, when
`Sequence.fork` makes each an ordinary decoding sequence on the shared prompt pages.
"""

from __future__ import annotations

import enum
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued for admission (a session may still hold its cached pages)
    PREFILL = "prefill"    # pages reserved, prefill pieces running
    DECODE = "decode"      # generating one token per step
    IDLE = "idle"          # turn over; the session keeps its slot and pages
    FINISHED = "finished"  # freed: turn over without a session, or session closed
    ABORTED = "aborted"    # freed by abort()
    CAPPED = "capped"      # freed: decode needed more KV than the pool or block table holds

    @property
    def is_done(self) -> bool:
        return self in (SequenceStatus.FINISHED, SequenceStatus.ABORTED, SequenceStatus.CAPPED)

    @property
    def is_running(self) -> bool:
        return self in (SequenceStatus.PREFILL, SequenceStatus.DECODE)


class Sequence:
    """State of one request / session (the engine may attach per-token timestamps)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any = None,
                 *, session_id: str | None = None, arrival_time: float = 0.0):
        self.request_id = request_id
        self.session_id = session_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.slot = -1                    # -1: holds no slot (and no pages)
        # An idle session's KV moved to host memory (`scheduler.host_pool.SwappedKV`): no slot,
        # but `num_computed_tokens` stays, and its next admission copies the pages back.
        self.host_kv = None
        self.num_computed_tokens = 0
        self.turn_start = 0
        self.turns: list[tuple[int, int]] = []
        self.segments: list[tuple[int, int, bool]] = []
        self._turn_recorded = False       # the newest turn's span is in `turns`
        self._cache_end = 0               # most tokens the cache ever held (for a replayed turn)
        self.prompt_start = 0
        self.num_prompt_tokens = len(self.token_ids)
        self.num_skips = 0                # admissions that overtook it while it did not fit
        self.admission_order = -1         # larger = admitted more recently (preempted first)
        self.long_prefill = False         # admitted with more than the long-prefill threshold
        self.idle_since = 0.0             # clock time its last turn ended (eviction ranking)
        self.num_preemptions = 0
        # The scheduler's memo of the pages admission needs: ((slot, uncomputed tokens), pages).
        self.reservation_need: tuple[tuple[int, int], int] | None = None
        self.token_timestamps: list[float] = []   # filled by the engine if it wants them
        # A family of parallel samples (module docstring): the completions this one prefills
        # for, and (for such a completion until its fork) the sequence prefilling for it.
        self.fork_children: list[Sequence] = []
        self.fork_parent: Sequence | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_cached(self) -> bool:
        return self.slot >= 0

    @property
    def is_swapped(self) -> bool:
        """Whether its KV waits in host memory (see `host_kv`)."""
        return self.host_kv is not None

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated in this turn."""
        return self.token_ids[self.prompt_start + self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.prompt_start - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def start_turn(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                   arrival_time: float) -> None:
        """Append the next turn's prompt (the cache keeps everything computed so far)."""
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.prompt_start = self.num_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids.extend(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_skips = 0
        self._turn_recorded = False

    def plan_prefill(self) -> list[tuple[int, int, bool]]:
        """At admission: record the new turn's span (if not yet) and set `segments`, the plan
        of the uncomputed tokens ``(start, end, compressed)``; returns it.

        A new turn starts where the cache ends (``num_computed_tokens``; after an eviction,
        where it ended before). With the cache in place the plan is that turn; without it
        (eviction, preemption) it replays the whole history: recorded turns compressed, the
        generated tokens between and after them kept whole."""
        start = self.num_computed_tokens
        if not self._turn_recorded:
            self.turns.append((start if start or not self.turns else self._cache_end,
                               self.num_tokens))
            self._turn_recorded = True
        self.segments = [(start, self.num_tokens, True)] if start else self.replay_plan()
        return self.segments

    def replay_plan(self) -> list[tuple[int, int, bool]]:
        """The whole history as first written, ``(start, end, compressed)`` segments: recorded
        turns compressed, the tokens between and after them (decode wrote them) kept whole."""
        plan, pos = [], 0
        for a, b in self.turns:
            if pos < a:
                plan.append((pos, a, False))
            plan.append((a, b, True))
            pos = b
        if pos < self.num_tokens:
            plan.append((pos, self.num_tokens, False))
        return plan

    def segment_at(self, index: int) -> tuple[int, int, bool]:
        """The planned segment holding token `index` (an uncomputed one)."""
        for seg in self.segments:
            if seg[0] <= index < seg[1]:
                return seg
        raise ValueError(f"token {index} is in no planned segment of {self.request_id!r}")

    def fork(self, parent: "Sequence", first_token: int) -> None:
        """Become a copy of `parent` (whose prompt prefill just ended) that sampled
        `first_token`: the same history, turns and computed prefix (the pages are the shared
        ones the KV-cache manager's `fork` gave this sequence's slot), its own first token."""
        self.token_ids = parent.token_ids[:parent.num_computed_tokens] + [first_token]
        self.num_computed_tokens = parent.num_computed_tokens
        self.turn_start = parent.turn_start
        self.turns = list(parent.turns)
        self.segments = list(parent.segments)
        self._turn_recorded = True
        self._cache_end = parent._cache_end
        self.prompt_start = parent.prompt_start
        self.num_prompt_tokens = parent.num_prompt_tokens
        self.long_prefill = parent.long_prefill
        self.admission_order = parent.admission_order
        self.fork_parent = None

    def drop_cache(self) -> None:
        """Forget the cache (after eviction or preemption; a host copy too): everything is
        re-prefilled."""
        self._cache_end = max(self._cache_end, self.num_computed_tokens)
        self.slot = -1
        self.host_kv = None
        self.num_computed_tokens = 0
        self.turn_start = 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, session={self.session_id!r}, "
                f"status={self.status.value}, slot={self.slot}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
