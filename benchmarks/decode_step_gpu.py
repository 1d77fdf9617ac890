"""GPU time of a whole 8B decode step and prefill chunk through the runner. For a
Llama-3.1-8B-shaped model, through the engine's own `ModelRunner`: the denominator of the
control-plane goal.

The model is the project's `Decoder` with random bf16 weights built on the device (nothing is
downloaded): 32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128, intermediate 14336,
vocab 128256, untied head (8.0 B parameters, 16 GB). The KV layout is control_plane.py's Tangram
layout (G 2, page 16, chunk 256, skewed per-head budgets averaging rho 0.25, clustered by budget).
The block tables come from the project's `KVCacheManager`: every sequence of the batch holds a
`--context`-token turn, retained per group by the chunked rule (`reserve` + `commit_prefill`),
plus the page for its next decode token (`grow_for_decode`); the pool's free list is shuffled
first so sequences own scattered pages, as after a while of serving. The pool's contents are
zeros: attention time does not depend on the values.

Timed, after warm-up (compilation) calls:
- `ModelRunner.decode` at each `--batches` bucket: embedding, 32 layers (QKV/O/MLP GEMMs, KV
  append, the Pallas decode kernel with the AOT split map), logits, sampling;
- `ModelRunner.prefill_chunk` of one `--chunk`-token chunk at history 0 and at history
  ``context - chunk`` (chunk attention over the retained history, scoring, compression into pages).

Each figure is the median wall time of `--reps` calls, each ended by `block_until_ready`, and the
GPU busy time per call from a profiler trace (the sum of GPU stream activity, no host gaps) when
the trace has GPU events, with the largest kernels/ops by GPU time. Writes `--out` (default a
fresh file under benchmarks/results/runs/; the committed decode_step_gpu.json only with
--overwrite).

    GIT_REV=$(git rev-parse HEAD) python benchmarks/decode_step_gpu.py
    python benchmarks/decode_step_gpu.py --tiny   # CPU smoke test of the same path, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from control_plane import CHUNK, layouts  # noqa: E402
from tangram_jax.benchmarking.timing import gpu_busy_time  # noqa: E402
from tangram_jax.engine.config import EngineConfig  # noqa: E402
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from tangram_jax.kv_layout import pages_for  # noqa: E402
from tangram_jax.models.decoder import Decoder  # noqa: E402
from tangram_jax.pallas_kernels.split_map import build_split_map  # noqa: E402
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.provenance import device_description, git_revision  # noqa: E402
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402

from tangram_jax.benchmarking.models import LLAMA_8B, TINY, model_config  # noqa: E402,F401


def fill_manager(layout, max_batch: int, context: int, seed: int):
    """A manager whose first `max_batch` slots each hold a `context`-token turn (plus the page of
    the next decode token), and one more slot reserved for a prefill chunk, pages scattered."""
    rows = max_batch + 1
    per_seq = int(pages_for(layout.retained_counts(context) + 1, layout.page_size).sum())
    num_pages = rows * per_seq + 1
    max_pages = int(pages_for(context + 1, layout.page_size))
    manager = KVCacheManager(layout, num_pages, rows, max_pages,
                             model_kv_shape=(layout.num_layers, layout.num_kv_heads,
                                             layout.head_dim))
    rng = np.random.default_rng(seed)
    for pool in manager.pools:          # each tier's pool (one untiered), ids scattered
        pool.release(rng.permutation(pool.allocate(pool.capacity)))
    slots = []
    for _ in range(max_batch):
        slot = manager.allocate_slot()
        if not manager.reserve(slot, context):
            raise RuntimeError("pool sized too small")
        manager.commit_prefill(slot, context)
        slots.append(slot)
    slots = np.asarray(slots, np.int32)
    if not manager.grow_for_decode(slots).all():
        raise RuntimeError("pool sized too small for the decode token")
    prefill_slot = manager.allocate_slot()
    if not manager.reserve(prefill_slot, context):
        raise RuntimeError("pool sized too small for the prefill slot")
    return manager, slots, prefill_slot


def measure(fn, reps: int, on_gpu: bool, top: int = 12) -> dict:
    """Median wall ms of `fn()` (each call ended by block_until_ready), ms a call of `reps`
    calls back to back (`pipelined_ms`) and the host's median ms inside one of them
    (`host_ms_median`), GPU busy ms and the `top` kernels/ops by GPU time."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())                # compiles
    first = time.perf_counter() - t0
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    # Back to back, one wait at the end: what a serving loop that dispatches ahead sees (a host
    # that blocks inside a call, e.g. on a conditional's predicate, cannot run ahead). Each
    # call's own host time is its launch (every device's program), or its wait where it blocks:
    # where it reaches the GPU busy time, the host, not the device, sets the step's pace.
    outs, host = [], []
    t0 = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        outs.append(fn())
        host.append(time.perf_counter() - t)
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - t0) / reps
    del outs
    out = {"wall_ms_median": float(np.median(times) * 1e3),
           "pipelined_ms": float(pipelined * 1e3),
           "host_ms_median": float(np.median(host) * 1e3),
           "wall_ms_p10": float(np.percentile(times, 10) * 1e3),
           "wall_ms_p90": float(np.percentile(times, 90) * 1e3),
           "first_call_s": first, "reps": reps}
    by_name: dict[str, float] = {}
    devices: dict[str, dict] = {}
    gpu = gpu_busy_time(fn, (), max(3, reps // 2), per_kernel=by_name,
                        per_device=devices) if on_gpu else None
    out["gpu_busy_ms"] = float(gpu * 1e3) if gpu else None
    out["top_gpu_ops_ms"] = {k: round(v * 1e3, 4) for k, v in
                             sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}
    if len(devices) > 1:
        # A program over several devices: each one's busy time and top kernels (collectives,
        # its shard of attention and GEMMs), and the spread between them.
        out["per_device"] = {d: {"busy_ms": v["busy_s"] * 1e3, "top_ops_ms": {
            k: round(s * 1e3, 4) for k, s in sorted(v["kernels"].items(),
                                                    key=lambda kv: -kv[1])[:top]}}
            for d, v in sorted(devices.items())}
        busy = [v["busy_s"] for v in devices.values()]
        out["device_busy_spread"] = max(busy) / min(busy)
    out["ms"] = out["gpu_busy_ms"] or out["wall_ms_median"]
    out["time_source"] = "gpu_busy" if out["gpu_busy_ms"] else "wall"
    return out


def decode_call(runner: ModelRunner, slots: np.ndarray, lengths: np.ndarray, context: int):
    """A closure running `runner.decode` on this batch (greedy sampling)."""
    b = len(slots)
    args = (np.full(b, context, np.int32), slots, lengths, np.zeros(b, np.float32),
            np.full(b, -1, np.int32), np.ones(b, np.float32), np.zeros(b, np.uint32),
            np.zeros(b, np.int32))
    call = lambda: runner.decode(*args)   # noqa: E731
    call.decode_args = args
    return call


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=3216,
                        help="tokens of each sequence's turn (control_plane.py's mean context: "
                             "mean prompt 3072 + half the mean output 144)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layer-loop", default=None,
                        help="RunnerConfig.layer_loop ('scan' or 'unrolled'); default: the "
                             "runner's default for the backend")
    parser.add_argument("--tiny", action="store_true", help="small CPU smoke test")
    parser.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    outputs = resolve_outputs(parser, args, {"out": "decode_step_gpu"})
    run = start("decode_step_gpu", outputs, argv)
    shape = TINY if args.tiny else LLAMA_8B
    config = model_config(shape)
    tangram, _, head_budgets = layouts(np.random.default_rng(args.seed), config.num_layers)
    t0 = time.perf_counter()
    manager, slots, prefill_slot = fill_manager(tangram, max(args.batches), args.context,
                                                args.seed)
    host_setup_s = time.perf_counter() - t0
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    t0 = time.perf_counter()
    model = Decoder(config, dtype, rngs=nnx.Rngs(args.seed))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    num_programs = EngineConfig().num_programs
    split_maps = {b: build_split_map(tangram.group_budgets, num_programs, b,
                                     group_size=tangram.group_size) for b in args.batches}
    num_pages = tuple(p.num_pages for p in manager.pools)   # per tier's pool (one untiered)
    runner = ModelRunner(model, config, tangram, num_pages[0] if len(num_pages) == 1 else num_pages,
                         manager.block_tables.shape, split_maps=split_maps,
                         runner_config=RunnerConfig(mode="tangram", obs_window=32,
                                                    layer_loop=args.layer_loop))
    runner.update_block_tables(*manager.take_table_updates())
    jax.block_until_ready(runner.block_tables)
    build_s = time.perf_counter() - t0
    print(f"model {params / 1e9:.2f} B params built in {build_s:.1f} s, pool "
          f"{runner.num_pages} pages ({runner.pool_bytes() / 2**30:.1f} GiB), "
          f"attention ops {runner.ops.name}, layer loop {runner.layer_loop}", flush=True)
    on_gpu = jax.devices()[0].platform == "gpu"

    decode = []
    for b in args.batches:
        rows = slots[:b]
        before = manager.lengths[rows] - 1   # the write position: growth counted the token
        fig = measure(decode_call(runner, rows, before, args.context), args.reps, on_gpu)
        retained = before.astype(np.int64)
        fig.update(batch=b, retained_tokens_per_group_mean=float(retained.mean()),
                   kv_bytes_read=int(retained.sum()) * tangram.group_size * tangram.head_dim
                   * 2 * 2)
        decode.append(fig)
        print(f"decode batch {b}: {fig['ms']:.3f} ms ({fig['time_source']}; wall "
              f"{fig['wall_ms_median']:.3f})", flush=True)

    rng = np.random.default_rng(args.seed + 1)
    prefill = []
    for hist in (0, args.context - CHUNK):
        tokens = rng.integers(0, config.vocab_size, CHUNK).astype(np.int32)
        hist_lengths = manager.layout.retained_counts(hist).astype(np.int32)
        fig = measure(lambda: runner.prefill_chunk(tokens, hist, prefill_slot, hist_lengths)[0],
                      args.reps, on_gpu)
        fig.update(chunk_tokens=CHUNK, history_tokens=hist,
                   history_retained_per_group_mean=float(hist_lengths.mean()))
        prefill.append(fig)
        print(f"prefill chunk of {CHUNK} at history {hist}: {fig['ms']:.3f} ms "
              f"({fig['time_source']})", flush=True)

    weight_bytes = params * jnp.dtype(dtype).itemsize
    result = {
        "benchmark": "decode_step_gpu",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "jax_version": jax.__version__,
        "model": dict(shape, params=params, dtype=str(jnp.dtype(dtype)),
                      weight_bytes=weight_bytes, architecture="llama", random_weights=True),
        "layout": {"name": tangram.name, "group_size": tangram.group_size,
                   "page_size": tangram.page_size, "chunk_size": tangram.chunk_size,
                   "head_budget_mean": float(head_budgets.mean()),
                   "group_budget_mean": float(tangram.group_budgets.mean()),
                   "num_programs": num_programs},
        "layer_loop": runner.layer_loop,
        "context_tokens": args.context,
        "what_is_timed": ("ModelRunner.decode (embedding, 32 layers of GEMMs + KV append + Pallas "
                          "decode attention with the AOT split map, logits, sampling) per batch "
                          "bucket; ModelRunner.prefill_chunk of one chunk (attention over the "
                          "retained history, scoring, compression into pages, last logits). "
                          "`ms` is GPU busy time per call when the profiler saw GPU events, "
                          "else the median wall time with block_until_ready"),
        "host_setup_s": host_setup_s,
        "model_build_s": build_s,
        "decode": decode,
        "prefill_chunk": prefill,
        "prefill_chunk_ms_mean": float(np.mean([p["ms"] for p in prefill])),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", flush=True)
    finish(run)


if __name__ == "__main__":
    main()
