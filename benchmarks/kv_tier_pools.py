"""Precision tiers save memory: K8V4 against K8V4-K4V2 pools in one GPU budget.

One GPU budget sized for ``tangram+k8v4`` and for ``tangram+k8v4-k4v2`` pages, then the same
pool-bound multi-turn workload on both.

The model: the Llama-3.1-8B shape with random bf16 weights (`benchmarking.models`), tangram mode
with `bench serve`'s skewed profile (seeded; synthetic tier budgets, high share 0.5), the pool
sized by `gpu_memory_utilization` (the engine's memory plan: weights, the largest step and
headroom come off the budget; with tiers the bytes buy pages of both tiers split by the high
tier's share of the retained tokens, `memory.TieredPool`). Each configuration is built and
served by `benchmarking.serve.run_variant` (what `bench serve` runs), so the rows carry its
figures (turns/s, TTFT, evictions, recompute, peak use of the fullest tier's pool) next to the
pool's pages, bytes, head-token slots and each tier's share.

    python benchmarks/kv_tier_pools.py --out $OUT/kv_tier_pools.json

On a CPU (no allocator cap) the pool comes from --kv-cache-tokens instead (the same slots in
both, the tiered pool in fewer bytes): a smoke run of the same code path,

    python benchmarks/kv_tier_pools.py --model random-tiny --kv-cache-tokens 2048 \\
        --sessions 2 --context-tokens 200 --answer-tokens 4 --out /tmp/kv_tier_pools.json

Not yet run on a GPU. Expected there (H100, 0.3 of the card): both configurations fill the budget
(pool bytes within 3%), the tiered pool holds 1.25-1.30x K8V4's slots (bytes a slot 0.77x at the
synthetic high share 0.5: 164 / 216 B), so fewer evictions and less recompute on this workload.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag
sys.path.insert(0, ROOT)

VARIANTS = ("tangram+k8v4", "tangram+k8v4-k4v2")


def main(argv=None) -> None:
    from tangram_jax.benchmarking.models import RANDOM_8B, RANDOM_TINY

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=RANDOM_8B, choices=(RANDOM_8B, RANDOM_TINY))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="the budget both configurations are sized under (GPU)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="fix the pool's slots instead (a CPU, which reports no allocator)")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=32768)
    parser.add_argument("--followups", type=int, default=1)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    outputs = resolve_outputs(parser, args, {"out": "kv_tier_pools"})
    run = start("kv_tier_pools", outputs, argv)

    from tangram_jax.benchmarking import serve
    from tangram_jax.benchmarking.models import random_model, random_model_config
    from tangram_jax.benchmarking.results import write_result
    from tangram_jax.benchmarking.workload import SessionSpec

    model_config = random_model_config(args.model)
    spec = SessionSpec(num_sessions=args.sessions, context_tokens=args.context_tokens,
                       followups=args.followups, answer_tokens=args.answer_tokens)
    fields = dict(max_num_seqs=args.max_num_seqs,
                  max_model_len=spec.session_tokens() + 64,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_tokens=args.kv_cache_tokens)
    report = {"model": args.model, "ratio": args.ratio, "group_size": args.group_size,
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "kv_cache_tokens": args.kv_cache_tokens, "engine_fields": fields,
              "workload": {"sessions": spec.num_sessions, "context_tokens": spec.context_tokens,
                           "followups": spec.followups, "answer_tokens": spec.answer_tokens},
              "results": []}
    for variant in VARIANTS:
        result, = serve.run_variant(variant, lambda: random_model(args.model), model_config,
                                    fields, [("pool-bound", spec)], args.group_size, args.ratio,
                                    profile_seed=0)
        report["results"].append(result)
        write_result(args.out, "kv_tier_pools", report, ["python", *sys.argv])
    k8v4, tiered = report["results"]
    report["tiered_over_k8v4"] = {
        "pool_bytes": tiered["pool_bytes"] / k8v4["pool_bytes"],
        "pool_slots": tiered["pool_slots"] / k8v4["pool_slots"],
        "bytes_per_slot": (tiered["pool_bytes"] / tiered["pool_slots"])
        / (k8v4["pool_bytes"] / k8v4["pool_slots"]),
        "turns_per_s": tiered["workloads"][0]["turns_per_s"]
        / k8v4["workloads"][0]["turns_per_s"],
    }
    write_result(args.out, "kv_tier_pools", report, ["python", *sys.argv])
    finish(run)
    print({k: round(v, 3) for k, v in report["tiered_over_k8v4"].items()}, flush=True)


if __name__ == "__main__":
    main()
