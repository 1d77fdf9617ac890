"""`bench serve --data-parallel-size N`: sessions over N engine replicas stepping at once
(`benchmarking.replicas.ReplicaAdapter`)."""

from __future__ import annotations

import threading
import time

import pytest

from tangram_jax.benchmarking import session_loop
from tangram_jax.benchmarking.replicas import ReplicaAdapter
from tiny_engine import report_of_child


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


CHILD = r"""
import json, sys
from tangram_jax.commands import bench_serve
out = sys.argv[1] + "/dp.json"
assert bench_serve.main(["--model", "random-tiny", "--variants", "full", "--context-tokens", "300",
                         "--sessions", "4", "--followups", "1", "--answer-tokens", "4",
                         "--kv-cache-tokens", "4096", "--data-parallel-size", "2",
                         "--max-num-seqs", "2", "--decode-buckets", "2", "--max-model-len", "384",
                         "--json", out]) == 0
print("REPORT " + json.dumps(json.load(open(out))))
"""


def test_bench_serve_runs_data_parallel_replicas_on_two_devices(tmp_path):
    report = report_of_child(CHILD, tmp_path, devices=2)
    (result,) = report["results"]
    assert result["data_parallel_size"] == 2
    (row,) = result["workloads"]
    assert row["turns"] == 8 and row["output_tokens"] == 32
    replicas = row["replicas"]
    assert [r["sessions"] for r in replicas] == [2, 2]
    assert len({r["device"] for r in replicas}) == 2
    assert all(r["prefill_tokens"] > 0 and r["decode_rows"] > 0 for r in replicas)
    assert row["prefill_tokens"] == sum(r["prefill_tokens"] for r in replicas)
