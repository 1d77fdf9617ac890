"""Every mode's outputs on fixed requests, to show a restructuring changed no token (CPU).

Serves the same requests with eight engine configurations on the embedded SmolLM2 (full;
tangram 0.5, retention "turn"; tangram 0.25, retention "chunk"; dynamic 0.5; tangram+k8v4;
tangram+k8v4-k4v2; two prefill rows a call; full without asynchronous scheduling), chunk 64 so
that prompts span several chunks: three greedy prompts; two prompts with n=3 seeded sampling at
temperature 0.8, logprobs 3, prompt_logprobs 2, presence and repetition penalties; a 2-turn chat.
Writes every token id, log-probability (3 decimals) and prompt log-probability. `--compare A B`
says which configurations and fields differ between two such files (exit 1 if any).

    python benchmarks/output_fingerprint.py --out before.json      # at the old revision
    python benchmarks/output_fingerprint.py --out after.json       # at the new one
    python benchmarks/output_fingerprint.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import (  # noqa: E402
    finish, resolve_outputs, start, write_result)
from tangram_jax.commands import add_overwrite_flag  # noqa: E402

CONFIGS = [
    dict(mode="full"),
    dict(mode="tangram", ratio=0.5),
    dict(mode="tangram", ratio=0.25, retention="chunk"),
    dict(mode="dynamic", ratio=0.5),
    dict(mode="tangram", ratio=0.5, kv_precision="k8v4"),
    dict(mode="tangram", ratio=0.5, kv_precision="k8v4-k4v2"),
    dict(mode="tangram", ratio=0.5, max_prefill_rows=2),
    dict(mode="full", async_scheduling=False),
]
ESSAY = ("The old lighthouse keeper wrote in his log every evening about the ships, the weather "
         "and the birds that nested on the rocks below the lamp. ")


def prompts() -> list[str]:
    return [ESSAY * (3 + i) + f"The secret code is {31415 + 1111 * i}. " + ESSAY * 4 +
            "What is the secret code? The secret code is" for i in range(3)]


def fingerprint(config: dict) -> dict:
    """One configuration's outputs on the fixed requests."""
    from tangram_jax import LLM, SamplingParams
    llm = LLM(chunk_size=64, max_num_seqs=8, seed=0, **config)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    out = {"greedy": [list(o.outputs[0].token_ids)
                      for o in llm.generate(prompts(), greedy, use_tqdm=False)]}
    sampled = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, logprobs=3,
                             prompt_logprobs=2, presence_penalty=0.5, repetition_penalty=1.1)
    outs = llm.generate(prompts()[:2], sampled, use_tqdm=False)
    out["sampled"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
    out["sampled_logprobs"] = [[[round(float(d[t].logprob), 3)
                                 for d, t in zip(c.logprobs, c.token_ids)]
                                for c in o.outputs] for o in outs]
    out["prompt_logprobs"] = [[None if d is None else
                               round(float(max(v.logprob for v in d.values())), 3)
                               for d in o.prompt_logprobs] for o in outs]
    conv = [{"role": "user", "content": prompts()[1]}]
    first = llm.chat([conv], greedy, use_tqdm=False)[0].outputs[0]
    conv += [{"role": "assistant", "content": first.text},
             {"role": "user", "content": "Say the code again, then name the keeper's job."}]
    second = llm.chat([conv], SamplingParams(temperature=0, max_tokens=16),
                      use_tqdm=False)[0].outputs[0]
    out["chat"] = [list(first.token_ids), list(second.token_ids)]
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text())["configs"] for p in (a_path, b_path))
    differ = [(key, field) for key in sorted(set(a) | set(b))
              for field in sorted(set(a.get(key, {})) | set(b.get(key, {})))
              if a.get(key, {}).get(field) != b.get(key, {}).get(field)]
    for key, field in differ:
        print(f"differs: {key} {field}")
    print(f"{len(set(a) & set(b))} configurations in both; "
          f"{len({k for k, _ in differ})} differ")
    return 1 if differ else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="compare two fingerprint files instead of serving")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    outputs = resolve_outputs(p, args, {"out": "output_fingerprint"})
    run = start("output_fingerprint", outputs, argv)
    configs = {}
    for config in CONFIGS:
        key = json.dumps(config, sort_keys=True)
        configs[key] = fingerprint(config)
        print(key, "greedy", configs[key]["greedy"][0], flush=True)
    write_result(args.out, "output_fingerprint", {"configs": configs}, argv)
    finish(run)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
