"""Sessions served by several engine replicas at once (data parallelism in `bench serve`).

`ReplicaAdapter` is a `session_loop.Adapter` over one adapter per replica (each an engine on its
own devices, `llm.build_replicas`). A session stays on the replica its first turn went to: the
one with the fewest tokens sent so far, as `LLM` places a batch. Each replica steps in its own
thread (JAX releases Python's lock while a step runs, so the devices work at once) and hands
its outputs to the driving loop over a queue; the loop's `step()` collects what arrived. A
replica's lock is held while it steps and while the loop submits to it, so its scheduler is
only ever used by one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from tangram_jax.benchmarking import session_loop

# How long `step()` waits for outputs before handing control back to the loop (which may have
# turns to send).
POLL_SECONDS = 0.005


class ReplicaAdapter(session_loop.Adapter):
    """`replicas`: one adapter per engine replica; `after_step`: per replica, called in its
    thread after each of its steps (pool sampling), or None. Use as a context manager (the
    threads stop on exit)."""

    def __init__(self, replicas: Sequence[session_loop.Adapter],
                 after_step: Sequence[Callable[[], None] | None] | None = None):
        if not replicas:
            raise ValueError("ReplicaAdapter needs at least one replica")
        self.replicas = list(replicas)
        self.locks = [threading.Lock() for _ in self.replicas]
        self.wake = [threading.Event() for _ in self.replicas]
        self.home: dict[str, int] = {}         # session id -> replica
        self.tokens_sent = [0] * len(self.replicas)
        self.news: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        after_step = list(after_step or [None] * len(self.replicas))
        self.threads = [threading.Thread(target=self._serve, args=(i, after_step[i]),
                                         name=f"replica-{i}", daemon=True)
                        for i in range(len(self.replicas))]
        for t in self.threads:
            t.start()

    def _serve(self, i: int, after_step) -> None:
        replica, lock, wake = self.replicas[i], self.locks[i], self.wake[i]
        while not self.stop.is_set():
            with lock:
                busy = replica.has_work()
                if busy:
                    try:
                        out = replica.step()
                        if after_step is not None:
                            after_step()
                    except BaseException as e:    # raised to the loop by `step()`
                        self.errors.append(e)
                        self.news.put(None)
                        return
                    # Under the lock: once the loop sees this replica idle, its news are queued.
                    if out:
                        self.news.put(out)
            if not busy:
                wake.wait(POLL_SECONDS)
                wake.clear()

    def submit(self, request_id, session_id, turn, history, new):
        i = self.home.get(session_id)
        if i is None:
            i = self.home[session_id] = min(range(len(self.replicas)),
                                            key=self.tokens_sent.__getitem__)
        self.tokens_sent[i] += len(new)
        with self.locks[i]:
            self.replicas[i].submit(request_id, session_id, turn, history, new)
        self.wake[i].set()

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
        for replica, lock in zip(self.replicas, self.locks):
            with lock:
                if replica.has_work():
                    return True
        # Every replica idle: what they produced is already queued (they queue under the lock).
        return not self.news.empty() or bool(self.errors)

    def end_session(self, session_id) -> None:
        i = self.home.get(session_id)
        if i is not None:
            with self.locks[i]:
                self.replicas[i].end_session(session_id)

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
