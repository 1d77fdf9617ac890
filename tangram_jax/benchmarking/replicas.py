"""Sessions served by several engine replicas at once (data parallelism in `bench serve`).

`ReplicaAdapter` is a `session_loop.Adapter` over one adapter per replica (each an engine on its
own devices, `llm.build_replicas`). A session stays on the replica its first turn went to: the
one with the fewest tokens sent so far, as `LLM` places a batch. Each replica runs in its own
thread (JAX releases Python's lock while a step runs, so the devices work at once): it takes
the turns and session ends the loop left in its inbox, steps, and hands its outputs to the loop
over a queue; only that thread touches its engine, and the loop never waits for a replica's
step to end.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from tangram_jax.benchmarking import session_loop

# How long `step()` waits for outputs before handing control back to the loop (which may have
# turns to send), and an idle replica for its inbox.
POLL_SECONDS = 0.005


class ReplicaAdapter(session_loop.Adapter):
    """`replicas`: one adapter per engine replica; `after_step`: per replica, called in its
    thread after each of its steps (pool sampling), or None. Use as a context manager (or
    `contextlib.closing`: the threads stop on `close`)."""

    def __init__(self, replicas: Sequence[session_loop.Adapter],
                 after_step: Sequence[Callable[[], None] | None] | None = None):
        if not replicas:
            raise ValueError("ReplicaAdapter needs at least one replica")
        self.replicas = list(replicas)
        n = len(self.replicas)
        self.inbox: list[list] = [[] for _ in range(n)]
        self.wake = [threading.Event() for _ in range(n)]
        # Set by the loop when it sends, by the replica after each round: work in hand or in
        # the inbox. Both under `state` (held for a few list operations, never for a step);
        # the replica queues its outputs before it can clear its flag.
        self.active = [False] * n
        self.state = threading.Lock()
        self.home: dict[str, int] = {}         # session id -> replica
        self.tokens_sent = [0] * n
        self.news: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        after_step = list(after_step or [None] * n)
        self.threads = [threading.Thread(target=self._serve, args=(i, after_step[i]),
                                         name=f"replica-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _take_inbox(self, i: int) -> None:
        with self.state:
            messages, self.inbox[i] = self.inbox[i], []
        for kind, args in messages:
            getattr(self.replicas[i], kind)(*args)

    def _serve(self, i: int, after_step) -> None:
        replica, wake = self.replicas[i], self.wake[i]
        try:
            while not self.stop.is_set():
                self._take_inbox(i)
                if replica.has_work():
                    out = replica.step()
                    if after_step is not None:
                        after_step()
                    if out:
                        self.news.put(out)
                with self.state:
                    self.active[i] = replica.has_work() or bool(self.inbox[i])
                    idle = not self.active[i]
                if idle:
                    wake.wait(POLL_SECONDS)
                    wake.clear()
            self._take_inbox(i)      # the last sessions' ends, sent as the run finished
        except BaseException as e:    # raised to the loop by `step()`
            self.errors.append(e)
            self.news.put(None)

    def _send(self, i: int, kind: str, *args) -> None:
        with self.state:
            self.inbox[i].append((kind, args))
            self.active[i] = True
        self.wake[i].set()

    def submit(self, request_id, session_id, turn, history, new):
        i = self.home.get(session_id)
        if i is None:
            i = self.home[session_id] = min(range(len(self.replicas)),
                                            key=self.tokens_sent.__getitem__)
        self.tokens_sent[i] += len(new)
        self._send(i, "submit", request_id, session_id, turn, history, new)

    def step(self):
        try:
            first = self.news.get(timeout=POLL_SECONDS)
        except queue.Empty:
            return []
        news = []
        while True:
            if first is None:
                raise self.errors[0]
            news += first
            try:
                first = self.news.get_nowait()
            except queue.Empty:
                return news

    def has_work(self) -> bool:
        with self.state:
            active = any(self.active)
        return active or not self.news.empty() or bool(self.errors)

    def end_session(self, session_id) -> None:
        i = self.home.get(session_id)
        if i is not None:
            self._send(i, "end_session", session_id)

    def sessions_per_replica(self) -> list[int]:
        counts = [0] * len(self.replicas)
        for i in self.home.values():
            counts[i] += 1
        return counts

    def close(self) -> None:
        self.stop.set()
        for wake in self.wake:
            wake.set()
        for t in self.threads:
            t.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
