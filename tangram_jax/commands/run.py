"""`tangram-jax run`: the main job, a batch of real multi-turn ShareGPT conversations.

Each conversation's user turns come from ShareGPT; the answers are generated. Every turn after the
first continues the conversation's session, whose compressed history stayed in the pool. Prints
throughput, the KV memory the conversations hold against what full KV would hold for the same
tokens, and a sample answer.
"""

from __future__ import annotations

import json
import sys
import time

HELP = "Serve a batch of multi-turn ShareGPT conversations and report throughput and KV memory"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--mode", default="tangram", choices=("tangram", "full", "dynamic"),
                        help="KV handling: calibrated non-uniform budgets (tangram), uncompressed "
                             "(full), or per-input selection with reclaim (dynamic)")
    parser.add_argument("--profile", default=None,
                        help="budget profile file (default: the shipped one of the embedded model)")
    parser.add_argument("--ratio", type=float, default=0.5,
                        help="target retention ratio rho (shipped profiles: 0.5, 0.25)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="KV heads per group G (default: the profile's)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations in the batch")
    parser.add_argument("--turns", type=int, default=2, help="user turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=48, help="answer length per turn")
    parser.add_argument("--max-user-chars", type=int, default=1200,
                        help="user messages are cut to this many characters")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")


def run(args) -> int:
    from tangram_jax.compression.pilot_data import sharegpt_conversations
    from tangram_jax.llm import LLM
    from tangram_jax.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
        llm = LLM(args.model, mode=args.mode, profile=args.profile, ratio=args.ratio,
                  group_size=args.group_size)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sources = sharegpt_conversations(min_chars=400, limit=args.conversations)
    user_turns = [[m["content"][:args.max_user_chars] for m in conv if m["role"] == "user"]
                  for conv in sources]
    user_turns = [turns[:args.turns] for turns in user_turns if turns]
    conversations = [[{"role": "user", "content": turns[0]}] for turns in user_turns]

    generated = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        active = [i for i, turns in enumerate(user_turns) if turn < len(turns)]
        if turn > 0:
            for i in active:
                conversations[i].append({"role": "user", "content": user_turns[i][turn]})
        outputs = llm.chat([conversations[i] for i in active], params)
        for i, out in zip(active, outputs):
            conversations[i].append({"role": "assistant", "content": out.outputs[0].text})
            generated += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0

    usage = llm.engine.kv_usage()
    report = {
        "model": llm.engine.model_name,
        "mode": args.mode,
        "layout": llm.engine.layout.name,
        "group_size": llm.engine.layout.group_size,
        "conversations": len(conversations),
        "turns": args.turns,
        "generated_tokens": generated,
        "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "processed_tokens_per_s": usage["tokens_processed"] / elapsed,
        "kv_bytes_held": usage["kv_bytes_held"],
        "full_kv_bytes_for_same_tokens": usage["full_kv_bytes"],
        "kv_memory_vs_full": usage["kv_bytes_held"] / max(usage["full_kv_bytes"], 1),
    }
    print(f"model {report['model']}  mode {args.mode}  G={report['group_size']}  "
          f"{report['conversations']} conversations x {args.turns} turns")
    print(f"throughput: {report['output_tokens_per_s']:.1f} output tok/s, "
          f"{report['processed_tokens_per_s']:.1f} processed tok/s ({elapsed:.1f} s)")
    print(f"KV memory held by the sessions: {usage['kv_bytes_held'] / 2**20:.2f} MiB vs "
          f"{usage['full_kv_bytes'] / 2**20:.2f} MiB full KV for the same tokens "
          f"({100 * report['kv_memory_vs_full']:.1f}%)")
    sample = conversations[0]
    print("\n--- sample conversation ---")
    for m in sample:
        text = m["content"] if len(m["content"]) < 300 else m["content"][:300] + " [...]"
        print(f"[{m['role']}] {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
