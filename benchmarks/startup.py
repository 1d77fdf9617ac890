"""Start-up time of the engine, cold and with JAX's persistent compilation cache warm.

Starts the same engine configuration in fresh processes that share one empty cache folder (the
first compiles everything and fills the cache, the next ones load from it) and times, in each,
the Engine's construction with warm-up (`EngineConfig(warmup=True)`: every step shape compiled).

    python benchmarks/startup.py                              # CPU: embedded SmolLM2-135M
    python benchmarks/startup.py --model random-llama-8b      # GPU: Llama-3.1-8B shape, random
                                                               # bf16 weights built on the device

Writes `--out` (default a fresh file under benchmarks/results/runs/; the committed
startup_<cpu|gpu>.json only with --overwrite): device, revision, command, each start's seconds,
the ratio first / second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402

RANDOM_8B = "random-llama-8b"


def random_llama_8b(dtype: str = "bfloat16"):
    """A `LoadedModel` of the Llama-3.1-8B shape with random weights built on the device (no
    file: 16 GB of safetensors would take longer to write and read than the whole run), and a
    word-level tokenizer over its 128256 ids (``t0`` .. ``t128255``)."""
    import jax.numpy as jnp
    import tokenizers
    from flax import nnx
    from tokenizers import models, pre_tokenizers

    from decode_step_gpu import LLAMA_8B, model_config
    from tangram_jax.models.decoder import Decoder
    from tangram_jax.models.registry import LoadedModel
    from tangram_jax.models.tokenizer import Tokenizer

    config = model_config(LLAMA_8B)
    model = Decoder(config, jnp.dtype(dtype), rngs=nnx.Rngs(0))
    backend = tokenizers.Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, eos_token_ids=config.eos_token_ids)
    return LoadedModel(config, model, tokenizer, RANDOM_8B, None)


def build_engine(model: str, engine_kwargs: dict):
    """`Engine(EngineConfig(model=..., **engine_kwargs))`; the random 8B model is handed to the
    engine in place of `load_model` (it has no file)."""
    from tangram_jax.engine import llm_engine
    from tangram_jax.engine.config import EngineConfig

    if model == RANDOM_8B:   # built inside Engine(), after it has set JAX's allocator up
        llm_engine.load_model = lambda *args, **kwargs: random_llama_8b(
            engine_kwargs.get("dtype", "bfloat16"))
    return llm_engine.Engine(EngineConfig(model=None if model == RANDOM_8B else model,
                                          **engine_kwargs))


def engine_kwargs_for(model: str) -> dict:
    if model == RANDOM_8B:   # the 8B serving shape of gpu_memory.py; chunk size and step token
        # budget are the engine's GPU defaults (2048 / 8192), so the largest step is measured
        return dict(mode="full", dtype="bfloat16", max_num_seqs=64, max_model_len=32768,
                    warmup=True)
    return dict(mode="tangram", dtype="float32", max_num_seqs=16, warmup=True)


def child(args) -> None:
    t0 = time.perf_counter()
    engine = build_engine(args.model, dict(engine_kwargs_for(args.model),
                                           compile_cache_dir=args.cache_dir))
    total = time.perf_counter() - t0
    print("STARTUP " + json.dumps({"seconds": total, "engine": engine.startup_seconds,
                                   "pool": {k: v for k, v in engine.kv_pool().items()
                                            if k != "plan"}}), flush=True)


def run_starts(model: str, starts: int, cache_dir: str, log=print) -> list[dict]:
    """Time `starts` fresh processes of the same configuration sharing `cache_dir`."""
    results = []
    for i in range(starts):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model",
                               model, "--cache-dir", cache_dir], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"start {i} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = dict(json.loads(line[len("STARTUP "):]), process_wall_seconds=wall)
        results.append(result)
        log(f"start {i + 1}: engine built and warmed up in {result['seconds']:.1f} s "
            f"(process {wall:.1f} s; loading the weights "
            f"{result['engine'].get('load_model', 0):.1f} s, warm-up "
            f"{result['engine']['warmup']:.1f} s)")
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help=f"'smollm2' or '{RANDOM_8B}'")
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="default: a fresh temporary folder")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    run = start("startup", resolve_outputs(parser, args, {"out": "startup"}), argv)
    import jax

    from tangram_jax.provenance import device_description, git_revision
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tangram_jax_startup_")
    starts = run_starts(args.model, args.starts, cache_dir)
    out = args.out
    result = {
        "benchmark": "startup",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "jax_version": jax.__version__,
        "model": args.model,
        "engine_config": engine_kwargs_for(args.model),
        "what_is_timed": ("Engine construction with warm-up (every step shape compiled) in a "
                          "fresh process; all processes share one compilation cache folder "
                          "that is empty before the first"),
        "starts": starts,
        "first_over_second": starts[0]["seconds"] / starts[1]["seconds"] if len(starts) > 1
        else None,
        # What the compilation cache can change: the start without loading the weights.
        "first_over_second_without_weight_loading": (
            (starts[0]["seconds"] - starts[0]["engine"]["load_model"])
            / (starts[1]["seconds"] - starts[1]["engine"]["load_model"])
            if len(starts) > 1 else None),
        "warmup_first_over_second": (starts[0]["engine"]["warmup"] / starts[1]["engine"]["warmup"]
                                     if len(starts) > 1 else None),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    finish(run)
    print(f"first / second start: {result['first_over_second']:.2f}x (without loading the "
          f"weights {result['first_over_second_without_weight_loading']:.2f}x, warm-up "
          f"{result['warmup_first_over_second']:.2f}x); wrote {out}", flush=True)


if __name__ == "__main__":
    main()
