"""Decode attention at a Llama-3.1-8B layer shape (GPU only). AOT split map vs uniform splits vs runtime planning vs JAX's
built-in paged attention on the full cache, at a Llama-3.1-8B layer shape (GPU only).

One layer's launch is timed (32 query / 8 KV heads, head_dim 128, G=2 -> 4 groups, bf16). The
compressed cache holds, per (sequence, group), `kv_layout.retained_counts` of the context under a
skewed calibrated-style profile averaging rho = 0.25; the built-in kernel reads the uncompressed
context. `time_s` is GPU busy time per launch from a profiler trace (CUPTI; kernels of the
whole step: the decode kernel and the merge kernel), `wall_time_s` the host wall clock; wall
times are medians over repetitions of a jitted block of `--calls` launches, divided by the
launches. Every launch of a block has its own q (so XLA cannot merge identical calls) and,
when one page set is small, its own page set (so the L2 cache does not serve them), each passed
as its own array. `kernels_s` splits `time_s` by kernel name.

    GIT_REV=$(git rev-parse HEAD) python benchmarks/decode_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax.benchmarking.timing import gpu_busy_time, wall_quantiles
from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag
from tangram_jax.provenance import device_description, git_revision
from tangram_jax.kv_layout import pages_for, retained_counts
from tangram_jax.pallas_kernels import split_map as sm
from tangram_jax.pallas_kernels.backend import default_interpret
from tangram_jax.pallas_kernels.decode_attention import (decode_partials,
                                                         ragged_paged_decode_attention)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, GROUP_SIZE = 32, 8, 128, 2
BUDGETS = np.array([[0.04, 0.08, 0.20, 0.68]])        # mean 0.25, skewed as calibration gives
CHUNK_SIZE = 512
DTYPE = jnp.bfloat16
L2_BYTES = 50 << 20



def copy_bandwidth(mib=2048, reps=20):
    """Device-to-device copy of `mib` MiB: (bytes read + bytes written) / time."""
    x = jax.random.normal(jax.random.key(0), (mib << 18,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    t, _, _ = wall_quantiles(f, (x,), reps)
    gpu = gpu_busy_time(f, (x,), reps)
    t = gpu or t
    return 2 * x.nbytes / t


def _compressed_case(rng, batch, context, page_size, sets):
    """Pool and `sets` disjoint block-table sets for the compressed cache."""
    lengths = retained_counts(BUDGETS, context, CHUNK_SIZE)[0]          # [groups]
    groups = lengths.shape[0]
    pages = pages_for(lengths, page_size)
    max_pages = int(pages.max())
    per_set = batch * int(pages.sum())
    num_pages = sets * per_set
    tables = np.zeros((sets, batch, groups, max_pages), np.int32)
    perm = rng.permutation(num_pages).astype(np.int32)
    cursor = 0
    for s in range(sets):
        for b in range(batch):
            for g in range(groups):
                tables[s, b, g, :pages[g]] = perm[cursor:cursor + pages[g]]
                cursor += pages[g]
    shape = (num_pages, GROUP_SIZE, page_size, HEAD_DIM)
    k = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, DTYPE)
    v = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, DTYPE)
    lens = np.broadcast_to(lengths.astype(np.int32), (batch, groups)).copy()
    kv_bytes = 2 * batch * int(lengths.sum()) * GROUP_SIZE * HEAD_DIM * 2
    return k, v, jnp.asarray(tables), lens, kv_bytes


def run_case(rng, batch, context, page_size, num_programs, calls, reps, builtin, config,
             variants=("aot", "uniform", "runtime_planned", "aot_kernel_only")):
    groups = NUM_KV_HEADS // GROUP_SIZE
    q = jax.random.normal(jax.random.key(batch * 7 + context),
                          (calls, batch, groups, NUM_Q_HEADS // groups, HEAD_DIM), DTYPE)
    set_bytes = 2 * batch * int(retained_counts(BUDGETS, context, CHUNK_SIZE).sum()) * \
        GROUP_SIZE * HEAD_DIM * 2
    sets = calls if set_bytes * calls < (2 << 30) else 1
    k, v, tables, lens, kv_bytes = _compressed_case(rng, batch, context, page_size, sets)
    lens_dev = jnp.asarray(lens)
    aot = sm.build_split_map(BUDGETS, num_programs, batch, group_size=GROUP_SIZE,
                             max_splits=1024)
    items = aot.num_items
    uniform = sm.uniform_split_map(1, groups, max(1, items // groups))
    rows = []

    def timed(name, work, host_s=None, extra=None, kernel_only=False):
        """A numpy work list is a constant of the trace (AOT, uniform); a device array is an
        input (runtime planned)."""
        static = isinstance(work, np.ndarray)

        def block(q, k, v, tables, lens, dyn_work):
            w = work if static else dyn_work
            if kernel_only:
                w = jnp.asarray(w)
                return [decode_partials(q[c], k, v, tables[c % sets], lens, w,
                                        interpret=default_interpret(),
                                        **config)[:2] for c in range(calls)]
            return [ragged_paged_decode_attention(q[c], k, v, tables[c % sets], lens,
                                                  work_list=w, **config) for c in range(calls)]
        f = jax.jit(block)
        # Separate arrays per launch (not slices of one stack, which XLA would copy).
        f_args = (list(q), k, v, list(tables), lens_dev, jnp.zeros(1) if static else work)
        t, p10, p90 = wall_quantiles(f, f_args, reps)
        kernels = {}
        gpu = gpu_busy_time(f, f_args, reps, kernels)
        per_call = gpu / calls if gpu else t / calls
        row = dict(variant=name, batch=batch, context=context, page_size=page_size,
                   kernels_s={k: v / calls for k, v in sorted(kernels.items())},
                   items_per_row=int(work.shape[-2]), time_s=per_call,
                   time_source="gpu_busy" if gpu else "wall", wall_time_s=t / calls,
                   wall_p10_s=p10 / calls, wall_p90_s=p90 / calls, bytes=kv_bytes,
                   achieved_bytes_per_s=kv_bytes / per_call)
        if host_s is not None:
            row["host_plan_s_per_layer_step"] = host_s
            row["time_with_host_s"] = per_call + host_s
            row["wall_time_with_host_s"] = t / calls + host_s
        if extra:
            row.update(extra)
        rows.append(row)

    if "aot" in variants:
        timed("aot", aot.work_list(0), extra=dict(splits=list(aot.splits[0]), **config))
    if "aot_kernel_only" in variants:
        timed("aot_kernel_only", aot.work_list(0), kernel_only=True)
    if "uniform" in variants:
        timed("uniform", uniform.work_list(0), extra=dict(splits=list(uniform.splits[0])))
    if "runtime_planned" not in variants:
        return rows
    # Runtime planning: host numpy plan from this step's lengths plus its copy to the device.
    plan = lambda: sm.plan_runtime_work(lens, num_programs, page_size,  # noqa: E731
                                        group_size=GROUP_SIZE, num_items=items)
    for _ in range(20):
        jax.block_until_ready(jax.device_put(plan()))
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        work = jax.device_put(plan())
    jax.block_until_ready(work)
    host_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        plan()
    plan_only = (time.perf_counter() - t0) / n
    timed("runtime_planned", work, host_s=host_s, extra=dict(host_plan_numpy_only_s=plan_only))
    del k, v, tables

    if builtin:
        rows.append(run_builtin(rng, batch, context, page_size, calls, reps, q))
    return rows


def run_builtin(rng, batch, context, page_size, calls, reps, q_grouped):
    """JAX's pallas.ops.gpu.paged_attention over the full, uncompressed cache."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    pages_per_seq = context // page_size
    full_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    sets = calls if full_bytes * calls < (2 << 30) else 1
    num_pages = sets * batch * pages_per_seq
    shape = (NUM_KV_HEADS, num_pages, page_size, HEAD_DIM)
    k = jax.random.normal(jax.random.key(1), shape, DTYPE)
    v = jax.random.normal(jax.random.key(2), shape, DTYPE)
    tables = jnp.asarray(rng.permutation(num_pages).astype(np.int32).reshape(
        sets, batch, pages_per_seq))
    lengths = jnp.full((batch,), context, jnp.int32)
    q = list(q_grouped.reshape(calls, batch, NUM_Q_HEADS, HEAD_DIM))
    k_splits = 16 if pages_per_seq % 16 == 0 else 1

    def block(q, k, v, tables, lengths):
        return [paged_attention(q[c], k, v, tables[c % sets], lengths, k_splits=k_splits)
                for c in range(calls)]
    f, f_args = jax.jit(block), (q, k, v, list(tables), lengths)
    t, p10, p90 = wall_quantiles(f, f_args, reps)
    gpu = gpu_busy_time(f, f_args, reps)
    per_call = gpu / calls if gpu else t / calls
    return dict(variant="jax_builtin_paged_attention", batch=batch, context=context,
                page_size=page_size, k_splits=k_splits, time_s=per_call,
                time_source="gpu_busy" if gpu else "wall", wall_time_s=t / calls,
                wall_p10_s=p10 / calls, wall_p90_s=p90 / calls, bytes=full_bytes,
                achieved_bytes_per_s=full_bytes / per_call)


# Kernel configurations of the sweep (run 8): block_tokens / num_warps / num_stages; with 3+
# stages the kernel carries the next block's page ids so Triton double-buffers the K/V tiles.
# Registers and shared memory per program (Triton 3.6, sm_90a) are in benchmarks/NOTES_decode.md.
SWEEP = (
    dict(block_tokens=64, num_warps=4, num_stages=2),
    dict(block_tokens=32, num_warps=4, num_stages=2),
    dict(block_tokens=32, num_warps=4, num_stages=3),
    dict(block_tokens=32, num_warps=2, num_stages=3),
    dict(block_tokens=16, num_warps=2, num_stages=3),
    dict(block_tokens=16, num_warps=2, num_stages=4),
    dict(block_tokens=64, num_warps=4, num_stages=3),
)
SWEEP_CASES = ((1, 8192), (8, 131072), (64, 32768), (64, 131072))
CHECK_CASE = (4, 32768)           # every swept configuration is checked against the reference


def check_config(rng, page_size, num_programs, config):
    """Relative error of the AOT-map kernel against the jnp reference at a real shape."""
    from tangram_jax.pallas_kernels.decode_attention import \
        ragged_paged_decode_attention_reference as reference
    batch, context = CHECK_CASE
    k, v, tables, lens, _ = _compressed_case(rng, batch, context, page_size, 1)
    groups = NUM_KV_HEADS // GROUP_SIZE
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))),
                          (batch, groups, NUM_Q_HEADS // groups, HEAD_DIM), DTYPE)
    work = sm.build_split_map(BUDGETS, num_programs, batch, group_size=GROUP_SIZE,
                              max_splits=1024).work_list(0)
    lens = jnp.asarray(lens)
    out = ragged_paged_decode_attention(q, k, v, tables[0], lens, work_list=work, **config)
    ref = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                    tables[0], lens)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def sweep_config(rng, page_size, num_programs, calls, reps):
    """AOT time over the Triton configurations on small- and large-batch cases; a
    configuration whose output is off (relative error > 1e-2, bf16) is not eligible."""
    sweep, totals = [], []
    for config in SWEEP:
        total = 0.0
        try:
            err = check_config(rng, page_size, num_programs, config)
            for batch, context in SWEEP_CASES:
                [row] = run_case(rng, batch, context, page_size, num_programs, calls, reps,
                                 False, config, variants=("aot",))
                total += row["time_s"]
                sweep.append(dict(config, batch=batch, context=context, time_s=row["time_s"],
                                  bw_bytes_per_s=row["achieved_bytes_per_s"],
                                  kernels_s=row["kernels_s"], rel_err=err))
                print(f"  B={batch} ctx={context} {row['time_s'] * 1e6:.1f}us "
                      f"kernels={ {k: round(t * 1e6, 1) for k, t in row['kernels_s'].items()} }",
                      flush=True)
        except Exception as e:  # noqa: BLE001 -- a configuration the lowering rejects
            print("sweep", config, f"failed: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        print("sweep", config, f"{total * 1e6:.1f}us rel_err {err:.2e}", flush=True)
        if err < 1e-2:
            totals.append((total, config))
    return min(totals, key=lambda t: t[0])[1], sweep


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-programs", type=int, default=0,
                    help="programs per grid the split maps aim at (0: 4 x SMs)")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--sweep", action="store_true",
                    help="first pick block_tokens/num_warps/num_stages on a few cases")
    ap.add_argument("--config", default="",
                    help="kernel keyword arguments as JSON (default: the kernel's defaults)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-builtin", action="store_true")
    ap.add_argument("--copy-mib", type=int, default=2048)
    add_overwrite_flag(ap)
    args = ap.parse_args(argv)
    outputs = resolve_outputs(ap, args, {"out": "decode_attention"})
    run = start("decode_attention", outputs, argv)
    dev = jax.devices()[0]
    sms = getattr(dev, "core_count", None) or 132
    num_programs = args.num_programs or 4 * sms
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(args.copy_mib)
    print(f"device {dev.device_kind}, SMs {sms}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    result = dict(device=device_description(), num_sms=sms, jax_version=jax.__version__,
                  git_revision=git_revision() or "unknown",
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                  hbm_copy_bytes_per_s=bw, num_programs=num_programs,
                  shape=dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_dim=HEAD_DIM, group_size=GROUP_SIZE, dtype="bfloat16",
                             page_size=args.page_size, chunk_size=CHUNK_SIZE,
                             group_budgets=BUDGETS[0].tolist()),
                  cases=[])
    config = {k: v for k, v in ragged_paged_decode_attention.__kwdefaults__.items()
              if k in ("block_tokens", "num_warps", "num_stages", "heads_per_program")}
    config.update(json.loads(args.config) if args.config else {})
    if args.sweep:
        config, sweep = sweep_config(rng, args.page_size, num_programs, min(args.calls, 4),
                                     min(args.reps, 10))
        result["sweep"] = sweep
    result["kernel_config"] = config
    print("kernel config", config, flush=True)
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            try:
                rows = run_case(rng, batch, context, args.page_size, num_programs, args.calls,
                                args.reps, not args.no_builtin, config)
            except Exception as e:  # noqa: BLE001 -- record and go on (e.g. out of memory)
                print(f"batch {batch} context {context}: {type(e).__name__}: {e}"[:400],
                      flush=True)
                result["cases"].append(dict(batch=batch, context=context,
                                            error=f"{type(e).__name__}: {e}"[:400]))
                continue
            for r in rows:
                r["bw_fraction"] = r["achieved_bytes_per_s"] / bw
                result["cases"].append(r)
            by = {r["variant"]: r for r in rows}
            line = " ".join(f"{v}={by[v]['time_s'] * 1e6:8.1f}us({by[v]['bw_fraction']:.2f})"
                            for v in by)
            print(f"B={batch:3d} ctx={context:6d} {line} "
                  f"host={by['runtime_planned']['host_plan_s_per_layer_step'] * 1e6:.1f}us",
                  flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    finish(run)


if __name__ == "__main__":
    main()
