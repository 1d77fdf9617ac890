"""The engine's CLI commands on the embedded model: `chat` (multi-turn, stdin) and `run`."""

from __future__ import annotations

import io
import json
import re

import pytest

from tangram_jax.cli import main

pytestmark = pytest.mark.slow


def test_chat_keeps_the_conversation_between_turns(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(
        "What is the capital of France?\nAnd of Italy?\n/stats\n/exit\n"))
    assert main(["chat", "--temperature", "0", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    answers = [line for line in out.splitlines() if "assistant>" in line]
    assert len(answers) == 2
    assert "Paris" in answers[0]
    # /stats: the saving in words, or why there is none (short turns sit in protected tails).
    stats = next(line for line in out.splitlines() if "KV held" in line)
    assert "less than full KV's" in stats or "nothing was compressed" in stats or \
        "too few to free a page" in stats, stats
    assert "sampling: temperature 0, top_p 1, top_k off" in out   # --temperature 0 over vLLM's


def test_run_reports_throughput_and_memory(tmp_path, capsys):
    report = tmp_path / "run.json"
    assert main(["run", "--conversations", "2", "--turns", "2", "--max-tokens", "6",
                 "--max-user-chars", "300", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "[assistant]" in out
    data = json.loads(report.read_text())
    assert data["generated_tokens"] > 0
    assert 0 < data["kv_memory_vs_full"] < 1   # compressed sessions hold less than full KV
    # The memory line says what was saved, against what, for which tokens.
    saved = 100 * data["kv_saved_vs_full"]
    assert re.search(rf"memory: the sessions' KV held [\d.]+ MiB, {saved:.1f}% less than full "
                     rf"KV's [\d.]+ MiB for the same [\d,]+ tokens \([\d,]+ compressible prompt "
                     rf"tokens", out), out
    # The workload's user turns are long enough that most tokens are compressible.
    tokens = data["token_breakdown"]
    assert tokens["compressible"] > tokens["protected"] + tokens["generated"], tokens


def test_run_refuses_a_bad_ratio(capsys):
    assert main(["run", "--ratio", "1.5"]) == 2
    assert "ratio" in capsys.readouterr().err
