"""`tangram-jax bench`: run a benchmark of the harness (in `benchmarks/` of the checkout).

Each benchmark measures Tangram and its baselines in the same run and writes JSON with the
device, the git revision and the command: to a fresh `benchmarks/results/runs/NAME-<time>.json`
unless its `--out` (`--json`) names a file, and over a committed result only with `--overwrite`.
Each says up front where it writes and about how long it will take
(`tangram_jax.benchmarking.results`).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HELP = ("Run a benchmark (serve, accuracy, end_to_end, control_plane, decode_attention, "
        "decode_step_gpu, gpu_engine_check); writes a fresh benchmarks/results/runs/*.json "
        "unless told where (committed results only with --overwrite)")

BENCHMARKS = {
    "serve": "multi-turn SCBench-shaped sessions, closed and open loop, the ablation "
             "(full, reserve-mono, ragged, tangram, dynamic) and vLLM beside it "
             "(tangram_jax/commands/bench_serve.py)",
    "accuracy": "task accuracy under compression: generated multi-turn tasks in every mode and "
                "ratio, CIs, agreement and KL with full KV (kvpress beside it: "
                "benchmarks/kvpress_accuracy.py)",
    "end_to_end": "multi-turn serving, tangram vs full KV vs dynamic reclaim, equal KV memory",
    "control_plane": "host time per scheduling step, Budget Reservation vs dynamic reclaim",
    "decode_attention": "decode attention kernel: AOT split map vs uniform vs runtime-planned (GPU)",
    "decode_step_gpu": "a whole Llama-3.1-8B-shaped decode step and prefill chunk through the "
                       "runner (GPU; the control plane's denominator)",
    "gpu_engine_check": "the engine on a GPU: dense-reference equality, then every mode serving "
                        "the same multi-turn workload (needs --tokenizer-dir)",
}


def add_arguments(parser) -> None:
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS),
                        help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    parser.add_argument("args", nargs="*", help="arguments passed to the benchmark "
                        "(put them after --, e.g. `tangram-jax bench end_to_end -- --turns 3`)")


def benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    if not here.is_dir():
        raise FileNotFoundError("the benchmark harness lives in the source checkout's benchmarks/ "
                                "folder; install tangram-jax from a checkout (pip install -e .)")
    return here


def run(args) -> int:
    if args.benchmark == "serve":   # part of the package, not a script of the checkout
        from tangram_jax.commands import bench_serve
        return bench_serve.main(list(args.args))
    try:
        script = benchmarks_dir() / f"{args.benchmark}.py"
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:   # the benchmark's own exit: a status, or a message (status 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    return 0
