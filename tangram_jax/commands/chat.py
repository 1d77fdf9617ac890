"""`tangram-jax chat`: an interactive multi-turn conversation in the terminal.

The conversation is one engine session: each turn prefills only the new message on top of the
compressed history kept in the pool. Sampling defaults to the model's generation config (vLLM's
generation_config="auto"; the banner says which values and where from); `/stats` says what the
session's KV saved against full KV and, when nothing, why. Answers stream as they are
generated. A line that is not valid UTF-8 is refused with a message (the conversation goes on);
end of input leaves with status 0, Ctrl-C with 130.
"""

from __future__ import annotations

import dataclasses
import sys

HELP = "Chat with a model in the terminal; the conversation's compressed KV stays between turns"

_COMMANDS = "/exit to quit, /reset to start over, /stats for KV memory"


def add_arguments(parser) -> None:
    from tangram_jax.commands import positive_int
    from tangram_jax.engine.config import add_cli_args

    parser.add_argument("--system", default=None, help="system prompt (default: none, the "
                        "chat template's own)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="longest answer per turn (default: 256)")
    for flag, kind, vllm_default in _SAMPLER_FLAGS:
        parser.add_argument(flag, type=kind, default=None,
                            help=f"default: the model's generation config (see "
                                 f"--generation-config), else vLLM's {vllm_default}")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: each answer's seed derives from the "
                             "request id, so a run repeats its answers)")
    add_cli_args(parser, exclude=("seed",))


# Sampler flags whose defaults come from the model's generation config (vLLM's defaults shown).
_SAMPLER_FLAGS = (("--temperature", float, "1.0"), ("--top-p", float, "1.0"),
                  ("--top-k", int, "0 (off)"), ("--min-p", float, "0.0"),
                  ("--repetition-penalty", float, "1.0"))


def _sampler_args(args) -> dict:
    """The sampler fields the user gave on the command line."""
    names = [flag[2:].replace("-", "_") for flag, _, _ in _SAMPLER_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def run(args) -> int:
    from tangram_jax.commands import UsageError
    from tangram_jax.engine.config import from_cli_args
    from tangram_jax.engine.inputs import check_unicode
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.engine.outputs import RequestOutputKind
    from tangram_jax.models.generation_config import describe
    from tangram_jax.sampling import SamplingParams

    given = dict(_sampler_args(args), max_tokens=args.max_tokens, seed=args.seed)
    try:
        SamplingParams(**given)   # the flags' values, checked before the model loads
        if args.system is not None:
            check_unicode("--system", args.system)
        engine = Engine(from_cli_args(args))
        params = dataclasses.replace(engine.default_sampling_params, **given)
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from None
    # Undecodable input bytes become lone surrogates instead of an exception, so one bad line
    # is refused and the conversation goes on.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    print(f"tangram-jax chat: {engine.model_name}, mode {engine.config.mode} ({_COMMANDS})\n"
          f"sampling: {describe(params)}, answers up to {params.max_tokens} tokens (defaults: "
          f"{engine.default_sampling_source})", flush=True)
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
            print(f"({engine.describe_kv_savings()})")
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
