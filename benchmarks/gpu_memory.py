"""The whole GPU for KV at the 8B shape, the pool updated in place by every step.

The Llama-3.1-8B shape served with the pool that the default `gpu_memory_utilization` (0.9)
leaves.

The model: Llama-3.1-8B shape (32 layers, 32 q / 8 KV heads, head_dim 128, vocab 128256) with
random bf16 weights built on the device (`startup.random_llama_8b`), mode `full` (bf16 KV, no
compression), max_num_seqs 64, the GPU defaults for chunk size and step token budget (2048 / 8192). The engine sizes its own pool (no kv_cache_tokens).
Then it serves a few requests (prefill chunks and decode steps at that pool size) and the script
records:

- weights bytes, pool pages / full-KV tokens / bytes, the sizing figures (`Engine.kv_pool()`),
  the card's size (nvidia-smi and what JAX's allocator was based on);
- the allocator's `peak_bytes_in_use` after serving, against weights + pool;
- in place: the pool buffers' device addresses before and after serving (equal: no step
  replaced them), and the compiled decode / prefill steps' temp and aliased bytes at the real
  pool size (`ModelRunner.compile_steps`: temp far below one pool array);
- startup_gpu.json's cold / warm start times when that file exists (run startup.py first).

    python benchmarks/startup.py --model random-llama-8b && python benchmarks/gpu_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from startup import RANDOM_8B, build_engine, engine_kwargs_for  # noqa: E402

GIB = 2 ** 30


def nvidia_smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout.strip().splitlines()[0]
        name, total, used = [x.strip() for x in out.split(",")]
        return {"name": name, "memory_total_bytes": int(total) * 2**20,
                "memory_used_bytes": int(used) * 2**20}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--cache-dir", default=None, help="compile cache (default: engine's)")
    parser.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    outputs = resolve_outputs(parser, args, {"out": "gpu_memory"})
    run = start("gpu_memory", outputs, argv)

    import jax
    from tangram_jax.provenance import device_description, git_revision
    from tangram_jax.sampling import SamplingParams

    t0 = time.perf_counter()
    kwargs = dict(engine_kwargs_for(RANDOM_8B), compile_cache_dir=args.cache_dir)
    engine = build_engine(RANDOM_8B, kwargs)
    build_s = time.perf_counter() - t0
    runner = engine.runner
    device = jax.devices()[0]
    pool = engine.kv_pool()
    weights_bytes = sum(int(x.nbytes) for x in jax.tree.leaves((runner.state,
                                                                 runner.layer_states)))
    pool_array_bytes = int(runner.k_pages.nbytes)
    stats_built = device.memory_stats()
    print(f"built + warmed up in {build_s:.1f} s; {engine._pool_line()}", flush=True)

    # Compiled steps at the real pool size (jit's own executables: no new compile).
    compiled = runner.compile_steps(runner.num_pages, max(engine.scheduler.decode_buckets),
                                    engine.config.max_prefill_rows)
    steps = {}
    for name, c in compiled.items():
        m = c.memory_analysis()
        steps[name] = {"temp_bytes": int(m.temp_size_in_bytes),
                       "alias_bytes": int(m.alias_size_in_bytes),
                       "argument_bytes": int(m.argument_size_in_bytes),
                       "output_bytes": int(m.output_size_in_bytes),
                       "temp_over_pool_array": m.temp_size_in_bytes / pool_array_bytes}
        print(f"{name}: temp {m.temp_size_in_bytes / GIB:.3f} GiB, aliased "
              f"{m.alias_size_in_bytes / GIB:.2f} GiB (one pool array "
              f"{pool_array_bytes / GIB:.2f} GiB)", flush=True)

    pointers_before = (runner.k_pages.unsafe_buffer_pointer(),
                       runner.v_pages.unsafe_buffer_pointer())
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        ids = rng.integers(1, engine.model_config.vocab_size, args.prompt_tokens).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
    t0 = time.perf_counter()
    n_steps, generated = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        n_steps += 1
    jax.block_until_ready(runner.k_pages)
    serve_s = time.perf_counter() - t0
    pointers_after = (runner.k_pages.unsafe_buffer_pointer(),
                      runner.v_pages.unsafe_buffer_pointer())
    stats = device.memory_stats()
    usage = engine.kv_usage()
    smi = nvidia_smi()
    plan = pool.get("plan") or {}
    peak = int(stats["peak_bytes_in_use"])
    print(f"served {args.requests} requests ({args.prompt_tokens}-token prompts, "
          f"{generated} tokens out) in {n_steps} engine steps, {serve_s:.1f} s; allocator peak "
          f"{peak / GIB:.2f} GiB = weights {weights_bytes / GIB:.2f} + pool "
          f"{pool['bytes'] / GIB:.2f} + {(peak - weights_bytes - pool['bytes']) / GIB:.2f}; "
          f"pool buffers in place: {pointers_before == pointers_after}", flush=True)

    startup = None
    startup_file = os.path.join(BENCH, "results", "startup_gpu.json")
    if os.path.exists(startup_file):
        with open(startup_file) as f:
            s = json.load(f)
        startup = {"file": os.path.relpath(startup_file, ROOT),
                   "seconds": [x["seconds"] for x in s["starts"]],
                   "warmup_seconds": [x["engine"]["warmup"] for x in s["starts"]],
                   "first_over_second": s["first_over_second"]}
    result = {
        "benchmark": "gpu_memory",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "jax_version": jax.__version__,
        "engine_config": {k: v for k, v in kwargs.items()},
        "gpu_memory_utilization": engine.config.gpu_memory_utilization,
        "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "card": {"nvidia_smi": smi, "jax_allocator_basis_bytes": plan.get("card_bytes"),
                 "jax_allocator_limit_bytes": int(stats["bytes_limit"])},
        "weights_bytes": weights_bytes,
        "pool": {"num_pages": pool["num_pages"], "full_kv_tokens": pool["full_kv_tokens"],
                 "bytes": pool["bytes"], "one_array_bytes": pool_array_bytes,
                 "sized_by": pool["sized_by"], "plan": plan},
        "meets_380k_tokens": pool["full_kv_tokens"] >= 380_000,
        "allocator_after_build": stats_built,
        "allocator_after_serving": stats,
        "peak_bytes_in_use": peak,
        "peak_minus_weights_and_pool_bytes": peak - weights_bytes - pool["bytes"],
        "peak_over_card": peak / smi["memory_total_bytes"] if smi else None,
        "compiled_steps": steps,
        "pool_buffers_unchanged_by_serving": pointers_before == pointers_after,
        "served": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "engine_steps": n_steps,
                   "tokens_generated": generated, "seconds": serve_s,
                   "pages_used_at_end": usage["pages_used"]},
        "build_and_warmup_seconds": build_s,
        "engine_startup_seconds": engine.startup_seconds,
        "startup": startup,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", flush=True)
    finish(run)


if __name__ == "__main__":
    main()
