"""A long-running engine under a churning, partly hostile workload keeps its memory flat (soak).

One engine serves a one-hour-equivalent stream of requests, step after step: new requests and
next turns of sessions keep arriving (random prompt lengths, greedy and sampled, random output
lengths), some are aborted mid-flight, sessions are ended or left to be evicted, and invalid
requests are mixed in (each must be refused without touching the engine). Every `--sample`
steps the process's resident memory (RSS) is recorded; the report gives steps served,
requests by outcome, RSS at the start and end of the measured part and its slope per 1000
steps (flat: the engine keeps no per-step or per-request state once a request is gone).

"One hour" is counted in steps: the GPU engine benchmark (`gpu_engine.json`, full KV, 64
sequences) served about 944 output tokens/s, i.e. ~15 decode steps per second, 54,000 steps
an hour. On a CPU the default model is a tiny random-weight Llama (the test suite's, built in a
temporary folder: milliseconds per step), so the hour's steps fit in minutes; `--model smollm2`
soaks the embedded SmolLM2-135M instead (slower per step: use fewer steps).

    python benchmarks/soak.py --steps 54000 --modes tangram,full:10000,dynamic:10000
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # the tiny model builder shared with the test suite
from tangram_jax.benchmarking.results import (RESULTS_DIR, finish,  # noqa: E402
                                               resolve_outputs, start)
from tangram_jax.commands import add_overwrite_flag, write_text_atomic  # noqa: E402
from tangram_jax.provenance import device_description, git_revision  # noqa: E402

# Requests that must be refused (the engine's boundary checks) mixed into the stream.
BAD_REQUESTS = [
    dict(prompt=b"bytes"), dict(prompt=""), dict(prompt="a\ud800"), dict(prompt_token_ids=5),
    dict(prompt_token_ids=[1.5]), dict(prompt_token_ids=[True]), dict(prompt_token_ids=[10**9]),
    dict(prompt="x", session_id=["s"]), dict(prompt="x", request_id=7),
]


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def compiled_executables(engine) -> int:
    """Executables the runner's jitted step functions hold (one per step shape met)."""
    total = 0
    for fn in vars(engine.runner).values():
        size = getattr(fn, "_cache_size", None)
        if callable(size):
            total += size()
    return total


def soak(mode: str, n_steps: int, args, folder: Path | None) -> dict:
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams

    if folder is not None:
        from tiny_engine import tiny_engine_config
        config = tiny_engine_config(folder, mode, max_num_seqs=args.max_num_seqs)
    else:
        from tangram_jax.engine.config import EngineConfig
        config = EngineConfig(model=args.model, mode=mode, max_num_seqs=args.max_num_seqs,
                              kv_cache_tokens=8192, max_model_len=1024, chunk_size=64)
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    max_prompt = min(48, engine.max_model_len // 4)
    rng = np.random.default_rng(args.seed)
    counts = dict(added=0, finished=0, aborted=0, errors=0, refused=0, sessions_ended=0,
                  generated_tokens=0)
    samples = []   # (step, RSS bytes, Python heap blocks, compiled step executables)

    def add_one():
        r = rng.random()
        if r < 0.05:
            try:
                engine.add_request(**BAD_REQUESTS[int(rng.integers(len(BAD_REQUESTS)))])
            except (TypeError, ValueError):
                counts["refused"] += 1
                return
            raise AssertionError("an invalid request was accepted")
        kw = {}
        session = f"s{int(rng.integers(args.sessions))}"
        if r < 0.5 and not engine.session_is_busy(session):
            kw["session_id"] = session
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])),
                                max_tokens=int(rng.integers(1, 48)), seed=int(rng.integers(2**31)))
        ids = rng.integers(0, vocab, int(rng.integers(1, max_prompt))).tolist()
        try:
            engine.add_request(prompt_token_ids=ids, sampling_params=params, **kw)
        except ValueError:   # the session's history would pass max_model_len: end it
            engine.end_session(session)
            counts["sessions_ended"] += 1
            return
        counts["added"] += 1

    t0 = time.perf_counter()
    for step in range(n_steps):
        while len(engine._requests) < args.max_num_seqs + 2:
            add_one()
        if rng.random() < 0.02 and engine._requests:
            live = sorted(engine._requests)
            engine.abort(live[int(rng.integers(len(live)))])
            counts["aborted"] += 1
        if rng.random() < 0.01:
            session = f"s{int(rng.integers(args.sessions))}"
            if engine.has_session(session) and not engine.session_is_busy(session):
                engine.end_session(session)
                counts["sessions_ended"] += 1
        for out in engine.step():
            if out.finished:
                counts["finished"] += 1
                counts["errors"] += out.error is not None
                counts["generated_tokens"] += len(out.outputs[0].token_ids)
        if step % args.sample == 0 or step == n_steps - 1:
            samples.append((step, rss_bytes(), sys.getallocatedblocks(),
                            compiled_executables(engine)))
    seconds = time.perf_counter() - t0
    for rid in list(engine._requests):
        engine.abort(rid)
    steps, rss, blocks, compiled = np.array(samples, np.float64).T
    measured = steps >= n_steps * args.warm_fraction   # after every shape compiled
    slope = np.polyfit(steps[measured], rss[measured], 1)[0] * 1000 if measured.sum() > 1 else 0.0
    half = steps >= (n_steps * (1 + args.warm_fraction)) / 2
    usage = engine.kv_usage()
    return dict(
        mode=mode, steps=int(engine.scheduler.metrics.num_steps), seconds=seconds,
        steps_per_s=n_steps / seconds, **counts,
        rss_mib_start_of_measure=float(rss[measured][0] / 2**20),
        rss_mib_end=float(rss[-1] / 2**20),
        rss_mib_peak_first_half=float(rss[measured & ~half].max() / 2**20),
        rss_mib_peak_second_half=float(rss[half].max() / 2**20),
        rss_growth_bytes_per_1000_steps=float(slope),
        # RSS also grows in steps when a new step shape is compiled (XLA's code and buffers,
        # bounded by the shapes there are); the Python heap holds the engine's own state.
        python_heap_blocks_start_of_measure=int(blocks[measured][0]),
        python_heap_blocks_end=int(blocks[-1]),
        python_heap_blocks_peak_first_half=int(blocks[measured & ~half].max()),
        python_heap_blocks_peak_second_half=int(blocks[half].max()),
        compiled_executables_start_of_measure=int(compiled[measured][0]),
        compiled_executables_end=int(compiled[-1]),
        host_time_window_steps=int(engine.scheduler.metrics.step_host_seconds.size),
        preemptions=usage["scheduler"]["preemptions"], evictions=usage["scheduler"]["evictions"],
        pages_used_after_abort_all=int(usage["pages_used"]),
        samples_step_rss_heapblocks_compiled=[list(map(int, x)) for x in zip(steps, rss, blocks,
                                                                             compiled)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=54000, help="steps per mode (default: an "
                        "hour of the GPU engine benchmark's step rate)")
    parser.add_argument("--modes", default="tangram,full,dynamic",
                        help="comma-separated modes, each optionally mode:steps")
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (random-weight test model) or a model for EngineConfig")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=12, help="distinct session ids in use")
    parser.add_argument("--sample", type=int, default=500, help="record RSS every N steps")
    parser.add_argument("--warm-fraction", type=float, default=0.1,
                        help="first part of the run not measured (compiles, pools filling)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                        "benchmarks/results/runs/; the committed soak.json only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args()
    plan = [(mode, int(n) if n else args.steps)
            for mode, _, n in (item.partition(":") for item in args.modes.split(","))]
    run = start("soak", resolve_outputs(parser, args, {"out": "soak"}),
                estimate=_estimate(plan, args.model))
    folder = None
    if args.model == "tiny":
        from tiny_engine import build_tiny_model
        folder = build_tiny_model(tempfile.mkdtemp(prefix="soak-tiny-"))
    results = []
    for mode, steps in plan:
        r = soak(mode, steps, args, folder)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("samples")}), flush=True)
        results.append(r)
    report = dict(benchmark="soak", device=device_description(), git_revision=git_revision(),
                  command="python " + " ".join(sys.argv), config=vars(args), results=results)
    write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    finish(run)
    print(f"wrote {args.out}")


def _estimate(plan: list[tuple[str, int]], model: str) -> tuple[float, str] | None:
    """Seconds for `plan` ((mode, steps) pairs) at the step rates of the committed run on the
    same model (soak.json: measured on a 2-core CPU), or None."""
    try:
        committed = json.loads((RESULTS_DIR / "soak.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rates = {r["mode"]: r["steps_per_s"] for r in committed.get("results", [])}
    if committed.get("config", {}).get("model") != model or any(m not in rates for m, _ in plan):
        return None
    seconds = sum(steps / rates[mode] for mode, steps in plan)
    return seconds, (f"steps / the step rate of each mode in the committed soak.json, "
                     f"{committed.get('device', 'its device')}")


if __name__ == "__main__":
    main()
