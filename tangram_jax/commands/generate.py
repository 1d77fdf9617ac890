"""`tangram-jax generate`: one prompt in, its continuation out, on the dense reference path.

Kept thin on purpose: load the model, tokenize (or apply the chat template), run
`reference.generate_dense`, cut at stop strings with a `StopChecker`, print. Bad input is
reported on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import sys

HELP = "Generate a continuation of a prompt (or, with --chat, a reply) with the dense reference path"


def add_arguments(parser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text (several words are joined by spaces)")
    parser.add_argument("--model", default=None,
                        help="'smollm2' (default: the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    parser.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1 or 0: all")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    parser.add_argument("--stop", action="append", default=[], metavar="STR",
                        help="stop before this string (repeatable)")
    parser.add_argument("--chat", action="store_true",
                        help="treat the prompt as a user message and apply the model's chat template")
    parser.add_argument("--system", default=None, help="system prompt (with --chat)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def run(args) -> int:
    from tangram_jax.engine.inputs import check_unicode
    from tangram_jax.sampling import SamplingParams

    prompt = " ".join(args.prompt)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        if args.system is not None and not args.chat:
            raise ValueError("--system needs --chat")
        # Command-line bytes that are not UTF-8 reach Python as lone surrogates.
        check_unicode("the prompt", prompt)
        if args.system is not None:
            check_unicode("--system", args.system)
    except (ValueError, TypeError) as e:
        return _fail(e)

    from tangram_jax.models.registry import load_model

    print("loading model ...", file=sys.stderr, flush=True)
    try:
        loaded = load_model(args.model, dtype=args.dtype)
        tokenizer = loaded.tokenizer
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system is not None else []
            messages.append({"role": "user", "content": prompt})
            prompt_ids = tokenizer.apply_chat_template(messages)
        else:
            prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        text = _generate(loaded, prompt_ids, params)
    except (ValueError, TypeError, OSError) as e:
        return _fail(e)
    print(text)
    return 0


def _generate(loaded, prompt_ids: list[int], params) -> str:
    from tqdm import tqdm

    from tangram_jax.reference import generate_dense
    from tangram_jax.sampling import StopChecker

    tokenizer = loaded.tokenizer
    checker = StopChecker(tokenizer.decode, params, tokenizer.eos_token_ids, prompt_ids)
    with tqdm(total=params.max_tokens, desc="generating", unit="tok", file=sys.stderr, leave=False) as bar:
        def on_token(row: int, token: int) -> bool:
            bar.update(1)
            checker.append(token)
            return checker.finished

        generate_dense(loaded.model, loaded.config, [prompt_ids], params, tokenizer.eos_token_ids,
                       on_token=on_token)
    return checker.text


def _fail(error: Exception) -> int:
    print(f"tangram-jax generate: error: {error}", file=sys.stderr)
    return 2
