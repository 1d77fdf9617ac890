"""`tangram-jax chat`: an interactive multi-turn conversation in the terminal.

The conversation is one engine session: each turn prefills only the new message on top of the
compressed history kept in the pool. Answers stream as they are generated.
"""

from __future__ import annotations

import sys

HELP = "Chat with a model in the terminal; the conversation's compressed KV stays between turns"

_COMMANDS = "/exit to quit, /reset to start over, /stats for KV memory"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--mode", default="tangram", choices=("tangram", "full", "dynamic"),
                        help="KV handling (default tangram: calibrated per-head budgets)")
    parser.add_argument("--profile", default=None, help="budget profile file")
    parser.add_argument("--ratio", type=float, default=0.5, help="target retention ratio rho")
    parser.add_argument("--group-size", type=int, default=None, help="KV heads per group G")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest answer per turn")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)


def run(args) -> int:
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        engine = Engine(EngineConfig(model=args.model, mode=args.mode, profile=args.profile,
                                     ratio=args.ratio, group_size=args.group_size))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tangram-jax chat: {engine.model_name}, mode {args.mode} ({_COMMANDS})", flush=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    session, turn = "chat", 0
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            try:
                engine.end_session(session)
            except KeyError:      # no turn was answered yet: nothing cached
                pass
            messages = messages[:1] if args.system else []
            turn += 1
            session = f"chat-{turn}"
            print("(conversation cleared)")
            continue
        if text == "/stats":
            usage = engine.kv_usage()
            print(f"(KV held {usage['kv_bytes_held'] / 2**20:.2f} MiB vs "
                  f"{usage['full_kv_bytes'] / 2**20:.2f} MiB full KV for the same tokens)")
            continue
        messages.append({"role": "user", "content": text})
        ids = engine.tokenizer.apply_chat_template(messages)
        found, new_ids = engine.find_session(ids)
        try:
            request = engine.add_request(prompt_token_ids=new_ids, sampling_params=params,
                                         session_id=found or session)
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        session = found or session
        print("assistant> ", end="", flush=True)
        shown = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request:
                    answer = out.outputs[0].text
                    print(answer[len(shown):], end="", flush=True)
                    shown = answer
        print()
        messages.append({"role": "assistant", "content": shown})
