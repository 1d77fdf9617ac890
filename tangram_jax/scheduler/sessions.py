"""`SessionTable`: the one owner of multi-turn sessions.

A session is one `Sequence` kept across turns (its slot and compressed pages stay in the pool
between turns). The table maps session ids to their sequences, knows which idle sessions still
hold a cache (the eviction candidates, with the pages they hold), ranks them for eviction, and
finds the idle session whose history a conversation extends (prefix lookup). The scheduler
owns one table and keeps it in step with the sequences' states; the engine, `LLM`, the chat
command and the server ask it (through `Engine`) instead of keeping maps of their own.

Eviction ranking. Evicting an idle session frees the pages it holds now and costs a re-prefill
of its whole history if its next turn comes (the replay of `Sequence.replay_plan`). The table
evicts first the session with the most pages freed per token of expected recompute:

    score = pages_held * (idle_seconds + IDLE_PRIOR_SECONDS) / history_tokens

``(idle + prior)`` stands for how unlikely the next turn is soon: with heavy-tailed think times
(a user reading, or a client that went away) the chance that a session idle for t seconds gets
its next turn within a fixed horizon falls like ``1 / (t + prior)``, so the expected recompute of
evicting it is ``history_tokens / (t + prior)`` (up to a constant). Prefill cost is taken as
linear in the history's tokens (chunked prefill: each chunk's cost is dominated by its weights'
GEMMs at these sizes). Least recently idle breaks ties.

With a host tier (`scheduler.host_pool`) an eviction may swap the session to host memory
instead, when copying it back is cheaper; the scheduler then gives the table an `eviction_cost`
that is the cheaper of the two, in recompute tokens (the swap's seconds at the measured prefill
rate), so a session that is cheap to swap back ranks as cheap to evict:

    score = pages_held * (idle_seconds + IDLE_PRIOR_SECONDS) / eviction_cost

Anonymous sessions: clients that resend the whole conversation each turn (`LLM.chat`, the chat
command's resets, the OpenAI server) find their session by prefix and open new ones under ids
minted by `new_id`. When such a session's cache is evicted while it is idle the table forgets
it: the next request resends everything and finds no cached prefix, so the token history would
only cost host memory (a long-running server would otherwise keep every conversation ever
seen). Sessions under ids a caller chose stay continuable after an eviction (their next turn
replays the history with its original chunking, so greedy output does not depend on load).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence as SequenceABC

from tangram_jax.scheduler.sequence import Sequence, SequenceStatus

# Prior of the idle time, seconds (see the module docstring): sessions idle for much less than
# this rank by pages freed per recompute token alone; idle time decides beyond it.
IDLE_PRIOR_SECONDS = 1.0


class SessionTable:
    """Sessions by id; the idle ones holding a cache, ranked for eviction; prefix lookup.

    Args:
      pages_held: slot -> pages it holds (the KV-cache manager's count).
      clock: seconds, monotonic (tests pass a fake one).
      eviction_cost: sequence -> the expected cost of evicting it, in recompute tokens
        (default: its history's tokens; see the module docstring).
    """

    def __init__(self, pages_held: Callable[[int], int], *,
                 clock: Callable[[], float] = time.monotonic,
                 idle_prior_seconds: float = IDLE_PRIOR_SECONDS,
                 eviction_cost: Callable[[Sequence], float] | None = None):
        if not idle_prior_seconds > 0:
            raise ValueError(f"idle_prior_seconds must be > 0, got {idle_prior_seconds!r}")
        self._pages_held = pages_held
        self.eviction_cost = eviction_cost or (lambda seq: seq.num_tokens)
        self.clock = clock
        self.idle_prior_seconds = float(idle_prior_seconds)
        self._by_id: dict[str, Sequence] = {}
        # Sessions holding a cache while not running (idle, or queued for their next turn), in
        # the order they became idle; `_idle_pages` is the pages they hold.
        self._cached_idle: dict[str, Sequence] = {}
        self._idle_pages = 0
        self._anonymous: set[str] = set()
        self._next_id = 0

    # ----- the map ------------------------------------------------------------------------
    def get(self, session_id: str | None) -> Sequence | None:
        """The session's sequence (None: no such session)."""
        return self._by_id.get(session_id) if session_id is not None else None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_id))

    def sequences(self) -> list[Sequence]:
        return list(self._by_id.values())

    def add(self, seq: Sequence) -> None:
        """Register a new session's sequence (its first turn)."""
        sid = seq.session_id
        if sid is None:
            raise ValueError(f"{seq!r} has no session id")
        if sid in self._by_id:
            raise ValueError(f"session {sid!r} exists already")
        self._by_id[sid] = seq

    def remove(self, session_id: str) -> None:
        """Forget a session (closed, aborted, capped); its cache must be gone or going."""
        seq = self._by_id.pop(session_id, None)
        if seq is not None:
            self.unlist(seq)
        self._anonymous.discard(session_id)

    # ----- questions the engine and its clients ask -----------------------------------------
    def is_cached(self, session_id: str) -> bool:
        """Whether an idle session still holds its compressed history in the pool."""
        seq = self.get(session_id)
        return seq is not None and seq.status is SequenceStatus.IDLE and seq.is_cached

    def is_busy(self, session_id: str) -> bool:
        """Whether a session's turn is queued or running."""
        seq = self.get(session_id)
        return seq is not None and (seq.status.is_running or seq.status is SequenceStatus.WAITING)

    def find_prefix(self, token_ids: SequenceABC[int]) -> tuple[str | None, int]:
        """The idle session whose history is the longest proper prefix of `token_ids`, and that
        history's length (None, 0 when no session matches)."""
        tokens = list(token_ids)
        best, best_len = None, 0
        for sid, seq in self._by_id.items():
            n = seq.num_tokens
            if (seq.status is SequenceStatus.IDLE and best_len < n < len(tokens)
                    and tokens[:n] == seq.token_ids):
                best, best_len = sid, n
        return best, best_len

    def new_id(self, prefix: str = "session-", exclude: SequenceABC[str] = ()) -> str:
        """A fresh id for an anonymous session (one found by prefix later; see the module
        docstring), not in use and not in `exclude`."""
        while True:
            sid = f"{prefix}{self._next_id}"
            self._next_id += 1
            if sid not in self._by_id and sid not in exclude:
                self._anonymous.add(sid)
                return sid

    def is_anonymous(self, session_id: str) -> bool:
        return session_id in self._anonymous

    # ----- eviction candidates --------------------------------------------------------------
    def mark_idle(self, seq: Sequence) -> None:
        """The session's turn ended: it is idle now, and an eviction candidate if it holds a
        cache."""
        seq.status = SequenceStatus.IDLE
        seq.idle_since = self.clock()
        if seq.is_cached:
            self._cached_idle[seq.session_id] = seq
            self._idle_pages += self._pages_held(seq.slot)

    def unlist(self, seq: Sequence) -> None:
        """No longer an eviction candidate (it runs, or its cache is going away); call before
        its page count changes."""
        sid = seq.session_id
        if sid is not None and self._cached_idle.get(sid) is seq:
            del self._cached_idle[sid]
            self._idle_pages -= self._pages_held(seq.slot)

    def is_listed(self, seq: Sequence) -> bool:
        return seq.session_id is not None and self._cached_idle.get(seq.session_id) is seq

    @property
    def num_evictable(self) -> int:
        return len(self._cached_idle)

    @property
    def evictable_pages(self) -> int:
        """Pages the eviction candidates hold together."""
        return self._idle_pages

    def eviction_score(self, seq: Sequence, now: float | None = None) -> float:
        """Pages freed per expected recompute token (higher: evict sooner)."""
        now = self.clock() if now is None else now
        idle = max(0.0, now - seq.idle_since)
        return (self._pages_held(seq.slot) * (idle + self.idle_prior_seconds)
                / max(1.0, self.eviction_cost(seq)))

    def eviction_order(self) -> list[Sequence]:
        """The eviction candidates, the one to evict first first. Sessions whose next turn is
        queued already (its cache still in place) come after every idle one: their next turn
        is certain and imminent."""
        now = self.clock()
        listed = list(self._cached_idle.values())   # idle order: ties go to the oldest
        ranked = sorted(range(len(listed)),
                        key=lambda i: (listed[i].status is not SequenceStatus.IDLE,
                                       -self.eviction_score(listed[i], now), i))
        return [listed[i] for i in ranked]
