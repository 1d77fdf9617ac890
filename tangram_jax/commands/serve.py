"""`tangram-jax serve`: an OpenAI-compatible HTTP server (completions, chat, SSE streaming).

Serves `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health` and `/metrics` on one
engine, so any OpenAI client (or `vllm bench serve`) can drive it. Needs the `serve` extra:
`pip install -e .[serve]`.
"""

from __future__ import annotations

import sys

HELP = "Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: what --model resolves to)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", default="tangram", choices=("tangram", "full", "dynamic"),
                        help="KV handling (default tangram: calibrated per-head budgets)")
    parser.add_argument("--profile", default=None, help="budget profile file")
    parser.add_argument("--ratio", type=float, default=0.5, help="target retention ratio rho")
    parser.add_argument("--group-size", type=int, default=None, help="KV heads per group G")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--max-num-seqs", type=int, default=16, help="concurrent sequences")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384,
                        help="full-KV tokens' worth of KV pool memory")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds requests that bring no seed of their own")
    parser.add_argument("--max-live-requests", type=int, default=None,
                        help="requests admitted at once (running + queued); more get HTTP 429 "
                             "(default 4 x max-num-seqs)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def run(args) -> int:
    try:
        import uvicorn

        from tangram_jax.server import build_app
    except ImportError as e:
        print(f"error: the server needs the 'serve' extra ({e}); install it with "
              f"pip install -e '.[serve]'", file=sys.stderr)
        return 2
    from tangram_jax.engine.async_engine import AsyncEngine
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.engine.llm_engine import Engine

    try:
        engine = Engine(EngineConfig(
            model=args.model, mode=args.mode, profile=args.profile, ratio=args.ratio,
            group_size=args.group_size, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
            kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
            seed=args.seed))
        async_engine = AsyncEngine(engine, max_live_requests=args.max_live_requests)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(async_engine, args.served_model_name)
    print(f"tangram-jax serve: {app.state.model_name} (mode {args.mode}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    return 0
