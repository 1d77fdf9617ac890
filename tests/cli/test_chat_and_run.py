"""The engine's CLI commands on the embedded model: `chat` (multi-turn, stdin) and `run`."""

from __future__ import annotations

import io
import json

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
    assert "KV held" in out and "full KV" in out


def test_run_reports_throughput_and_memory(tmp_path, capsys):
    report = tmp_path / "run.json"
    assert main(["run", "--conversations", "2", "--turns", "2", "--max-tokens", "6",
                 "--max-user-chars", "300", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "KV memory held" in out and "[assistant]" in out
    data = json.loads(report.read_text())
    assert data["generated_tokens"] > 0
    assert 0 < data["kv_memory_vs_full"] < 1   # compressed sessions hold less than full KV


def test_run_refuses_a_bad_ratio(capsys):
    assert main(["run", "--ratio", "1.5"]) == 2
    assert "ratio" in capsys.readouterr().err
