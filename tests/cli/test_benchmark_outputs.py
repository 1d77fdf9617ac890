"""Where benchmarks write, and what they say up front: a fresh file under
benchmarks/results/runs/ unless told where, never over a file git tracks (the committed results
the READMEs quote) without --overwrite, and an estimate of the run's time (issue 47, item 4)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from tangram_jax.benchmarking import results
from tangram_jax.commands import UsageError, is_git_tracked

ROOT = Path(__file__).resolve().parents[2]
TRACKED = ROOT / "benchmarks" / "results" / "end_to_end.json"
# Every benchmark script that writes a result, with the arguments it needs besides its output.
SCRIPTS = {
    "accuracy": [], "accuracy_batch_invariance": [], "control_plane": [], "decode_attention": [],
    "decode_step_gpu": [], "end_to_end": [], "followup_scoring_probe": [], "gpu_memory": [],
    "kv_precision_decode": [], "kv_tier_pools": [], "kvpress_accuracy": [], "pool_copy_probe": [],
    "prefill_8b": [], "retention_proxy": [], "serve_openai": [], "soak": [], "startup": [],
    "accuracy_merge": ["part.json"], "gpu_engine_check": ["--tokenizer-dir", "x"],
    "retention_rule": ["--configs", "full:1:window"], "families_gpu": ["--shape", "gemma3-tiny"],
    "output_fingerprint": [], "new_model_path": ["--tokenizer", "x"], "moe_grouped_gemm": [],
    "swap_check_gpu": [], "tp_outputs_gpu": [], "main_job_start": [],
}


def _run_script(name: str, argv: list[str]) -> tuple[int, str]:
    script = ROOT / "benchmarks" / f"{name}.py"
    err = io.StringIO()
    old_argv = sys.argv
    sys.argv = [str(script), *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old_argv
    return code, err.getvalue()


def test_every_result_writing_script_is_listed():
    """A new benchmark that writes a result joins SCRIPTS (and so the check below)."""
    writers = {p.stem for p in (ROOT / "benchmarks").glob("*.py")
               if '"--out"' in p.read_text(encoding="utf-8")}
    assert writers - {"kvpress_hf_folder"} == set(SCRIPTS)   # that one writes a model folder


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_no_benchmark_writes_over_a_committed_result_unless_told(name):
    assert is_git_tracked(TRACKED)
    before = TRACKED.read_bytes()
    code, err = _run_script(name, [*SCRIPTS[name], "--out", str(TRACKED)])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f"--out '{TRACKED}' is a file git tracks" in lines[0] and "--overwrite" in lines[0]
    assert TRACKED.read_bytes() == before


def test_fresh_paths_checked_paths_and_overwrite(tmp_path):
    a = results.output_path("--out", None, "bench_x", overwrite=False)
    b = results.output_path("--out", None, "bench_x", overwrite=False)
    assert a.parent == results.RUNS_DIR and a.name.startswith("bench_x-") and a != b
    assert a.suffix == ".json" and not a.exists()
    assert is_git_tracked(TRACKED) and not is_git_tracked(ROOT / "benchmarks" / "results" /
                                                          "runs" / "x.json")
    with pytest.raises(UsageError, match="git tracks"):
        results.output_path("--out", TRACKED, "x", overwrite=False)
    assert results.output_path("--out", TRACKED, "x", overwrite=True) == TRACKED
    untracked = tmp_path / "old.json"
    untracked.write_text("{}")   # an earlier run's own file may be replaced
    assert results.output_path("--out", untracked, "x", overwrite=False) == untracked
    with pytest.raises(UsageError, match="does not exist"):
        results.output_path("--out", tmp_path / "no" / "x.json", "x", overwrite=False)


def test_start_says_where_and_how_long_and_finish_records_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RUNS_DIR", tmp_path)
    monkeypatch.setattr(results, "DURATIONS", tmp_path / "durations.jsonl")
    run = results.start("bench_y", [tmp_path / "y.json"], ["--n", "3"])
    assert "no estimate yet" in capsys.readouterr().out
    seconds = results.finish(run)
    record = json.loads((tmp_path / "durations.jsonl").read_text())
    assert record["benchmark"] == "bench_y" and record["argv"] == ["--n", "3"]
    assert record["seconds"] == round(seconds, 1) and record["machine"] == results.machine_kind()
    results.start("bench_y", [tmp_path / "y.json"], ["--n", "3"])
    out = capsys.readouterr().out
    assert f"bench_y: writing {tmp_path / 'y.json'}; about 1 s (the last run of these " \
           f"arguments on this machine kind took that" in out
    results.start("bench_y", ["z"], ["--n", "4"], estimate=(1500, "a model"))
    assert capsys.readouterr().out == "bench_y: writing z; about 25 min (a model)\n"


def test_accuracy_estimates_up_front_and_after_full_kv(monkeypatch):
    from tangram_jax.evaluation import harness, tasks
    from tangram_jax.evaluation.harness import HarnessConfig, mode_specs

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        accuracy = runpy.run_path(str(ROOT / "benchmarks" / "accuracy.py"))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(results, "machine_kind", lambda: "cpu x2")   # the CPU cost model
    samples = tasks.generate_all(("passkey", "variable_tracking"), 2, 0, tasks.TaskSizes())
    specs = mode_specs(["full", "tangram", "dynamic"], [0.5])
    seconds, basis = accuracy["_estimate"](samples, specs, HarnessConfig(max_tokens=16))
    tokens = int(basis.split(" sessions of ")[1].split(" tokens")[0].replace(",", ""))
    assert basis.startswith("4 sessions of ") and "x 3 configurations + the KL passes" in basis
    assert seconds == pytest.approx(harness.estimate_seconds(tokens, 3, kl=True))
    assert seconds == pytest.approx(3 * (tokens * harness.CPU_SERVE_SECONDS_PER_TOKEN
                                         + harness.CPU_BUILD_SECONDS)
                                    + 2 * tokens * harness.CPU_FORCED_SECONDS_PER_TOKEN)
    # After full KV: its measured time scales the rest.
    assert harness.remaining_after_full(100.0, 10.0, 2, kl=False) == pytest.approx(
        2 * (10 + 100 * harness.OTHER_SERVE_OVER_FULL))
