"""benchmarks/families_gpu.py --sampler argmax: the decode step without sampling's two
conditionals (each a predicate the host reads back before launching the rest of the step),
the bound on what a branch-free sampler would save on a GPU; the program it times really lacks
them, and says so in the result."""

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


def test_the_argmax_sampler_takes_sampling_s_two_conditionals_out_of_the_step(tmp_path,
                                                                               monkeypatch):
    from tangram_jax.engine import decode_step
    monkeypatch.setattr(decode_step, "sample_tokens", decode_step.sample_tokens)   # restored
    engine, argmax = _run(tmp_path, "engine"), _run(tmp_path, "argmax")
    assert (engine["sampler"], argmax["sampler"]) == ("engine", "argmax")
    # gemma3-tiny's local / global layers add conditionals of their own (a switch per layer).
    assert argmax["decode"][0]["step_conditionals"] == \
        engine["decode"][0]["step_conditionals"] - 2
