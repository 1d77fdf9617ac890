"""`tangram-jax calibrate`: offline head-budget calibration -> a budget profile (+ box plot)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Calibrate per-head KV budgets offline on pilot samples and write a budget profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tangram_jax.compression.pilot_data import DEFAULT_LENGTHS, TASKS
    from tangram_jax.compression.scorers import SCORERS
    parser.add_argument("--method", default="snapkv", choices=sorted(SCORERS),
                        help="scorer whose dynamic (Ada-KV) selection is calibrated")
    parser.add_argument("--ratio", type=float, default=0.25, help="target retention ratio rho")
    parser.add_argument("--samples", type=int, default=50, help="number of pilot samples")
    parser.add_argument("--group-size", type=int, default=1,
                        help="G, KV heads per group (must divide the model's KV heads)")
    parser.add_argument("--grouping", default="budget", choices=("budget", "adjacent"))
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--plot", help="box plot PNG to write")
    parser.add_argument("--model", default=None, help="model name or path (default: embedded)")
    parser.add_argument("--lambda", dest="lambda_", type=float, default=2.0,
                        help="budget = min(1, mean + lambda * std)")
    parser.add_argument("--rescale", action="store_true",
                        help="rescale each layer's budgets to average rho")
    parser.add_argument("--safeguard", type=float, default=0.2,
                        help="per-head guaranteed share of the dynamic selection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="comma-separated target prompt lengths in tokens")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated pilot task types")
    parser.add_argument("--save-run", help="also save the per-sample retention (.npz)")
    parser.add_argument("--summary-json", help="also write the summary figures as JSON")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tangram_jax.compression.calibration import (chat_tokenizer, profile_from_run,
                                                     run_calibration)
    from tangram_jax.compression.clustering import GROUPINGS
    from tangram_jax.compression.pilot_data import build_pilot_samples
    from tangram_jax.compression.report import format_summary, retention_boxplot, summarize

    if not 0 < args.ratio <= 1:
        return _fail(f"--ratio must lie in (0, 1], got {args.ratio}")
    if args.samples <= 0:
        return _fail(f"--samples must be positive, got {args.samples}")
    if args.lambda_ < 0:
        return _fail(f"--lambda must be >= 0, got {args.lambda_}")
    if args.grouping not in GROUPINGS:
        return _fail(f"--grouping must be one of {GROUPINGS}")
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        return _fail(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())

    from tangram_jax.models.registry import load_model
    loaded = load_model(args.model)
    config = loaded.config
    heads = config.num_kv_heads
    if args.group_size <= 0 or heads % args.group_size:
        divisors = [g for g in range(1, heads + 1) if heads % g == 0]
        return _fail(f"--group-size {args.group_size} does not divide the {heads} KV heads of "
                     f"{loaded.name}; valid group sizes: {divisors}")

    print(f"building {args.samples} pilot samples (seed {args.seed}, lengths {lengths})",
          file=sys.stderr)
    try:
        samples = build_pilot_samples(args.samples, chat_tokenizer(loaded.tokenizer), seed=args.seed,
                                      lengths=lengths, tasks=tasks)
    except ValueError as e:
        return _fail(str(e))
    calib = run_calibration(loaded.model, config, samples, [args.ratio], method=args.method,
                            safeguard=args.safeguard,
                            progress=lambda it: tqdm(it, desc="calibrating", unit="sample"))
    if args.save_run:
        calib.save(args.save_run)
    fingerprint = dict(config.fingerprint(), name=loaded.name)
    profile = profile_from_run(
        calib, args.ratio, model=fingerprint, lambda_=args.lambda_, group_size=args.group_size,
        grouping=args.grouping, rescale=args.rescale,
        metadata=dict(seed=args.seed, lengths=list(lengths), command=" ".join(sys.argv)))
    summary = summarize(calib, args.ratio, profile.budget,
                        tuple(sorted({1, args.group_size} | {g for g in (2, 3, 4) if heads % g == 0})),
                        lambda_=None if args.rescale else args.lambda_)
    profile = _with_summary(profile, summary)
    profile.save(args.out)
    if args.plot:
        retention_boxplot(calib.retention[args.ratio], profile.budget, args.ratio, args.plot,
                          title=f"{loaded.name}: {args.method} rho={args.ratio}, "
                                f"{args.samples} samples (heads by budget)")
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    print(format_summary(summary))
    print(f"profile written to {args.out}" + (f", plot to {args.plot}" if args.plot else ""))
    return 0


def _with_summary(profile, summary):
    import dataclasses
    meta = dict(profile.metadata)
    meta["regularity"] = dict(
        spearman_samples=summary["spearman_samples"], spearman_tasks=summary["spearman_tasks"],
        overflow_rate=summary["overflow_rate"],
        held_out_overflow_rate=summary["held_out_overflow_rate"])
    return dataclasses.replace(profile, metadata=meta)


def _fail(message: str) -> int:
    print(f"tangram-jax calibrate: error: {message}", file=sys.stderr)
    return 2
