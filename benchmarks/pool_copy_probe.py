"""Whether the compiled 8B steps copy the KV pool, at pool sizes over JAX's allocator cap.

Temp and aliased bytes of each compiled step.

Compiles (never runs, never allocates the pool) the engine's decode and prefill steps with the
pool given as abstract arrays, at a pool size whose arguments exceed JAX's default allocator cap
(as in the issue) and at a small one, with XLA's rematerialization pass on (JAX's default) and
off, and prints each compiled program's temp bytes, aliased bytes and the pool-shaped copies in
its optimized HLO. Few layers by default: the arguments are made large by the pool alone.

    python benchmarks/pool_copy_probe.py --layers 4 --pool-gib 30
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tangram_jax.benchmarking.models import LLAMA_8B, model_config  # noqa: E402
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.kv_layout import KVLayout  # noqa: E402
from tangram_jax.models.decoder import Decoder  # noqa: E402
from tangram_jax.pallas_kernels.split_map import build_split_map  # noqa: E402


START = time.perf_counter()


def pool_copies(hlo: str, shape: str) -> list[str]:
    return [line.strip()[:240] for line in hlo.splitlines()
            if shape in line.split("=", 1)[-1][:80] and re.search(r"\bcopy\(|copy-start", line)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pool-gib", type=float, default=30.0, help="bytes of ONE pool array (K or V)")
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    p.add_argument("--budget-s", type=float, default=1e9)
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "pool_copy_probe"})
    run = start("pool_copy_probe", outputs, argv)
    from jax._src import xla_bridge
    print("jax", jax.__version__, "backends_are_initialized" in dir(xla_bridge), flush=True)
    dev = jax.devices()[0]
    print(dev, json.dumps(dev.memory_stats()), flush=True)
    shape = dict(LLAMA_8B, num_layers=args.layers)
    config = model_config(shape)
    layout = KVLayout.monolithic(args.layers, 8, 128, page_size=16, chunk_size=256)
    t0 = time.perf_counter()
    model = Decoder(config, jnp.bfloat16, rngs=nnx.Rngs(0))
    max_pages = 8192 // 16
    table_shape = (args.bucket + 1, args.layers, 1, max_pages)
    split_maps = {args.bucket: build_split_map(layout.group_budgets, 528, args.bucket,
                                               group_size=8)}
    runner = ModelRunner(model, config, layout, 2, table_shape, split_maps=split_maps,
                         runner_config=RunnerConfig(mode="full"))
    print(f"built in {time.perf_counter() - t0:.1f} s; ops {runner.ops.name}, loop "
          f"{runner.layer_loop}; stats {json.dumps(dev.memory_stats())}", flush=True)
    page_bytes = 8 * 16 * 128 * 2
    results = []
    b = args.bucket
    for pages in (int(args.pool_gib * 2**30 / page_bytes), 4096):
        if time.perf_counter() - START > args.budget_s:
            break
        pool = jax.ShapeDtypeStruct((pages, 8, 16, 128), jnp.bfloat16)
        shape_str = f"bf16[{pages},8,16,128]"
        for remat in (True, False):
            options = {} if remat else {"xla_disable_hlo_passes": "rematerialization"}
            dec = (*runner.weight_args, pool, pool, runner.slot_state,
                   np.zeros(b, np.int32), runner.block_tables, np.zeros(b, np.int32),
                   np.zeros((b, args.layers, 1), np.int32))
            pre = (*runner.weight_args, pool, pool, np.zeros((1, 256), np.int32),
                   np.zeros(1, np.int32), np.ones(1, np.int32), runner.block_tables,
                   np.zeros(1, np.int32), np.zeros((1, args.layers, 1), np.int32),
                   np.ones((1, args.layers, 1), np.int32))
            for name, fn, a, kw in (("decode", runner._decode, dec, dict(split_map=split_maps[b])),
                                    ("prefill", runner._prefill, pre, {})):
                t0 = time.perf_counter()
                try:
                    c = fn.lower(*a, **kw).compile(compiler_options=options)
                except Exception as e:  # noqa: BLE001
                    print(name, pages, remat, "FAILED", repr(e)[:400], flush=True)
                    continue
                m = c.memory_analysis()
                hlo = c.as_text()
                row = dict(step=name, pool_pages=pages, pool_array_gib=pages * page_bytes / 2**30,
                           remat=remat, compile_s=round(time.perf_counter() - t0, 1),
                           temp_gib=m.temp_size_in_bytes / 2**30,
                           alias_gib=m.alias_size_in_bytes / 2**30,
                           arg_gib=m.argument_size_in_bytes / 2**30,
                           out_gib=m.output_size_in_bytes / 2**30,
                           pool_copies=pool_copies(hlo, shape_str)[:6])
                results.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    finish(run)


if __name__ == "__main__":
    main()
