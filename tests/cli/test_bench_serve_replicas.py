"""`bench serve --data-parallel-size N`: sessions over N engine replicas stepping at once
(`benchmarking.replicas.ReplicaAdapter`)."""

from __future__ import annotations

import threading
import time

import pytest

from tangram_jax.benchmarking import session_loop
from tangram_jax.benchmarking.replicas import ReplicaAdapter


class SlowReplica(session_loop.Adapter):
    """A stand-in engine: each request answers `tokens` tokens, one a step, a step taking
    `step_s` seconds of sleep (Python's lock released, as JAX releases it on a device)."""

    def __init__(self, step_s: float, tokens: int = 3, fail_on: str | None = None):
        self.step_s, self.tokens, self.fail_on = step_s, tokens, fail_on
        self.live: dict[str, list[int]] = {}
        self.sessions: list[str] = []
        self.ended: list[str] = []
        self.threads: set[str] = set()

    def submit(self, request_id, session_id, turn, history, new):
        self.live[request_id] = []
        self.sessions.append(session_id)

    def step(self):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.step_s)
        out = []
        for rid, toks in list(self.live.items()):
            if rid == self.fail_on:
                raise RuntimeError(f"replica failed on {rid}")
            toks.append(len(toks))
            done = len(toks) == self.tokens
            out.append((rid, list(toks), done, 0))
            if done:
                del self.live[rid]
        return out

    def has_work(self):
        return bool(self.live)

    def end_session(self, session_id):
        self.ended.append(session_id)


def sessions(n: int, turns: int = 2) -> list[dict]:
    return [{"session_id": f"s{i}", "arrival": 0.0, "turns": [[1, 2, 3 + i]] * turns}
            for i in range(n)]


def test_replicas_step_at_once_and_keep_each_session_on_one_replica():
    replicas = [SlowReplica(0.05), SlowReplica(0.05)]
    with ReplicaAdapter(replicas) as adapter:
        records, elapsed = session_loop.drive(sessions(4), adapter)
        per_replica = adapter.sessions_per_replica()
    assert len(records) == 8 and all(r.finished is not None and r.output_tokens == 3
                                     for r in records)
    assert per_replica == [2, 2]
    # Each session's turns all went to one replica, which ended it.
    for replica in replicas:
        assert set(replica.sessions) == set(replica.ended) and len(replica.sessions) == 4
    assert not set(replicas[0].sessions) & set(replicas[1].sessions)
    # Each replica stepped in its own thread, the two at once: 2 turns x 3 steps of 50 ms a
    # replica is ~0.3 s; one after the other would be ~0.6 s.
    assert replicas[0].threads.isdisjoint(replicas[1].threads)
    assert elapsed < 0.5, elapsed


def test_a_failing_replica_raises_in_the_loop():
    replicas = [SlowReplica(0.01), SlowReplica(0.01, fail_on="s1-t0")]
    with ReplicaAdapter(replicas) as adapter:
        with pytest.raises(RuntimeError, match="replica failed on s1-t0"):
            session_loop.drive(sessions(2), adapter)


def test_serve_workloads_spreads_sessions_over_replicas_and_sums_their_figures(tiny_folder):
    """`serve.serve_workloads` over two engines (what `bench serve --data-parallel-size 2`
    builds, one a device; here both on the one CPU device): every turn served, sessions split
    between the replicas, each replica's share in the row and the row's counts their sums."""
    from tangram_jax.benchmarking import serve
    from tangram_jax.benchmarking.workload import SessionSpec
    from tangram_jax.engine.llm_engine import Engine
    from tiny_engine import tiny_engine_config
    engines = [Engine(tiny_engine_config(tiny_folder, "full", max_model_len=256))
               for _ in range(2)]
    spec = SessionSpec(num_sessions=4, context_tokens=40, followups=1, question_tokens=8,
                       answer_tokens=4)
    (row,) = serve.serve_workloads(engines, [("short", spec)], engines[0].layout.chunk_size)
    assert row["turns"] == 8 and row["output_tokens"] == 32
    replicas = row["replicas"]
    assert [r["sessions"] for r in replicas] == [2, 2]
    assert all(r["prefill_tokens"] > 0 and r["decode_rows"] > 0 for r in replicas)
    assert row["prefill_tokens"] == sum(r["prefill_tokens"] for r in replicas)
    assert row["steps"] == sum(r["steps"] for r in replicas)
    # The step loop's wall split: dispatch, the wait on tokens, its own work, the driver's.
    shares = row["step_loop_shares"]
    assert set(shares) == {"dispatch", "token_wait", "host", "outside_step"}
    assert all(0 < v < 1 for k, v in shares.items() if k != "outside_step")
    assert 0 <= shares["outside_step"] < 1 and sum(shares.values()) == pytest.approx(1, abs=0.05)
    assert all(0 < e.dispatch_seconds + e.token_wait_seconds < e.step_seconds for e in engines)


def test_device_memory_lists_every_replica_s_devices_and_nothing_on_the_cpu():
    """Each row's `device_memory`: the allocator figures of every device of every replica
    (tensor-parallel shards one entry each), so unequal shards show; none where devices report
    no statistics (the CPU)."""
    from types import SimpleNamespace

    import jax

    from tangram_jax.benchmarking.serve import device_memory

    class Card:
        def __init__(self, name, used):
            self.name, self.used = name, used

        def __str__(self):
            return self.name

        def memory_stats(self):
            return {"bytes_in_use": self.used, "peak_bytes_in_use": 2 * self.used,
                    "bytes_limit": 100, "num_allocs": 7}

    engine = lambda *devices: SimpleNamespace(runner=SimpleNamespace(
        placement=SimpleNamespace(devices=list(devices))))
    rows = device_memory([engine(Card("gpu0", 10), Card("gpu1", 11)), engine(Card("gpu2", 9))])
    assert [(r["replica"], r["device"], r["bytes_in_use"], r["peak_bytes_in_use"])
            for r in rows] == [(0, "gpu0", 10, 20), (0, "gpu1", 11, 22), (1, "gpu2", 9, 18)]
    assert all(set(r) == {"replica", "device", "bytes_in_use", "peak_bytes_in_use",
                          "bytes_limit"} for r in rows)
    assert device_memory([engine(*jax.devices("cpu")[:1])]) is None
