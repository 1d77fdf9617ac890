"""benchmarks/families_gpu.py --sampler: the engine's decode step for greedy rows (each row's
argmax) against the general sampler a batch with a sampled or penalised row runs (every row's
penalties and the vocabulary sort); the programs it times really differ so, neither holds a
conditional (a predicate the host reads back before it launches the rest of the step), and the
result says which it timed."""

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


def test_greedy_rows_take_the_argmax_and_neither_sampler_holds_a_conditional(tmp_path,
                                                                              monkeypatch):
    from tangram_jax.engine import decode_step
    monkeypatch.setattr(decode_step, "_sampling_rows", decode_step._sampling_rows)  # restored
    engine, general = _run(tmp_path, "engine"), _run(tmp_path, "general")
    assert (engine["sampler"], general["sampler"]) == ("engine", "general")
    # gemma3-tiny's local / global layers add conditionals of their own (a switch per layer):
    # the samplers add none.
    assert engine["decode"][0]["step_conditionals"] == general["decode"][0]["step_conditionals"]
    assert engine["decode"][0]["sampler_sorts"] == 0 < general["decode"][0]["sampler_sorts"]
    # The host's share of a back-to-back call (its launch) is measured beside the GPU's.
    assert 0 < engine["decode"][0]["host_ms_median"] <= engine["decode"][0]["pipelined_ms"] * 2
