"""`tangram-jax run`: the main job, a batch of real multi-turn ShareGPT conversations.

Each conversation's user turns come from ShareGPT; the answers are generated. Every turn after the
first continues the conversation's session, whose compressed history stayed in the pool. Prints
throughput, the KV memory the conversations hold against what full KV would hold for the same
tokens (what was saved, and where the tokens came from), and a sample answer. The conversations
are ones whose user turns are long enough to compress (`--min-user-chars`): a turn's last
`obs_window` tokens and every generated token are kept whole.
"""

from __future__ import annotations

import json
import time

HELP = "Serve a batch of multi-turn ShareGPT conversations and report throughput and KV memory"


def add_arguments(parser) -> None:
    from tangram_jax.commands import add_overwrite_flag, positive_int
    from tangram_jax.engine.config import add_cli_args

    parser.add_argument("--conversations", type=positive_int, default=6,
                        help="conversations in the batch (default: 6)")
    parser.add_argument("--turns", type=positive_int, default=2,
                        help="user turns per conversation (default: 2)")
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="answer length per turn (default: 32)")
    parser.add_argument("--max-user-chars", type=positive_int, default=1200,
                        help="user messages are cut to this many characters (default: 1200)")
    parser.add_argument("--min-user-chars", type=int, default=800,
                        help="serve conversations whose first --turns user messages have at "
                             "least this many characters each (default: 800; most ShareGPT "
                             "user turns are a line or two, which the protected tail of a turn "
                             "keeps whole, so there would be little to compress; 0: any)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default: 0, greedy)")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file "
                        "(a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    add_cli_args(parser)


def run(args) -> int:
    from tangram_jax.commands import UsageError, check_output_path, write_text_atomic
    from tangram_jax.compression.pilot_data import sharegpt_conversations
    from tangram_jax.engine.config import from_cli_args
    from tangram_jax.llm import LLM
    from tangram_jax.sampling import SamplingParams

    try:
        if args.json:
            check_output_path("--json", args.json, overwrite=args.overwrite)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
        config = from_cli_args(args)
        llm = LLM(config=config)
    except UsageError:
        raise
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from None
    sources = sharegpt_conversations(min_chars=400, limit=args.conversations,
                                     min_user_chars=args.min_user_chars, user_turns=args.turns)
    user_turns = [[m["content"][:args.max_user_chars] for m in conv if m["role"] == "user"]
                  for conv in sources]
    user_turns = [turns[:args.turns] for turns in user_turns if turns]
    conversations = [[{"role": "user", "content": turns[0]}] for turns in user_turns]
    if not conversations:
        raise UsageError("no ShareGPT conversations to serve")

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
    saving = llm.engine.describe_kv_savings()
    report = {
        "model": llm.engine.model_name,
        "mode": config.mode,
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
        "kv_saved_vs_full": 1 - usage["kv_bytes_held"] / max(usage["full_kv_bytes"], 1),
        "token_breakdown": usage["token_breakdown"],
        "kv_memory": saving,
    }
    ratio = "" if config.mode == "full" else f"  ratio {config.ratio}"
    print(f"model {report['model']}  mode {config.mode}{ratio}  G={report['group_size']}  "
          f"{report['conversations']} conversations x {args.turns} turns")
    print(f"throughput: {report['output_tokens_per_s']:.1f} output tok/s, "
          f"{report['processed_tokens_per_s']:.1f} processed tok/s ({elapsed:.1f} s)")
    print(f"memory: the sessions' {saving}")
    sample = conversations[0]
    print("\n--- sample conversation ---")
    for m in sample:
        text = m["content"] if len(m["content"]) < 300 else m["content"][:300] + " [...]"
        print(f"[{m['role']}] {text}")
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
    return 0
