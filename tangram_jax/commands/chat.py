"""`tangram-jax chat`: an interactive multi-turn conversation in the terminal.

The conversation is one engine session: each turn prefills only the new message on top of the
compressed history kept in the pool. Answers stream as they are generated. A line that is not
valid UTF-8 is refused with a message (the conversation goes on); end of input leaves with
status 0, Ctrl-C with 130.
"""

from __future__ import annotations

import sys

HELP = "Chat with a model in the terminal; the conversation's compressed KV stays between turns"

_COMMANDS = "/exit to quit, /reset to start over, /stats for KV memory"


def add_arguments(parser) -> None:
    from tangram_jax.commands import positive_int
    from tangram_jax.engine.config import add_cli_args

    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="longest answer per turn")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_cli_args(parser, exclude=("seed",))


def run(args) -> int:
    from tangram_jax.commands import UsageError
    from tangram_jax.engine.config import from_cli_args
    from tangram_jax.engine.inputs import check_unicode
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.engine.outputs import RequestOutputKind
    from tangram_jax.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        if args.system is not None:
            check_unicode("--system", args.system)
        engine = Engine(from_cli_args(args))
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from None
    # Undecodable input bytes become lone surrogates instead of an exception, so one bad line
    # is refused and the conversation goes on.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    print(f"tangram-jax chat: {engine.model_name}, mode {engine.config.mode} ({_COMMANDS})",
          flush=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    # The conversation's session (the engine's session table; found again by prefix each turn).
    session = engine.new_session_id()
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        try:
            check_unicode("input", text)
        except ValueError:
            print("error: that line is not valid UTF-8 text; type it again", file=sys.stderr)
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            if engine.has_session(session):
                engine.end_session(session)
            messages = messages[:1] if args.system else []
            session = engine.new_session_id()
            print("(conversation cleared)")
            continue
        if text == "/stats":
            usage = engine.kv_usage()
            print(f"(KV held {usage['kv_bytes_held'] / 2**20:.2f} MiB vs "
                  f"{usage['full_kv_bytes'] / 2**20:.2f} MiB full KV for the same tokens)")
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = engine.tokenizer.apply_chat_template(messages)
            found, new_ids = engine.find_session(ids)
            if found is None and not engine.has_session(session):
                session = engine.new_session_id()   # forgotten after an eviction: start anew
            request = engine.add_request(prompt_token_ids=new_ids, sampling_params=params,
                                         session_id=found or session,
                                         output_kind=RequestOutputKind.DELTA)
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        session = found or session
        print("assistant> ", end="", flush=True)
        answer, error = _stream(engine, request)
        print()
        if error is not None:
            print(f"error: {error}", file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})


def _stream(engine, request: str) -> tuple[str, str | None]:
    """Step the engine until `request` ends, printing each new piece of its text (DELTA
    outputs: only text that can no longer be taken back, so nothing printed is ever wrong);
    returns the whole text and the request's error (None if it ended normally)."""
    pieces = []
    while engine.is_live(request):
        for out in engine.step():
            if out.request_id == request:
                pieces.append(out.outputs[0].text)
                print(pieces[-1], end="", flush=True)
                if out.finished:
                    return "".join(pieces), out.error
    return "".join(pieces), None
