"""Prefill and decode step times of the new model families' shapes against the device's limits.

A Qwen3-30B-A3B-shaped (mixture of experts, tensor parallel) or Gemma-3-12B-shaped (local +
global layers) model through the engine's `ModelRunner`.

Random bf16 weights (nothing is downloaded), each built where it lives: a weight of a
tensor-parallel runner is generated directly in its shards (`Placement.weight_sharding`), so a
61 GB Qwen3-30B-A3B fits two 80 GB cards. `full` mode (monolithic layout, nothing dropped: the
figures are the model's, not the compression's); every sequence of a decode batch holds a
`--context`-token turn in scattered pages (the `KVCacheManager`, as decode_step_gpu.py).

Timed (median wall ms with block_until_ready, and GPU busy ms from a profiler trace):
- `ModelRunner.decode` at each `--batches` bucket (Pallas decode kernel + AOT split map; local
  layers read their window only; experts as grouped GEMMs, expert-parallel: `ragged_dot`,
  on Hopper JAX's Mosaic GPU kernel from 2048 rows, `models.moe.grouped_matmul`);
- `ModelRunner.prefill` of one `--prefill`-token row after `--prefill-history` tokens of the
  same sequence (default 0; Pallas prefill kernel): a chunk of a long turn, as Mid and Long
  serve them.

Physical limits (per device; `limits`): decode moves at least the weights a step touches (every
dense weight; of the experts, the expected number of distinct experts B x top_k routed tokens
hit, uniform routing; the head) and the KV it reads (global layers: the context, local layers:
their window) at the HBM bandwidth; prefill does at least its FLOPs (2 x active parameters per
token + causal attention, a local layer's within its window) at the dense bf16 peak. Each
figure's `fraction_of_limit` is limit / measured (1 = at the limit).

    GIT_REV=$(git rev-parse HEAD) python benchmarks/families_gpu.py --shape qwen3-30b-a3b --tp 2
    GIT_REV=$(git rev-parse HEAD) python benchmarks/families_gpu.py --shape gemma3-12b
    # CPU smoke tests (small shapes; --tp 2 with XLA_FLAGS=--xla_force_host_platform_device_count=2):
    python benchmarks/families_gpu.py --shape gemma3-tiny --context 256 --prefill 128 --batches 2 --reps 2
    python benchmarks/families_gpu.py --shape qwen3-moe-tiny --tp 2 --context 128 --prefill 64 --batches 2 --reps 2

Writes a fresh file under benchmarks/results/runs/ unless --out names one (a file git tracks only
with --overwrite).
"""

from __future__ import annotations

import argparse
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

from decode_step_gpu import decode_call, fill_manager, measure  # noqa: E402
from tangram_jax.benchmarking.models import FAMILY_SHAPES, family_config, random_decoder  # noqa: E402
from tangram_jax.benchmarking.results import resolve_outputs, write_result  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.engine.config import EngineConfig  # noqa: E402
from tangram_jax.engine import decode_step  # noqa: E402
from tangram_jax.engine.decode_step import _greedy_rows, decode_split_map  # noqa: E402
from tangram_jax.engine.memory import step_peak_bytes  # noqa: E402
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from tangram_jax.engine.tensor_parallel import Placement  # noqa: E402
from tangram_jax.kv_layout import KVLayout  # noqa: E402

PAGE = 16
# (HBM bytes/s, dense bf16 FLOP/s) by device kind (SXM parts; vendor figures without sparsity).
PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}


def weight_bytes(model, dtype) -> dict:
    """Parameter bytes of `model` by kind: experts, embedding, other."""
    sizes = {"experts": 0, "embedding": 0, "other": 0}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        kind = ("experts" if "moe" in names and "router" not in names
                else "embedding" if "embed_tokens" in names else "other")
        sizes[kind] += int(np.prod(var.get_value().shape)) * jnp.dtype(dtype).itemsize
    return sizes


def decode_program_facts(runner: ModelRunner, call, greedy: bool) -> dict:
    """Of the decode step of `call`: the bytes its forward program allocates beyond its donated
    arguments (`memory.step_peak_bytes`: a few MB of activations, unless it copies the pool),
    the conditionals of its two programs, the forward pass and the sampler (each one a
    predicate the host reads back before it launches the rest of the step), and the sampler's
    sorts (the general sampler's vocabulary sort)."""
    args, static = runner._decode_call(runner.k_pages, runner.v_pages, *call.decode_args[:3])
    compiled = runner._decode.lower(*args, **static).compile()
    b = len(call.decode_args[1])
    sampler = runner._sample_rows.lower(
        runner.slot_state, jax.ShapeDtypeStruct((b, runner.config.vocab_size), jnp.float32,
                                                sharding=runner.placement.replicated),
        np.zeros(b, np.int32), _greedy_rows(b), logprobs=None, greedy=greedy).compile()
    return dict(step_extra_bytes=step_peak_bytes(compiled),
                step_conditionals=sum(c.as_text().count(" conditional(")
                                      for c in (compiled, sampler)),
                sampler_sorts=sampler.as_text().count(" sort("))


def limits(config, sizes: dict, batch: int, context: int, prefill: int, tp: int,
           device_kind: str, history: int = 0) -> dict:
    """Lower bounds (ms, per device) of a decode step of `batch` rows at `context` and of a
    prefill of `prefill` tokens after `history` (the module docstring)."""
    bw, flops = next((v for k, v in PEAKS.items() if k in device_kind), (None, None))
    itemsize = 2
    layers, e = config.num_layers, config.moe
    windows = np.array(config.layer_windows)
    kv_token_bytes = 2 * config.num_kv_heads * config.head_dim * itemsize        # K and V
    head_bytes = config.vocab_size * config.hidden_size * itemsize
    dense = sizes["other"] + (head_bytes if config.tie_word_embeddings else 0)
    if e is not None:
        per_expert = sizes["experts"] / (layers * e.num_experts)
        touched = e.num_experts * (1 - (1 - e.top_k / e.num_experts) ** batch)
        expert_bytes = layers * touched * per_expert
        active_expert_params = layers * e.top_k * per_expert / itemsize
    else:
        expert_bytes = active_expert_params = 0.0
    seen = np.where(windows > 0, np.minimum(windows, context), context)
    kv_bytes = batch * int(seen.sum()) * kv_token_bytes
    decode_bytes = (dense + expert_bytes + kv_bytes) / tp
    # Prefill: every non-embedding weight per token (the head once), causal attention.
    params_per_token = (sizes["other"] - (0 if config.tie_word_embeddings else head_bytes)) \
        / itemsize + active_expert_params
    attn_keys = np.where(windows > 0, np.minimum(windows, history + prefill),
                         history + prefill / 2)                              # per query
    attn_flops = 4 * prefill * float(attn_keys.sum()) * config.num_heads * config.head_dim
    prefill_flops = (2 * params_per_token * prefill + 2 * head_bytes / itemsize + attn_flops) / tp
    return dict(hbm_bytes_per_s=bw, bf16_flops_per_s=flops, decode_bytes=decode_bytes,
                decode_kv_bytes=kv_bytes / tp, decode_expert_bytes=expert_bytes / tp,
                prefill_flops=prefill_flops,
                decode_ms=decode_bytes / bw * 1e3 if bw else None,
                prefill_ms=prefill_flops / flops * 1e3 if flops else None)


def measure_prefill(runner, config, args, sizes, kind, prefill_slot, on_gpu) -> dict:
    """`ModelRunner.prefill` of one `--prefill`-token row after `--prefill-history` tokens
    (full mode: every layer and group holds them all; their contents are the pool's), against
    its limit."""
    tokens = np.random.default_rng(args.seed).integers(0, config.vocab_size, args.prefill)
    history = args.prefill_history
    hist = np.full(runner.counts_shape, history, np.int32)
    fig = measure(lambda: runner.prefill([tokens.astype(np.int32)], [history], [prefill_slot],
                                         [hist])[0], args.reps, on_gpu)
    bound = limits(config, sizes, 1, args.context, args.prefill, args.tp, kind, history)
    fig.update(tokens=args.prefill, history=history, limit_ms=bound["prefill_ms"],
               limit_flops=bound["prefill_flops"],
               fraction_of_limit=bound["prefill_ms"] / fig["ms"] if bound["prefill_ms"] else None)
    print(f"prefill {args.prefill} tokens after {history}: {fig['ms']:.3f} ms, limit "
          f"{bound['prefill_ms']}", flush=True)
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(FAMILY_SHAPES), required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill row")
    parser.add_argument("--prefill-history", type=int, default=0,
                        help="tokens of the prefill row's sequence before it (at most --context "
                             "minus --prefill: the row's slot holds --context tokens)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-prefill", action="store_true", help="decode figures only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampler", choices=("engine", "general"), default="engine",
                        help="engine: the engine's choice for the benchmark's greedy rows (each "
                             "row's argmax); general: the sampler a batch with a sampled or "
                             "penalised row runs (every row's penalties and the vocabulary "
                             "sort; greedy rows: the same tokens)")
    parser.add_argument("--trace-dir", default=None,
                        help="also keep a profiler trace (xplane.pb) of 3 decode steps at the "
                             "largest batch here: the timeline of every device")
    parser.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    if not args.no_prefill and not 0 <= args.prefill_history <= args.context - args.prefill:
        parser.error(f"--prefill-history {args.prefill_history}: give 0 to --context minus "
                     f"--prefill ({args.context - args.prefill})")
    out = resolve_outputs(parser, args, {"out": f"families_{args.shape}_tp{args.tp}"})[0]
    config = family_config(args.shape)
    if args.sampler == "general":   # every step takes the general sampler
        sampling_rows = decode_step._sampling_rows
        decode_step._sampling_rows = lambda *a: (sampling_rows(*a)[0], False)
    devices = jax.devices()[:args.tp]
    if len(devices) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices, have {len(jax.devices())}")
    on_gpu = devices[0].platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    t0 = time.perf_counter()
    model = random_decoder(config, dtype, args.seed, Placement(devices))
    sizes = weight_bytes(model, dtype)
    build_s = time.perf_counter() - t0
    layout = KVLayout.monolithic(config.num_layers, config.num_kv_heads, config.head_dim,
                                 page_size=PAGE, chunk_size=args.prefill)
    manager, slots, prefill_slot = fill_manager(layout, max(args.batches), args.context, args.seed)
    num_programs = EngineConfig().num_programs
    split_maps = {b: decode_split_map(layout, config, dtype, num_programs, b,
                                      group_size=layout.group_size // args.tp)
                  for b in args.batches}
    runner = ModelRunner(model, config, layout, manager.pools[0].num_pages,
                         manager.block_tables.shape, split_maps=split_maps,
                         runner_config=RunnerConfig(mode="full",
                                                    max_prefill_tokens=args.prefill),
                         devices=devices)
    runner.update_block_tables(*manager.take_table_updates())
    print(f"{args.shape}: {sum(sizes.values()) / 1e9:.1f} GB of weights built in {build_s:.0f} s "
          f"on {args.tp} device(s); attention {runner.ops.name}", flush=True)
    kind = devices[0].device_kind

    decode = []
    for b in args.batches:
        rows = slots[:b]
        call = decode_call(runner, rows, manager.lengths[rows] - 1, args.context)
        fig = measure(call, args.reps, on_gpu)
        fig.update(decode_program_facts(runner, call, args.sampler == "engine"))
        bound = limits(config, sizes, b, args.context, args.prefill, args.tp, kind)
        fig.update(batch=b, limit_ms=bound["decode_ms"], limit_bytes=bound["decode_bytes"],
                   kv_bytes=bound["decode_kv_bytes"], expert_bytes=bound["decode_expert_bytes"],
                   fraction_of_limit=bound["decode_ms"] / fig["ms"] if bound["decode_ms"]
                   else None)
        decode.append(fig)
        print(f"decode batch {b}: {fig['ms']:.3f} ms, limit {bound['decode_ms']}", flush=True)
    if args.trace_dir:
        jax.profiler.start_trace(args.trace_dir)
        for _ in range(3):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()

    fig = None if args.no_prefill else measure_prefill(runner, config, args, sizes, kind,
                                                         prefill_slot, on_gpu)
    write_result(out, "families_gpu", dict(
        model=dict(FAMILY_SHAPES[args.shape], shape=args.shape, dtype=str(jnp.dtype(dtype)),
                   weight_bytes=sizes, random_weights=True, layer_windows=config.layer_windows),
        tensor_parallel_size=args.tp, sampler=args.sampler, device_kind=kind, peaks=PEAKS,
        page_size=PAGE,
        context_tokens=args.context, layer_loop=runner.layer_loop, model_build_s=build_s,
        what_is_timed="ModelRunner.decode per batch bucket (full mode) and ModelRunner.prefill "
                      "of one row after `prefill.history` tokens; `ms` is GPU busy time when "
                      "the profiler saw GPU events, else median wall time",
        decode=decode, prefill=fig))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
