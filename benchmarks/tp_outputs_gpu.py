"""Greedy outputs of a tensor-parallel engine against one device's, on the devices at hand.

For each mode, the same prompts (random token ids) are completed greedily by an engine with
`tensor_parallel_size=1` and one with `--tp` devices, in the same process, and compared token by
token. A row that diverges records where, and the one-device engine's margin there (the log-prob
gap between its top two tokens): a divergence at a near-tie is rounding (each shard's kernels
add in another order than one device's; all-reducing the partial sums in float32 did not
change that), one at a wide margin is a bug. The CPU suite checks the same on two CPU devices
in float32 (tests/engine/test_tensor_parallel.py); this is the GPU's bfloat16 run.

    python3 benchmarks/tp_outputs_gpu.py --model random-llama-8b --tp 2 --out /tmp/tp.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram_jax.benchmarking.models import (RANDOM_8B, RANDOM_TINY,  # noqa: E402
                                              random_model_config, random_model_source)
from tangram_jax.benchmarking.results import (finish, resolve_outputs, start,  # noqa: E402
                                               write_result)
from tangram_jax.benchmarking.serve import variant_config  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402


def complete(fields: dict, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt's greedy tokens and, per token, the engine's top-2 log-probs."""
    from tangram_jax import LLM, SamplingParams
    llm = LLM(**fields)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        top2 = [sorted(step.values(), key=lambda lp: lp.rank)[:2]
                for step in o.outputs[0].logprobs]
        rows.append(dict(tokens=list(o.outputs[0].token_ids),
                         chosen=[t[0].logprob for t in top2],
                         margin=[t[0].logprob - t[1].logprob for t in top2]))
    del llm
    return rows


def compare(one: list[dict], many: list[dict]) -> dict:
    """Rows equal, each diverging row's first differing step and the one-device margin there,
    and the largest chosen-token log-prob difference before any divergence."""
    diverged, diffs = [], [0.0]
    for i, (a, b) in enumerate(zip(one, many)):
        same = [x == y for x, y in zip(a["tokens"], b["tokens"])]
        first = same.index(False) if False in same else None
        upto = len(same) if first is None else first
        diffs.extend(abs(x - y) for x, y in zip(a["chosen"][:upto], b["chosen"][:upto]))
        if first is not None:
            diverged.append(dict(row=i, step=first, margin_one_device=a["margin"][first]))
    return dict(rows=len(one), rows_equal=len(one) - len(diverged), diverged=diverged,
                max_chosen_logprob_diff=float(max(diffs)),
                median_margin=float(np.median([m for r in one for m in r["margin"]])))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=(RANDOM_8B, RANDOM_TINY), default=RANDOM_8B)
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_size against 1")
    p.add_argument("--modes", default="full,tangram,dynamic")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    for name in ("tp", "prompts", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("full", "tangram", "dynamic"):
            p.error(f"--modes: {m!r} is not one of full, tangram, dynamic")
    outputs = resolve_outputs(p, args, {"out": f"tp_outputs_tp{args.tp}"})
    run = start("tp_outputs_gpu", outputs, argv)
    config = random_model_config(args.model)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, config.vocab_size, args.prompt_tokens).tolist()
               for _ in range(args.prompts)]
    results = {}
    for mode in modes:
        base = dict(variant_config(mode, config, 2, 0.25, profile_seed=args.seed),
                    model=random_model_source(args.model), max_num_seqs=args.prompts,
                    max_model_len=args.prompt_tokens + args.max_tokens + 64,
                    kv_cache_tokens=args.prompts * (args.prompt_tokens + args.max_tokens + 64))
        runs = {tp: complete(dict(base, tensor_parallel_size=tp), prompts, args.max_tokens)
                for tp in (1, args.tp)}
        results[mode] = compare(runs[1], runs[args.tp])
        print(mode, {k: v for k, v in results[mode].items() if k != "diverged"},
              results[mode]["diverged"][:4], flush=True)
    write_result(args.out, "tp_outputs_gpu", dict(
        model=args.model, tensor_parallel_size=args.tp,
        prompts=args.prompts, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
        results=results,
        all_equal=all(r["rows_equal"] == r["rows"] for r in results.values())), argv)
    print(f"wrote {args.out} in {finish(run):.0f} s")


if __name__ == "__main__":
    main()
