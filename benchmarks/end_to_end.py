"""End-to-end multi-turn serving: tangram vs full KV vs dynamic reclaim, equal pool bytes.

Tangram vs full KV vs dynamic compress-and-reclaim, one run.

Every mode serves the same ShareGPT conversations (user turns from the data set, answers
generated greedily) with the same KV pool bytes, so a mode that keeps less per token fits more
conversations at once. Writes `--out` (default a fresh benchmarks/results/runs/
end_to_end-<time>.json; the committed benchmarks/results/end_to_end.json only with --overwrite)
with the device, the git revision, the command and, per mode: throughput, KV bytes held vs full
KV for the same tokens, peak pool use, preemptions/evictions, and (dynamic) time spent
reclaiming pages. Ratios against full KV are reported alongside.

    python benchmarks/end_to_end.py --conversations 16 --turns 2 --kv-cache-tokens 6000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag, write_text_atomic
from tangram_jax.provenance import device_description, git_revision


def serve(mode: str, conversations: list[list[str]], args) -> dict:
    from tangram_jax.llm import LLM
    from tangram_jax.sampling import SamplingParams

    llm = LLM(args.model, mode=mode, ratio=args.ratio, group_size=args.group_size,
              kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
              chunk_size=args.chunk_size, max_num_batched_tokens=args.max_num_batched_tokens,
              dtype=args.dtype, warmup=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # The engine compiled every step shape while it was built (warmup=True); a throwaway
    # request too, so timings measure serving.
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    engine.tokens_processed = 0
    chats = [[{"role": "user", "content": turns[0]}] for turns in conversations]
    generated, peak_use, ttfts = 0, 0.0, []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        active = [i for i, turns in enumerate(conversations) if turn < len(turns)]
        if turn:
            for i in active:
                chats[i].append({"role": "user", "content": conversations[i][turn]})
        requests = []
        for i in active:
            ids = engine.tokenizer.apply_chat_template(chats[i])
            sid, new = engine.find_session(ids)
            rid = engine.add_request(prompt_token_ids=new, sampling_params=params,
                                     session_id=sid or f"conv-{i}")
            requests.append((i, rid))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            peak_use = max(peak_use, engine.manager.fullest_pool_use)
        for i, rid in requests:
            out = done[rid]
            chats[i].append({"role": "assistant", "content": out.outputs[0].text})
            generated += len(out.outputs[0].token_ids)
            ttfts.append(out.metrics.ttft)
    elapsed = time.perf_counter() - t0
    usage = engine.kv_usage()
    sched = usage["scheduler"]
    return {
        "mode": mode,
        "layout": engine.layout.name,
        "group_size": engine.layout.group_size,
        "pool_pages": int(np.sum(engine.manager.capacity)),     # usable pages of every tier
        "pool_tiers": dict(zip(engine.manager.tier_names,
                               np.atleast_1d(engine.manager.capacity).tolist())),
        "seconds": elapsed,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "processed_tokens_per_s": usage["tokens_processed"] / elapsed,
        "median_ttft_s": sorted(ttfts)[len(ttfts) // 2],
        "peak_pool_utilisation": peak_use,     # of the fullest tier's pool
        "kv_bytes_held_end": usage["kv_bytes_held"],
        "full_kv_bytes_same_tokens_end": usage["full_kv_bytes"],
        "kv_memory_vs_full_end": usage["kv_bytes_held"] / max(usage["full_kv_bytes"], 1),
        "fragmentation_end": usage["fragmentation"],
        "preemptions": sched["preemptions"],
        "evictions": sched["evictions"],
        "pages_reclaimed": usage["pages_reclaimed"],
        "reclaim_seconds": usage["reclaim_seconds"],
        "host_ms_per_step_median": sched["host_ms_per_step_median"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--modes", default="full,dynamic,tangram")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-user-chars", type=int, default=1500)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=6000,
                   help="pool size in full-KV tokens (equal bytes for every mode)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    run = start("end_to_end", resolve_outputs(p, args, {"out": "end_to_end"}), argv)

    from tangram_jax.compression.pilot_data import sharegpt_conversations
    sources = sharegpt_conversations(min_chars=600, limit=args.conversations)
    conversations = [[m["content"][:args.max_user_chars] for m in c if m["role"] == "user"]
                     [:args.turns] for c in sources]
    results = [serve(mode, conversations, args) for mode in args.modes.split(",")]
    base = next((r for r in results if r["mode"] == "full"), None)
    if base:
        for r in results:
            r["throughput_vs_full"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
            r["peak_pool_vs_full"] = r["peak_pool_utilisation"] / max(base["peak_pool_utilisation"], 1e-9)
    report = {
        "benchmark": "end_to_end",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "config": vars(args),
        "conversations": len(conversations),
        "results": results,
    }
    write_text_atomic(args.out, json.dumps(report, indent=2))
    finish(run)
    print(f"{'mode':9} {'out tok/s':>10} {'vs full':>8} {'KV vs full':>11} {'peak pool':>10} "
          f"{'preempt':>8} {'reclaim s':>10}")
    for r in results:
        print(f"{r['mode']:9} {r['output_tokens_per_s']:10.2f} {r.get('throughput_vs_full', 1):8.2f} "
              f"{r['kv_memory_vs_full_end']:11.2f} {r['peak_pool_utilisation']:10.2f} "
              f"{r['preemptions']:8d} {r['reclaim_seconds']:10.4f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
