"""A session swapped to host memory and back answers as if never evicted, at the 8B widths.

For each configuration (full, tangram, tangram+k8v4, tangram+k8v4-k4v2 by default) one engine
serves a three-turn session (a context of `--context` tokens, then two follow-ups of 64), and
between turns evicts it to host memory (`Scheduler.evict_session`, the swap forced), waits for
the copy, and overwrites every page of the pool: the next turn can only read the session's
history from the host copy. Then the same turns as a new session that never leaves the pool.
The greedy tokens of every turn must be equal. Random bf16 weights of the Llama-3.1-8B shape
built on the device, `--layers` of them (the pages, heads and page formats are the 8B's; the
layer count only multiplies the same copies). Also reports the bytes a swap moved, the time
of each copy out and back (blocking on it, unlike serving) and how long starting the copy out
held the step loop (`copy_out_dispatch_s`).

    python benchmarks/swap_check_gpu.py --layers 4 --out /tmp/swap_check.json
    python benchmarks/swap_check_gpu.py --model random-tiny --context 600   # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import (  # noqa: E402
    finish, resolve_outputs, start, write_result)
from tangram_jax.commands import add_overwrite_flag  # noqa: E402


def conversation(engine, session: str, turns: list[list[int]], swap: bool, answer: int) -> dict:
    """Greedy answers of `turns` in `session`; with `swap`, the session goes to host memory
    and the pool is overwritten between turns. Returns answers and copy timings."""
    import jax
    import jax.numpy as jnp

    from tangram_jax.sampling import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    answers, outs, ins = [], [], []
    for i, tokens in enumerate(turns):
        if i and swap:
            engine.host_pool.host_bandwidth = 1e15        # swap, whatever the rates say
            before = engine.scheduler.metrics.swapped_out_bytes
            if not engine.scheduler.evict_session(session):
                raise RuntimeError(f"{session}: the eviction did not swap")
            t0 = time.perf_counter()
            engine._move_host_kv()
            dispatched = time.perf_counter() - t0   # what the step loop waits for
            engine.runner.host_tier.settle_all()
            outs.append((engine.scheduler.metrics.swapped_out_bytes - before,
                         time.perf_counter() - t0, dispatched))
            print(f"  {session} turn {i}: copy out {outs[-1][0]} B in {outs[-1][1]:.3f} s "
                  f"(dispatch {dispatched:.3f} s)", flush=True)
            runner = engine.runner
            runner.k_pages, runner.v_pages = jax.tree.map(
                lambda x: jax.device_put(jnp.full_like(x, 3), x.sharding),
                (runner.k_pages, runner.v_pages))
            jax.block_until_ready((runner.k_pages, runner.v_pages))
        rid = f"{session}-{i}"
        engine.add_request(rid, prompt_token_ids=tokens, session_id=session,
                           sampling_params=params)
        t0, restored = time.perf_counter(), None
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
            if restored is None and i and swap:
                jax.block_until_ready((engine.runner.k_pages, engine.runner.v_pages))
                restored = time.perf_counter() - t0     # the first step: the copy back
        if restored is not None:
            ins.append(restored)
        (out,) = [o for o in done if o.request_id == rid]
        answers.append(list(out.outputs[0].token_ids))
    return {"answers": answers, "copy_out": outs, "copy_back_first_step_s": ins}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-llama-8b",
                        help="random-llama-8b (GPU) or random-tiny (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the random model (default: the shape's)")
    parser.add_argument("--variants", default="full,tangram,tangram+k8v4,tangram+k8v4-k4v2")
    parser.add_argument("--context", type=int, default=8192, help="first turn's tokens")
    parser.add_argument("--answer", type=int, default=16, help="greedy tokens a turn")
    parser.add_argument("--host-gib", type=float, default=8.0,
                        help="the host tier's budget (GiB; a swap needs one session's KV)")
    parser.add_argument("--out", default=None)
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    (out_path,) = resolve_outputs(parser, args, {"out": "swap_check"})
    run = start("swap_check", [out_path], argv)

    import gc

    import jax
    import numpy as np

    from tangram_jax.benchmarking.models import random_model, random_model_config
    from tangram_jax.benchmarking.serve import variant_config
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.engine.llm_engine import Engine

    config = random_model_config(args.model, args.layers)
    rng = np.random.default_rng(0)
    turns = [rng.integers(10, config.vocab_size, n).tolist() for n in (args.context, 64, 64)]
    rows, ok = [], True
    for variant in [v for v in args.variants.split(",") if v]:
        fields = dict(variant_config(variant, config, 2, 0.25, 0), ratio=0.25)
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(
            model=lambda: random_model(args.model, num_layers=args.layers), max_num_seqs=4,
            kv_cache_tokens=2 * (args.context + 512), max_model_len=args.context + 512,
            host_kv_cache_bytes=int(args.host_gib * (1 << 30)), **fields))
        build = time.perf_counter() - t0
        swapped = conversation(engine, "swapped", turns, True, args.answer)
        kept = conversation(engine, "kept", turns, False, args.answer)
        same = swapped["answers"] == kept["answers"]
        ok &= same
        row = {"variant": variant, "identical": same, "build_s": build,
               "swapped_answers": swapped["answers"], "kept_answers": kept["answers"],
               "copy_out_bytes": [b for b, _, _ in swapped["copy_out"]],
               "copy_out_s": [s for _, s, _ in swapped["copy_out"]],
               "copy_out_dispatch_s": [d for _, _, d in swapped["copy_out"]],
               "copy_out_gb_per_s": [b / s / 1e9 for b, s, _ in swapped["copy_out"]],
               "first_step_after_restore_s": swapped["copy_back_first_step_s"],
               "host_tier_rates": engine.host_pool.summary(),
               "pinned_ahead_bytes": engine.runner.host_tier.pinned_bytes,
               "pinned_ahead_s": engine.runner.host_tier.pin_seconds,
               "swapped_in": engine.scheduler.metrics.num_swapped_in}
        rows.append(row)
        print(f"{variant}: {'identical' if same else 'DIFFERENT'} over {len(turns)} turns; "
              f"copy out {row['copy_out_bytes']} B in {[f'{s:.3f}' for s in row['copy_out_s']]} s "
              f"(dispatch {[f'{s:.3f}' for s in row['copy_out_dispatch_s']]} s); "
              f"first step after restore {[f'{s:.3f}' for s in row['first_step_after_restore_s']]}"
              f" s; built in {build:.1f} s; pinned ahead {row['pinned_ahead_bytes']} B in "
              f"{row['pinned_ahead_s']} s", flush=True)
        del engine
        gc.collect()
        jax.clear_caches()
        write_result(out_path, "swap_check", {   # after each: a run cut short keeps them
            "model": args.model, "layers": config.num_layers, "context": args.context,
            "all_identical": ok, "results": rows}, argv)
    finish(run)
    print(f"wrote {out_path}: {'every configuration identical' if ok else 'DIFFERENCES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
