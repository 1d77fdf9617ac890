"""benchmarks/families_gpu.py --sampler: the engine's decode step for greedy rows (each row's
argmax: no conditional in either program) against the general sampler a batch with a sampled
or penalised row runs (its two conditionals, each a predicate the host reads back before it
launches the rest of the step); the programs it times really differ so, and say so in the
result."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, sampler: str) -> dict:
    out = tmp_path / f"{sampler}.json"
    argv = sys.argv
    sys.argv = ["families_gpu.py", "--shape", "gemma3-tiny", "--context", "128", "--batches", "2",
                "--reps", "1", "--no-prefill", "--sampler", sampler, "--out", str(out)]
    try:
        runpy.run_path(str(ROOT / "benchmarks" / "families_gpu.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return json.loads(out.read_text())


def test_greedy_rows_take_a_sampler_without_the_general_one_s_two_conditionals(tmp_path,
                                                                               monkeypatch):
    from tangram_jax.engine import decode_step
    monkeypatch.setattr(decode_step, "_sampling_rows", decode_step._sampling_rows)  # restored
    engine, general = _run(tmp_path, "engine"), _run(tmp_path, "general")
    assert (engine["sampler"], general["sampler"]) == ("engine", "general")
    # gemma3-tiny's local / global layers add conditionals of their own (a switch per layer).
    assert engine["decode"][0]["step_conditionals"] == \
        general["decode"][0]["step_conditionals"] - 2
