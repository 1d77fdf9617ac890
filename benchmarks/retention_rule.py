"""Which end of a turn must stay uncompressed: follow-up accuracy on the embedded model (CPU).

A small generated multi-turn task (the one issue 12 describes): a ~500-token essay excerpt holding
three facts ("The <colour> box holds the number <n>."); turn 1 asks for one fact, turns 2 and 3 for
the other two, in the same session (the engine continues the session: only the new turn is
prefilled, on top of the compressed history). Greedy answers; a turn is right when the number is
in the answer. Each configuration is ``mode:ratio:tail_rule[:scoring]`` (`EngineConfig` fields;
tail rule ``-`` leaves the engine's default, for running this script against an older checkout).

    PYTHONPATH=$PWD python3 benchmarks/retention_rule.py --sessions 24 \
        --configs full:1:window tangram:0.25:window tangram:0.25:final_chunk ... --out r.json

Writes JSON: per configuration the turn-1 and follow-up accuracy, the answers, and the prefill /
total wall time. See `NOTES_accuracy.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag

os.environ.setdefault("JAX_PLATFORMS", "cpu")

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver",
           "golden", "brown", "pink"]
QUESTION = "What number does the {} box hold? Answer with the number only."


def make_sessions(count: int, seed: int, context_chars: int = 2000) -> list[dict]:
    """`count` sessions: {"context": str, "questions": [3 str], "answers": [3 str]}."""
    from tangram_jax.compression.pilot_data import haystack_text
    essays = haystack_text()
    rng = random.Random(seed)
    sessions = []
    for _ in range(count):
        start = rng.randrange(0, len(essays) - 2 * context_chars)
        start = essays.find(". ", start) + 2
        text = essays[start:start + context_chars]
        colours = rng.sample(COLOURS, 3)
        numbers = [str(rng.randrange(1000, 10000)) for _ in colours]
        # Facts at three depths, each at a sentence boundary.
        pieces, cut_prev = [], 0
        for depth, colour, number in zip((0.2, 0.5, 0.8), colours, numbers):
            cut = text.rfind(". ", 0, int(len(text) * depth)) + 2
            pieces += [text[cut_prev:cut], f"The {colour} box holds the number {number}. "]
            cut_prev = cut
        pieces.append(text[cut_prev:])
        order = rng.sample(range(3), 3)   # which fact each turn asks
        sessions.append(dict(context="".join(pieces),
                             questions=[QUESTION.format(colours[i]) for i in order],
                             answers=[numbers[i] for i in order]))
    return sessions


def run_config(spec: str, sessions: list[dict], max_tokens: int, batch: int) -> dict:
    from tangram_jax.llm import LLM
    from tangram_jax.sampling import SamplingParams
    mode, ratio, tail, *rest = spec.split(":")
    kwargs = dict(mode=mode, ratio=float(ratio) if mode != "full" else 0.5,
                  max_num_seqs=batch, kv_cache_tokens=16384, max_model_len=2048,
                  max_num_batched_tokens=512)
    if tail != "-":
        kwargs["tail_rule"] = tail
    if rest:
        kwargs["scoring"] = rest[0]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    build = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    answers = [[None] * 3 for _ in sessions]
    t0 = time.perf_counter()
    for lo in range(0, len(sessions), batch):
        group = sessions[lo:lo + batch]
        convs = [[] for _ in group]
        for turn in range(3):
            for c, s in zip(convs, group):
                q = s["questions"][turn]
                c.append({"role": "user", "content": f"{s['context']}\n\n{q}" if turn == 0 else q})
            outs = llm.chat(convs, params, use_tqdm=False)
            for i, (c, out) in enumerate(zip(convs, outs)):
                text = out.outputs[0].text
                c.append({"role": "assistant", "content": text})
                answers[lo + i][turn] = text
        for out in outs:
            if out.session_id is not None:
                llm.end_session(out.session_id)
    serve = time.perf_counter() - t0
    right = [[s["answers"][t] in a[t] for t in range(3)] for s, a in zip(sessions, answers)]
    n = len(sessions)
    return dict(config=spec, sessions=n, build_seconds=round(build, 1),
                serve_seconds=round(serve, 1),
                turn1_correct=sum(r[0] for r in right),
                followup_correct=sum(r[1] + r[2] for r in right), followup_total=2 * n,
                turn1_accuracy=sum(r[0] for r in right) / n,
                followup_accuracy=sum(r[1] + r[2] for r in right) / (2 * n),
                answers=answers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(ap)
    args = ap.parse_args(argv)
    outputs = resolve_outputs(ap, args, {"out": "retention_rule"})
    run = start("retention_rule", outputs, argv)
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from tangram_jax.provenance import git_revision
    sessions = make_sessions(args.sessions, args.seed)
    results = []
    for spec in args.configs:
        r = run_config(spec, sessions, args.max_tokens, args.batch)
        print(f"{spec:36s} turn1 {r['turn1_correct']}/{r['sessions']}  follow-up "
              f"{r['followup_correct']}/{r['followup_total']}  serve {r['serve_seconds']} s",
              flush=True)
        results.append(r)
    out = dict(benchmark="retention_rule", device="cpu", git_revision=git_revision(),
               command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
               sessions=args.sessions, seed=args.seed, expected=[s["answers"] for s in sessions],
               results=results)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        finish(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
