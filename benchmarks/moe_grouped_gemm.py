"""MoE expert GEMMs on a Hopper GPU: XLA's `ragged_dot` against JAX's Mosaic GPU grouped GEMM.

The kernel is `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`.

One MoE layer's two grouped GEMMs (rows sorted by expert, as `models.moe.expert_outputs`):
`x_sorted [N k, D] @ gate_up [E, D, 2I]` and `act [N k, I] @ down [E, I, D]`, random bf16,
uniform random top-k routing, for each `--tokens` count N. Per implementation: median GPU busy
ms, max |difference| from `lax.ragged_dot` relative to its largest output, and the fraction of
the physical limit: max(bytes of the experts the rows touch at the measured copy bandwidth,
FLOPs at the bf16 peak of the spec sheet) / measured. The Mosaic kernel's tiling is swept
(`CONFIGS`); the best valid one is reported beside every one tried.

`--partial` also checks the case tensor parallelism produces: the group sizes sum to fewer
rows than the lhs has (copies routed to another device's experts sort past the last group);
`lax.ragged_dot` writes zeros there, the Mosaic kernel's rows there are reported as found.

    GIT_REV=$(git rev-parse HEAD) python benchmarks/moe_grouped_gemm.py --out $OUT/moe.json
    # Qwen3-30B-A3B at TP=2 holds 64 of its 128 experts a card (the default shape).

Writes a fresh file under benchmarks/results/runs/ unless --out names one (a file git tracks only
with --overwrite).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tangram_jax.benchmarking.results import resolve_outputs, write_result  # noqa: E402
from tangram_jax.benchmarking.timing import busy_or_wall, gpu_busy_time  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from decode_attention import copy_bandwidth  # noqa: E402

BF16_PEAK = {"H100": 989e12, "H200": 989e12}
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
CONFIGS = [(64, 128, 64, 4, 1), (128, 128, 64, 4, 1), (64, 128, 64, 4, 2),
           (128, 128, 64, 4, 2), (128, 64, 64, 4, 1), (64, 64, 64, 4, 1), (128, 128, 64, 2, 1)]


def routed_rows(key, tokens: int, experts: int, top_k: int):
    """Expert ids of the N k token copies sorted by expert, and each expert's row count [E]."""
    choice = jnp.argsort(jax.random.uniform(key, (tokens, experts)), axis=1)[:, :top_k]
    flat = jnp.sort(choice.reshape(-1))
    return flat, jnp.zeros((experts,), jnp.int32).at[flat].add(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64, help="experts on this device")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--partial", action="store_true", default=True)
    p.add_argument("--layer-only", action="store_true",
                   help="only `layer_cases` (the engine's expert_outputs against XLA's)")
    p.add_argument("--out", default=None)
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    out = resolve_outputs(p, args, {"out": "moe_grouped_gemm"})[0]
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    dev = jax.devices()[0]
    peak = next((v for k, v in BF16_PEAK.items() if k in dev.device_kind), None)
    bw = copy_bandwidth()
    e, d, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = (jax.random.normal(keys[0], (e, d, 2 * i), jnp.float32) * d ** -0.5
               ).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[1], (e, i, d), jnp.float32) * i ** -0.5).astype(jnp.bfloat16)
    expert_bytes = (d * 2 * i + i * d) * 2
    result = dict(device_kind=dev.device_kind, copy_bandwidth_bytes_per_s=bw,
                  bf16_peak_flops_per_s=peak, experts=e, top_k=k, hidden=d, intermediate=i,
                  limit="max(touched experts' bytes / copy bandwidth, FLOPs / bf16 peak)",
                  cases=[])
    for n in [] if args.layer_only else args.tokens:
        ids, sizes = routed_rows(keys[2], n, e, k)
        rows = n * k
        x = jax.random.normal(keys[3], (rows, d), jnp.float32).astype(jnp.bfloat16)
        a = jax.random.normal(keys[3], (rows, i), jnp.float32).astype(jnp.bfloat16)
        touched = int((sizes > 0).sum())
        flops = 2 * rows * (d * 2 * i + i * d)
        limit_s = max(touched * expert_bytes / bw, flops / peak if peak else 0.0)

        def both(dot):   # the weights are arguments: closed over, they compile as constants
            f = jax.jit(lambda x, a, s, w1, w2: (dot(x, w1, s), dot(a, w2, s)))
            return lambda x, a, s: f(x, a, s, gate_up, down)

        ref_fn = both(lambda l, r, s: jax.lax.ragged_dot(l, r, s))
        ref = ref_fn(x, a, sizes)
        scale = [float(jnp.abs(r.astype(jnp.float32)).max()) for r in ref]
        case = dict(tokens=n, rows=rows, experts_touched=touched, flops=flops,
                    limit_ms=limit_s * 1e3, impls={})
        t = gpu_busy_time(ref_fn, (x, a, sizes), args.reps)
        case["impls"]["lax.ragged_dot"] = dict(ms=t * 1e3, fraction_of_limit=limit_s / t)
        tried = {}
        for cfg in CONFIGS:
            bm, bn, bk, steps, gbn = cfg
            name = f"mgpu bm{bm} bn{bn} bk{bk} s{steps} g{gbn}"
            if (2 * i) % (bn * gbn) or d % (bn * gbn) or d % bk or i % bk:
                continue
            tiling = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
                          grid_block_n=gbn)
            fn = both(functools.partial(
                lambda l, r, s, **kw: ragged_dot_mgpu.ragged_dot(l, r, group_sizes=s, **kw),
                **tiling))
            try:
                got = fn(x, a, sizes)
                err = max(float(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)).max()) / s
                          for g, r, s in zip(got, ref, scale))
                t = gpu_busy_time(fn, (x, a, sizes), args.reps)
                tried[name] = dict(ms=t * 1e3, fraction_of_limit=limit_s / t,
                                   max_rel_diff=err, tiling=tiling)
            except Exception as ex:   # a tiling the kernel refuses (shared memory, shapes)
                tried[name] = dict(error=f"{type(ex).__name__}: {str(ex)[:200]}")
            print(n, name, tried[name], flush=True)
        ok = {kk: v for kk, v in tried.items() if "ms" in v and v["max_rel_diff"] < 2e-2}
        if ok:
            best = min(ok, key=lambda kk: ok[kk]["ms"])
            case["impls"]["mgpu best"] = dict(ok[best], name=best)
        case["mgpu_tried"] = tried
        if args.partial and ok:
            half = sizes.at[e // 2:].set(0)           # the other half's rows sort past the end
            used = int(half.sum())
            got = ragged_dot_mgpu.ragged_dot(x, gate_up, group_sizes=half, **ok[best]["tiling"])
            want = jax.lax.ragged_dot(x, gate_up, half)
            tail = np.asarray(got[used:].astype(jnp.float32))
            case["partial_groups"] = dict(
                rows_grouped=used, rows_past=rows - used,
                grouped_rows_max_rel_diff=float(jnp.abs(got[:used].astype(jnp.float32)
                                                        - want[:used].astype(jnp.float32)).max())
                / scale[0],
                rows_past_all_zero=bool((tail == 0).all()),
                rows_past_all_finite=bool(np.isfinite(tail).all()))
        print(n, {kk: v for kk, v in case.items() if kk != "mgpu_tried"}, flush=True)
        result["cases"].append(case)
        write_result(out, "moe_grouped_gemm", result)
    result["expert_outputs"] = layer_cases(args, gate_up, down)
    write_result(out, "moe_grouped_gemm", result)
    print(f"wrote {out}")


def layer_cases(args, gate_up, down) -> list[dict]:
    """`models.moe.expert_outputs` as the engine runs it (`grouped_matmul`: the Mosaic kernel
    where `mosaic_tiling` picks it) against the same function on `lax.ragged_dot`, on a device
    holding the first `--experts` of twice as many (TP=2's device 0: half the copies sort past
    its last group): outputs' max |difference| relative to the largest, and GPU busy ms."""
    from tangram_jax.models import moe
    from tangram_jax.models.config import MoEConfig
    e, k = args.experts, args.top_k
    config = MoEConfig(num_experts=2 * e, top_k=k, intermediate_size=args.intermediate)
    run = jax.jit(functools.partial(moe.expert_outputs, config=config, sharded=False))
    cases = []
    for n in args.tokens:
        keys = jax.random.split(jax.random.key(n), 3)
        x = jax.random.normal(keys[0], (n, args.hidden), jnp.float32).astype(jnp.bfloat16)
        weights = jax.random.uniform(keys[1], (n, k)).astype(jnp.bfloat16)
        experts = jnp.argsort(jax.random.uniform(keys[2], (n, 2 * e)), axis=1)[:, :k]
        call = (x, weights, experts.astype(jnp.int32), gate_up, down, ())
        got = run(*call)
        tiling = moe.mosaic_tiling(n * k, args.hidden, 2 * args.intermediate, jnp.bfloat16,
                                   jax.devices()[0].device_kind)
        t_auto = busy_or_wall(run, call, args.reps)
        auto = moe.grouped_matmul
        moe.grouped_matmul = lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes)
        try:
            xla = jax.jit(functools.partial(moe.expert_outputs, config=config, sharded=False))
            want = xla(*call)
            t_xla = busy_or_wall(xla, call, args.reps)
        finally:
            moe.grouped_matmul = auto
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        diff = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()) / scale
        cases.append(dict(tokens=n, mosaic_tiling=tiling, engine_ms=t_auto * 1e3,
                          xla_ragged_dot_ms=t_xla * 1e3, speedup=t_xla / t_auto,
                          max_rel_diff=diff, finite=bool(jnp.isfinite(got).all())))
        print("expert_outputs", cases[-1], flush=True)
    return cases


if __name__ == "__main__":
    main()
