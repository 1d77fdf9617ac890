"""The README main job's cold start: `tangram-jax run` in fresh processes with empty caches.

Each start is a fresh process of `tangram-jax run ARGS --compile-cache-dir off` with a fresh,
empty `TANGRAM_JAX_CACHE` (no converted model, no compiled program from an earlier start), timed
from the process's start: `LLM(...)` ready, the first generated token (the first `Engine.step`
that reports one) and the whole job. With `--baseline DIR` (a folder holding another
revision's `tangram_jax` package, that revision in DIR/REVISION) the starts alternate, the
baseline's first, on the same machine: a before / after, reported as ours over its.

    git archive REV tangram_jax | tar -x -C /path/base && echo REV > /path/base/REVISION
    python benchmarks/main_job_start.py --baseline /path/base --pairs 2

Writes `--out` (default a fresh file under benchmarks/results/runs/; the committed
main_job_start_cpu.json only with --overwrite).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
from tangram_jax.benchmarking.results import finish, resolve_outputs, start, write_result  # noqa: E402,E501
from tangram_jax.commands import add_overwrite_flag  # noqa: E402

# The child: the CLI's main job with three clocks on it, from the process's start (the
# parent's clock: its `started` is handed over, so the interpreter's own start counts too).
CHILD = r"""
import json, sys, time
started = float(sys.argv[1])
marks = {}
from tangram_jax import llm as llm_module
from tangram_jax.engine import llm_engine
init, step = llm_module.LLM.__init__, llm_engine.Engine.step
def timed_init(self, *a, **k):
    init(self, *a, **k)
    marks.setdefault("ready", time.time() - started)
def timed_step(self):
    outputs = step(self)
    if "first_token" not in marks and any(o.outputs and o.outputs[0].token_ids for o in outputs):
        marks["first_token"] = time.time() - started
    return outputs
llm_module.LLM.__init__, llm_engine.Engine.step = timed_init, timed_step
from tangram_jax.cli import main
rc = main(["run", *sys.argv[2:], "--compile-cache-dir", "off"])
marks["wall"] = time.time() - started
print("REPORT " + json.dumps(dict(marks, rc=rc)), flush=True)
"""


def one_start(package_root: str, run_args: list[str]) -> dict:
    """One cold start of the main job from `package_root`'s package (fresh caches)."""
    with tempfile.TemporaryDirectory(prefix="tangram-main-job-") as cache:
        env = dict(os.environ, TANGRAM_JAX_CACHE=cache,
                   PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), *run_args],
                              env=env, capture_output=True, text=True, cwd=cache)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the main job from {package_root} failed (rc {proc.returncode}): "
                           f"{proc.stderr[-3000:]}")
    report = json.loads(line[len("REPORT "):])
    report["throughput_line"] = next((ln for ln in proc.stdout.splitlines()
                                      if ln.startswith("throughput:")), None)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2, help="starts of each side (default 2)")
    p.add_argument("--baseline", default=None,
                   help="folder with another revision's tangram_jax package (and REVISION)")
    p.add_argument("--run-args", default="", help="arguments for `tangram-jax run` "
                   "(default: none, the README's main job)")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: must be at least 1")
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "tangram_jax")):
        p.error(f"--baseline {args.baseline}: holds no tangram_jax package")
    outputs = resolve_outputs(p, args, {"out": "main_job_start"})
    run = start("main_job_start", outputs, argv)
    run_args = args.run_args.split()
    sides = ([("baseline", args.baseline)] if args.baseline else []) + [("ours", ROOT)]
    starts = {name: [] for name, _ in sides}
    for i in range(args.pairs):
        for name, root in sides:
            report = one_start(root, run_args)
            starts[name].append(report)
            print(f"{name} start {i + 1}: ready {report['ready']:.1f} s, first token "
                  f"{report['first_token']:.1f} s, wall {report['wall']:.1f} s", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs)
                     for k in ("ready", "first_token", "wall")} for name, runs in starts.items()}
    result = {"run_args": run_args, "starts": starts, "median_seconds": median}
    if args.baseline:
        with open(os.path.join(args.baseline, "REVISION")) as f:
            result["baseline_revision"] = f.read().strip()
        result["baseline_over_ours"] = {k: median["baseline"][k] / median["ours"][k]
                                        for k in median["ours"]}
        print("baseline / ours (medians): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in result["baseline_over_ours"].items()))
    write_result(args.out, "main_job_start", result,
                 argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    print(f"wrote {args.out}")
    finish(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
