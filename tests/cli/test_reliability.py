"""The CLI under careless or hostile use: every user error exits 2 with one line, output paths
are checked before the work, outputs are written atomically, Ctrl-C exits 130 without a
traceback, invalid UTF-8 on chat's stdin is refused and the chat goes on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tangram_jax.cli import main
from tangram_jax.commands import atomic_path, check_output_path, UsageError

ROOT = Path(__file__).resolve().parents[2]


TINY_ENGINE_FLAGS = ["--mode", "full", "--max-model-len", "256", "--chunk-size", "16",
                     "--kv-cache-tokens", "1024", "--max-num-seqs", "2"]


def _one_line_error(err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "error" in lines[0] and needle in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["run", "--turns", "0"], "--turns"),
    (["run", "--conversations", "0"], "--conversations"),
    (["run", "--max-tokens", "-1"], "--max-tokens"),
    (["run", "--max-num-seqs", "many"], "--max-num-seqs"),
    (["run", "--mode", "fast"], "--mode"),
    (["run", "--json", "/nonexistent-folder/report.json"], "does not exist"),
    (["run", "--max-model-len", "0"], "max_model_len"),
    (["run", "--decode-buckets", "0,4"], "decode_buckets"),
    (["run", "--ratio", "1.5"], "ratio"),
    (["run", "--mode", "full", "--profile", "p.json"], "only used in tangram mode"),
    (["chat", "--max-tokens", "0"], "--max-tokens"),
    (["chat", "--top-p", "2"], "top_p"),
    (["calibrate", "--out", "x.json", "--from-run", "/nonexistent.npz"], "no such file"),
    (["calibrate", "--out", "/nonexistent-folder/p.json"], "does not exist"),
    (["calibrate", "--out", "p_{rho:.2f}_{x}.json", "--ratio", "0.25,0.5"], "placeholders"),
    (["generate", "--top-k", "-7", "hi"], "top_k"),
    (["generate", "a\udcffb"], "lone surrogate"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "80.5"], "--port"),
    # A committed result (or any file git tracks) is replaced only with --overwrite.
    (["run", "--json", str(ROOT / "README.md")], "git tracks"),
    (["calibrate", "--out", str(ROOT / "tangram_jax/compression/profiles/"
                                "smollm2-135m_snapkv_rho0.50_g1.json")], "git tracks"),
    (["bench", "accuracy", "--", "--out", str(ROOT / "benchmarks/results/accuracy.json")],
     "git tracks"),
    (["bench", "accuracy", "--", "--out", "/tmp/a.json", "--tasks-out",
      str(ROOT / "benchmarks/results/accuracy_tasks.jsonl")], "git tracks"),
    (["bench", "serve", "--", "--json", str(ROOT / "benchmarks/results/serve_cpu.json")],
     "git tracks"),
    (["bench", "serve", "--", "--resume"], "--resume needs --json"),
    (["nosuchcommand"], "invalid choice"),
    (["bench", "nosuchbench"], "invalid choice"),
])
def test_user_errors_exit_2_with_one_line(argv, needle, capsys):
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as e:   # argparse's own errors
        code = e.code
    assert code == 2
    _one_line_error(capsys.readouterr().err, needle)
    assert time.perf_counter() - start < 30   # refused before any model is loaded


def test_calibrate_from_a_corrupt_run_exits_2(tmp_path, capsys):
    corrupt = tmp_path / "run.npz"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    plain = tmp_path / "plain.npz"
    np.save(tmp_path / "plain.npy", np.zeros(3))
    os.replace(tmp_path / "plain.npy", plain)
    for path in (corrupt, plain):
        assert main(["calibrate", "--out", str(tmp_path / "p.json"), "--from-run",
                     str(path)]) == 2
        _one_line_error(capsys.readouterr().err, "not a calibration run")
    assert not (tmp_path / "p.json").exists()


def test_output_paths_and_atomic_writes(tmp_path):
    with pytest.raises(UsageError, match="is a folder"):
        check_output_path("--json", tmp_path)
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise KeyboardInterrupt
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["report.json"]
    with atomic_path(target) as tmp:
        assert tmp.suffix == ".json" and tmp.parent == tmp_path
        tmp.write_text("new")
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["report.json"]


def test_chat_refuses_invalid_utf8_lines_and_goes_on(tiny_folder, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff\nhello\n/exit\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "--model", str(tiny_folder), *TINY_ENGINE_FLAGS, "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "not valid UTF-8" in err and "Traceback" not in err
    assert out.count("assistant>") == 1


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_ctrl_c_exits_130_without_a_traceback(tiny_folder, command):
    """SIGINT while the command works (loading, compiling or generating): status 130 promptly,
    one line, no traceback, no crash."""
    if command == "chat":
        argv, ready = ["chat", *TINY_ENGINE_FLAGS, "--max-tokens", "200"], b"assistant>"
    else:
        argv, ready = ["generate", "tell me a long story", "--max-tokens", "400",
                       "--ignore-eos"], b"loading model"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tangram_jax.cli", *argv, "--model", str(tiny_folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    proc.stdin.write(b"tell me a long story\n")
    proc.stdin.flush()
    # Wait until the command is at work, then interrupt it.
    stream = proc.stdout if command == "chat" else proc.stderr
    deadline = time.monotonic() + 120
    seen = b""
    while ready not in seen and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), 64)
        if not chunk:
            break
        seen += chunk
    assert ready in seen, seen
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("did not exit promptly after SIGINT") from None
    err = seen + err if command == "generate" else err
    assert proc.returncode == 130, err.decode(errors="replace")
    assert b"Traceback" not in err and b"interrupted" in err


def test_a_ctrl_c_dropped_in_a_callback_prints_no_traceback():
    """A Ctrl-C that lands in a callback Python cannot raise from (JAX's gc callback, seen in
    CI) is dropped there with an "Exception ignored" traceback; the CLI's unraisable hook says
    nothing of it (the grace timer then ends the process with 130) and passes every other
    exception to the previous hook."""
    import types

    from tangram_jax.cli import _quiet_unraisable
    seen = []
    hook = _quiet_unraisable(seen.append)
    hook(types.SimpleNamespace(exc_value=KeyboardInterrupt()))
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    hook(other)
    assert seen == [other]
