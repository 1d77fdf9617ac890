"""`tangram-jax serve`: an OpenAI-compatible HTTP server (completions, chat, SSE streaming).

Serves `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health` and `/metrics` on one
engine, so any OpenAI client (or `vllm bench serve`) can drive it. Needs the `serve` extra:
`pip install -e .[serve]`.
"""

from __future__ import annotations

HELP = "Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)"


def add_arguments(parser) -> None:
    from tangram_jax.commands import port, positive_int
    from tangram_jax.engine.config import add_cli_args

    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: what --model resolves to)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8000,
                        help="TCP port to listen on, 0-65535 (0: any free port; default 8000)")
    parser.add_argument("--max-live-requests", type=positive_int, default=None,
                        help="requests admitted at once (running + queued); more get HTTP 429 "
                             "(default 4 x max-num-seqs)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))
    add_cli_args(parser)


def run(args) -> int:
    from tangram_jax.commands import UsageError

    try:
        import uvicorn

        from tangram_jax.server import build_app
    except ImportError as e:
        raise UsageError(f"the server needs the 'serve' extra ({e}); install it with "
                         f"pip install -e '.[serve]'") from None
    from tangram_jax.engine.async_engine import AsyncEngine
    from tangram_jax.engine.config import from_cli_args
    from tangram_jax.engine.llm_engine import Engine

    try:
        engine = Engine(from_cli_args(args))
        if engine.is_warm:   # clients ask for log-probabilities: compile those steps now too
            engine.warmup(logprobs=True)
        async_engine = AsyncEngine(engine, max_live_requests=args.max_live_requests)
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from None
    app = build_app(async_engine, args.served_model_name)
    print(f"tangram-jax serve: {app.state.model_name} (mode {engine.config.mode}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    return 0
