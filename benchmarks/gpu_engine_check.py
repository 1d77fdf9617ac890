"""The engine on a GPU with the Pallas kernels: dense-reference equality, then every mode.

Correctness, then all modes timed in one run.

No weights travel to the GPU machine: a Llama-architecture model with random weights is built
there with `transformers` and saved as a Hugging Face folder (the tokenizer is the embedded
SmolLM2's, saved from this machine into --tokenizer-dir). Then:

1. correctness: greedy tokens of the dense reference path, `full` mode and `tangram` mode with
   every budget 1 (heads permuted) must agree (float32);
2. serving: `full`, `dynamic` and `tangram` (a skewed per-head profile averaging --ratio) serve the
   same multi-turn workload with the same pool bytes, bf16; throughput, pool use and reclaim time;
   `tangram-sync` is tangram without asynchronous scheduling (what the overlap buys), `tangram-scan`
   tangram with the layers under lax.scan over stacked weights (what unrolling buys).

Writes `--out` (default a fresh file under benchmarks/results/runs/; the committed
gpu_engine.json only with --overwrite) (device, git revision, command, every mode in the same
run, ratios against full KV).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from tangram_jax.benchmarking.workload import skewed_profile
from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag
from tangram_jax.provenance import device_description, git_revision


def build_model(folder: Path, tokenizer_dir: Path, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():   # a peaked output distribution makes greedy ties unlikely
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(2.0)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def identity_profile(model_config, group_size: int):
    from tangram_jax.compression.profile import BudgetProfile
    layers, heads = model_config.num_layers, model_config.num_kv_heads
    ones = np.ones((layers, heads))
    return BudgetProfile(model=dict(model_config.fingerprint(), name="random-llama"),
                         method="snapkv", rho=1.0, lambda_=2.0, mean=ones, std=0 * ones,
                         budget=ones, group_size=group_size, grouping="budget",
                         head_perm=np.tile(np.arange(heads)[::-1], (layers, 1)),
                         group_budgets=np.ones((layers, heads // group_size)))


def check_correctness(folder: Path, args) -> dict:
    from tangram_jax.llm import LLM
    from tangram_jax.models.registry import load_model
    from tangram_jax.reference import generate_dense
    from tangram_jax.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 49152, n)) for n in (5, 77, 300, 1000)]
    prompts = [[int(t) for t in p] for p in prompts]
    small = dict(max_num_seqs=4, kv_cache_tokens=8192, chunk_size=128, page_size=16,
                 max_num_batched_tokens=512, max_model_len=4096, dtype="float32")
    loaded = load_model(str(folder))
    dense = generate_dense(loaded.model, loaded.config, prompts, params)
    full_llm = LLM(str(folder), mode="full", **small)
    assert full_llm.engine.runner.ops.name == "pallas", full_llm.engine.runner.ops.name
    full = [o.outputs[0].token_ids for o in full_llm.generate(prompts, params, use_tqdm=False)]
    tangram_llm = LLM(str(folder), mode="tangram", group_size=args.group_size,
                      profile=identity_profile(loaded.config, args.group_size), **small)
    tangram = [o.outputs[0].token_ids for o in tangram_llm.generate(prompts, params, use_tqdm=False)]

    def agree(a, b):
        return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / sum(map(len, a))
    return {"full_equals_dense": full == dense, "tangram_rho1_equals_dense": tangram == dense,
            "token_agreement_full_vs_dense": agree(full, dense),
            "token_agreement_tangram_vs_dense": agree(tangram, dense)}


def serve(folder: Path, variant: str, args) -> dict:
    """Serve the workload with `variant`: a mode, optionally with suffixes: ``-sync`` without
    asynchronous scheduling (the host waits for every step's tokens), ``-scan`` with the layers
    under `lax.scan` over stacked weights instead of unrolled, ``-rows4`` with up to 4 prefill
    chunks of different sequences per call."""
    from tangram_jax.llm import LLM
    from tangram_jax.models.registry import load_model
    from tangram_jax.sampling import SamplingParams

    config = load_model(str(folder)).config
    kwargs = dict(max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                  chunk_size=args.chunk_size, page_size=16, max_model_len=8192,
                  max_num_batched_tokens=args.max_num_seqs + 2 * args.chunk_size,
                  dtype="bfloat16", ratio=args.ratio,
                  async_scheduling="-sync" not in variant,
                  layer_loop="scan" if "-scan" in variant else None,
                  max_prefill_rows=4 if "-rows4" in variant else 1)
    mode = variant.split("-")[0]
    if mode == "tangram":
        kwargs.update(profile=skewed_profile(config, args.group_size, args.ratio),
                      group_size=args.group_size)
    rng = np.random.default_rng(2)
    warm = [[int(t) for t in rng.integers(3, 49152, 64)] for _ in range(args.max_num_seqs)]
    # The engine compiles every step shape while it is built (warmup=True), then a throwaway
    # batch runs: nothing compiles in the timed region.
    t_warm = time.perf_counter()
    llm = LLM(str(folder), mode=mode, warmup=True, **kwargs)
    engine = llm.engine
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    warmup_seconds = time.perf_counter() - t_warm
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.tokens_processed = 0
    generated, peak = 0, 0.0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for i in range(args.conversations):
            n = int(rng.integers(args.min_prompt, args.max_prompt))
            engine.add_request(request_id=f"c{i}-t{turn}", sampling_params=params,
                               prompt_token_ids=[int(t) for t in rng.integers(3, 49152, n)],
                               session_id=f"c{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            peak = max(peak, engine.manager.fullest_pool_use)
    import jax
    jax.block_until_ready(engine.runner.k_pages)
    elapsed = time.perf_counter() - t0
    usage = engine.kv_usage()
    sched = usage["scheduler"]
    return {"mode": variant, "async_scheduling": kwargs["async_scheduling"],
            "layer_loop": engine.runner.layer_loop,
            "max_prefill_rows": engine.config.max_prefill_rows,
            "build_and_warmup_seconds": warmup_seconds,   # model load, compiles, a batch
            "seconds": elapsed, "generated_tokens": generated,
            "output_tokens_per_s": generated / elapsed,
            "processed_tokens_per_s": usage["tokens_processed"] / elapsed,
            "pool_pages": int(np.sum(engine.manager.capacity)),   # every tier's usable pages
            "peak_pool_utilisation": peak,                      # of the fullest tier's pool
            "kv_memory_vs_full_end": usage["kv_bytes_held"] / max(usage["full_kv_bytes"], 1),
            "preemptions": sched["preemptions"], "evictions": sched["evictions"],
            "pages_reclaimed": usage["pages_reclaimed"], "reclaim_seconds": usage["reclaim_seconds"],
            "host_ms_per_step_median": sched["host_ms_per_step_median"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--min-prompt", type=int, default=1000)
    p.add_argument("--max-prompt", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=60000)
    p.add_argument("--modes", default="full,dynamic,tangram,tangram-sync",
                   help="modes to serve; suffix -sync: without asynchronous scheduling; -scan: layers "
                        "under lax.scan; -rows4: 4 prefill chunks per call")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "gpu_engine_check"})
    run = start("gpu_engine_check", outputs, argv)
    folder = Path("/tmp/tangram_random_llama")
    build_model(folder, Path(args.tokenizer_dir), args)
    report = {"benchmark": "gpu_engine", "device": device_description(), "git_revision": git_revision() or "unknown",
              "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
              "config": vars(args)}
    if not args.skip_correctness:
        report["correctness"] = check_correctness(folder, args)
        print("correctness:", report["correctness"], flush=True)
    results = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        results.append(serve(folder, mode, args))
        print(results[-1], flush=True)
        base = next((r for r in results if r["mode"] == "full"), None)
        for r in results:
            if base:
                r["throughput_vs_full"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        report["results"] = results
        Path(args.out).write_text(json.dumps(report, indent=2))   # after every mode
    finish(run)
    print(f"{'mode':9} {'out tok/s':>10} {'vs full':>8} {'peak pool':>10} {'preempt':>8} {'evict':>6} {'reclaim s':>10}")
    for r in results:
        print(f"{r['mode']:9} {r['output_tokens_per_s']:10.1f} {r.get('throughput_vs_full', 1):8.2f} "
              f"{r['peak_pool_utilisation']:10.2f} {r['preemptions']:8d} {r['evictions']:6d} {r['reclaim_seconds']:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
