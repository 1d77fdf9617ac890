"""Engine start-up to the first token, cold and with JAX's persistent compilation cache warm.

For each mode, starts the same engine configuration in fresh processes that share one empty
cache folder (the first compiles everything and fills the cache, the second loads from it),
then one more fresh process for each `--changes` setting (one engine setting changed, the cache
warm from the first two: what a user who changes the pool or the batch size pays). Each process
times the Engine's construction with warm-up (`EngineConfig(warmup=True)`: every step shape
compiled) and then the first token of one 512-token request, and reports where start-up went
(`Engine.startup_report`: seconds by phase, each compiled program's compile seconds).

    python benchmarks/startup.py                              # CPU: embedded SmolLM2-135M
    python benchmarks/startup.py --model random-llama-8b      # GPU: Llama-3.1-8B shape, random
                                                               # bf16 weights built on the device

With `--baseline DIR` (a folder holding another revision's `tangram_jax` package, and that
revision in DIR/REVISION) every start runs twice, the baseline's process first, each side with
its own cache folder: a before / after on one machine (cold starts of one machine kind vary by
a quarter between machines).

    git archive REV tangram_jax | tar -x -C /path/base && echo REV > /path/base/REVISION
    python benchmarks/startup.py --model random-llama-8b --modes tangram --baseline /path/base

Writes `--out` (default a fresh file under benchmarks/results/runs/; the committed
startup_<cpu|gpu>.json only with --overwrite): device, revision, command, each start's seconds,
the ratio cold / warm, and with a baseline its starts and ours over its.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
# A child process of a `--baseline` start imports that folder's package instead of ours.
PACKAGE_ROOT = (sys.argv[sys.argv.index("--package-root") + 1] if "--package-root" in sys.argv
                else ROOT)
sys.path.insert(0, PACKAGE_ROOT)
from tangram_jax.benchmarking.models import RANDOM_8B  # noqa: E402
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402

PROMPT_TOKENS = 512


def build_engine(model: str, engine_kwargs: dict):
    """`Engine(EngineConfig(model=..., **engine_kwargs))`; the random 8B model is handed to the
    engine in place of `load_model` (it has no file)."""
    from tangram_jax.engine import llm_engine
    from tangram_jax.engine.config import EngineConfig

    if model == RANDOM_8B:   # built inside Engine(), after it has set JAX's allocator up
        from tangram_jax.benchmarking import models
        dtype = engine_kwargs.get("dtype", "bfloat16")
        if hasattr(models, "random_model_source"):   # what a HF folder gives: config first
            return llm_engine.Engine(EngineConfig(
                model=models.random_model_source(RANDOM_8B, dtype), **engine_kwargs))
        llm_engine.load_model = lambda *args, **kwargs: models.random_model(RANDOM_8B, dtype)
    return llm_engine.Engine(EngineConfig(model=None if model == RANDOM_8B else model,
                                          **engine_kwargs))


def engine_kwargs_for(model: str, mode: str | None = None) -> dict:
    """The engine settings timed: for the 8B shape the GPU defaults (chunk size 2048, step
    token budget 8192: the largest step is measured) at 64 sequences and 32k tokens a sequence
    (the shape of `gpu_memory.py`), `mode` full by default; tangram with a skewed random profile
    at 0.25 (G 2; the random model has no calibrated one). SmolLM2: tangram, float32."""
    if model == RANDOM_8B:
        mode = mode or "full"
        kwargs = dict(mode=mode, dtype="bfloat16", max_num_seqs=64, max_model_len=32768,
                      warmup=True)
        if mode == "tangram":
            from tangram_jax.benchmarking.models import random_model_config
            from tangram_jax.benchmarking.workload import skewed_profile
            kwargs.update(group_size=2, profile=skewed_profile(
                random_model_config(RANDOM_8B), 2, 0.25, seed=0))
        return kwargs
    return dict(mode=mode or "tangram", dtype="float32", max_num_seqs=16, warmup=True)


def _printable(kwargs: dict) -> dict:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__)
            for k, v in kwargs.items()}


class LockWatch:
    """A thread that wakes every millisecond and records each wake-up later than `gap`
    seconds: the times something held Python's lock (a lowering thread waits as long)."""

    def __init__(self, gap: float = 0.05):
        import gc
        import threading
        self.gap, self.stalls, self._stop = gap, [], threading.Event()
        self._t0 = time.perf_counter()
        self.collections, self._collecting = [], None   # Python's garbage collections
        gc.callbacks.append(self._on_collect)
        self._thread = threading.Thread(target=self._run, name="lock-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            if now - last > self.gap:
                self.stalls.append((last - self._t0, now - last))
            last = now

    def _on_collect(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._collecting = now
        elif self._collecting is not None:
            self.collections.append((info["generation"], self._collecting - self._t0,
                                     now - self._collecting))

    def report(self) -> dict:
        """{"count", "seconds" (summed), "longest", "at": [(start, seconds)] of the 20 longest,
        "gc": Python's collections of the oldest generation [(start, seconds)] and the seconds
        of all collections}."""
        import gc
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_collect)
        longest = sorted(self.stalls, key=lambda s: -s[1])[:20]
        return dict(count=len(self.stalls), seconds=sum(s for _, s in self.stalls),
                    longest=max((s for _, s in self.stalls), default=0.0),
                    at=[(round(a, 2), round(s, 3)) for a, s in sorted(longest)],
                    gc=[(round(a, 2), round(s, 3)) for g, a, s in self.collections if g == 2],
                    gc_seconds=sum(s for *_, s in self.collections))


def child(args) -> None:
    watch = LockWatch()
    t0 = time.perf_counter()
    kwargs = dict(engine_kwargs_for(args.model, args.mode), compile_cache_dir=args.cache_dir,
                  **json.loads(args.change or "{}"))
    engine = build_engine(args.model, kwargs)
    built = time.perf_counter() - t0
    from tangram_jax.sampling import SamplingParams
    prompt = [int(t) for t in (1 + (i * 7919) % 1000 for i in range(PROMPT_TOKENS))]
    engine.add_request("first", prompt_token_ids=prompt,
                       sampling_params=SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    first_token = time.perf_counter() - t0
    # What warm-up left to the background (`background_compile`), waited for now so that the
    # report lists it; a revision without it has nothing to wait for.
    compiled_all = getattr(engine, "wait_for_compiles", lambda: True)()
    all_compiled = time.perf_counter() - t0
    report = engine.startup_report()
    print("STARTUP " + json.dumps({
        "lock_stalls": watch.report(),
        "seconds": built, "first_token_seconds": first_token,
        "all_compiled_seconds": all_compiled, "background_compiles_ok": compiled_all,
        "engine": engine.startup_seconds, "num_programs": report["num_programs"],
        "compile_seconds": report["compile_seconds"], "programs": report["programs"],
        "pool": {k: v for k, v in engine.kv_pool().items() if k != "plan"}}), flush=True)


def run_start(model: str, mode: str | None, cache_dir: str, change: dict | None = None,
              log=print, package_root: str | None = None) -> dict:
    """One fresh process of the configuration (`change`: engine settings over it) with the
    compile cache in `cache_dir`, importing the package in `package_root` (default ours)."""
    t0 = time.perf_counter()
    command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
               "--cache-dir", cache_dir]
    command += ["--package-root", package_root] if package_root else []
    command += ["--mode", mode] if mode else []
    command += ["--change", json.dumps(change)] if change else []
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"start of {mode or 'default'} {change or ''} failed "
                           f"(rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = dict(json.loads(line[len("STARTUP "):]), process_wall_seconds=wall,
                  change=change)
    log(f"{'baseline ' if package_root else ''}{mode or 'default'}"
        f"{' ' + json.dumps(change) if change else ''}: engine built and "
        f"warmed up in {result['seconds']:.1f} s, first token at "
        f"{result['first_token_seconds']:.1f} s, every program compiled at "
        f"{result.get('all_compiled_seconds', float('nan')):.1f} s (process {wall:.1f} s; loading the weights "
        f"{result['engine'].get('load_model', 0):.1f} s, warm-up "
        f"{result['engine']['warmup']:.1f} s; {result['num_programs']} programs, "
        f"{result['compile_seconds']:.1f} s of compiles)", flush=True)
    return result


def _summary(starts: list[dict]) -> dict:
    """One side's starts (cold, warm, then one a change) as the result's fields."""
    cold, warm, *changed = starts
    return {"cold": cold, "warm": warm, "changed": changed,
            "cold_over_warm": cold["first_token_seconds"] / warm["first_token_seconds"],
            "first_token_seconds": {"cold": cold["first_token_seconds"],
                                    "warm": warm["first_token_seconds"],
                                    **{json.dumps(c["change"]): c["first_token_seconds"]
                                       for c in changed}}}


def parse_changes(text: str) -> list[dict]:
    """``name=value,...`` -> one {name: value} a start (ints where they parse)."""
    changes = []
    for item in (t for t in text.split(",") if t):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--changes: expected name=value items, got {item!r}")
        changes.append({name: int(value) if value.lstrip("-").isdigit() else value})
    return changes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help=f"'smollm2' or '{RANDOM_8B}'")
    parser.add_argument("--modes", default=None,
                        help="comma-separated engine modes, each timed with its own empty cache "
                             "(default: full for the 8B shape, tangram for SmolLM2)")
    parser.add_argument("--changes", default="",
                        help="name=value,... : after the cold and warm starts, one more start "
                             "per item with that engine setting changed (e.g. "
                             "kv_cache_tokens=380000,max_num_seqs=32)")
    parser.add_argument("--cache-dir", default=None,
                        help="default: a fresh temporary folder a mode")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a folder holding another revision's tangram_jax package (and "
                             "that revision in DIR/REVISION): every start also runs from it, "
                             "just before ours, with its own cache folder")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--package-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--change", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "tangram_jax")):
        parser.error(f"--baseline {args.baseline!r}: no tangram_jax package in that folder")
    changes = parse_changes(args.changes)
    run = start("startup", resolve_outputs(parser, args, {"out": "startup"}), argv)
    import jax

    from tangram_jax.provenance import device_description, git_revision
    modes = [m for m in (args.modes or "").split(",") if m] or [None]
    by_mode = {}
    for mode in modes:
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tangram_jax_startup_")
        sides = {"ours": (None, cache_dir)}
        if args.baseline:   # first, so neither side always meets a machine warmed by the other
            sides = {"baseline": (args.baseline, cache_dir.rstrip("/") + "_baseline"), **sides}
        starts = {side: [] for side in sides}
        for change in [None, None, *changes]:   # cold, warm, then each change
            for side, (root, cache) in sides.items():
                starts[side].append(run_start(args.model, mode, cache, change,
                                              package_root=root))
        entry = {"engine_config": _printable(engine_kwargs_for(args.model, mode)),
                 **_summary(starts["ours"])}
        if args.baseline:
            entry["baseline"] = _summary(starts["baseline"])
            entry["ours_over_baseline"] = {
                k: v / entry["baseline"]["first_token_seconds"][k]
                for k, v in entry["first_token_seconds"].items()}
        by_mode[mode or engine_kwargs_for(args.model)["mode"]] = entry
    result = {
        "benchmark": "startup",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "jax_version": jax.__version__,
        "model": args.model,
        "what_is_timed": ("from before Engine(...) to the first token of one "
                          f"{PROMPT_TOKENS}-token request, in a fresh process: construction "
                          "with warm-up (every step shape compiled), then the request; 'cold': "
                          "an empty compilation cache folder, 'warm': the same configuration "
                          "again, 'changed': one setting changed, the cache warm; "
                          "all_compiled_seconds: until what warm-up left to the background "
                          "(background_compile) had compiled too, waited for after the "
                          "first token; lock_stalls: the times a thread waking every "
                          "millisecond waited over 50 ms for Python's lock, to all_compiled"),
        "modes": by_mode,
    }
    if args.baseline:
        revision = os.path.join(args.baseline, "REVISION")
        result["baseline"] = {"package_root": args.baseline, "git_revision": (
            open(revision).read().strip() if os.path.isfile(revision) else "unknown")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    finish(run)
    for mode, r in by_mode.items():
        print(f"{mode}: first token {r['first_token_seconds']} s (cold / warm "
              f"{r['cold_over_warm']:.2f}x)", flush=True)
        if "baseline" in r:
            print(f"{mode}: baseline {r['baseline']['first_token_seconds']} s; ours over it "
                  + ", ".join(f"{k} {v:.3f}x" for k, v in r["ours_over_baseline"].items()),
                  flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
