"""`tangram-jax calibrate`: offline head-budget calibration -> a budget profile (+ box plot)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Calibrate per-head KV budgets offline on pilot samples and write a budget profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tangram_jax.commands import add_overwrite_flag
    from tangram_jax.compression.pilot_data import DEFAULT_LENGTHS, TASKS
    from tangram_jax.compression.scorers import SCORERS
    parser.add_argument("--method", default="snapkv", choices=sorted(SCORERS),
                        help="scorer whose dynamic (Ada-KV) selection is calibrated")
    parser.add_argument("--ratio", default="0.25",
                        help="target retention ratio rho (comma-separated for several, all from "
                             "the same scores)")
    parser.add_argument("--samples", type=int, default=50, help="number of pilot samples")
    parser.add_argument("--group-size", default="1",
                        help="G, KV heads per group (must divide the model's KV heads; "
                             "comma-separated for several)")
    parser.add_argument("--grouping", default="budget", choices=("budget", "adjacent"))
    parser.add_argument("--out", required=True,
                        help="profile JSON to write; with several ratios/group sizes use the "
                             "placeholders {rho} and {g}, e.g. p_rho{rho:.2f}_g{g}.json")
    parser.add_argument("--plot", help="box plot PNG to write")
    parser.add_argument("--model", default=None, help="model name or path (default: embedded)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template the pilot prompts are formatted with in place of "
                             "the model's own: a Jinja file or the template text (models that "
                             "ship none need it)")
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
    parser.add_argument("--from-run", help="build the profiles from a saved run (.npz) instead "
                        "of running the model over pilot samples")
    parser.add_argument("--summary-json", help="also write the summary figures as JSON")
    add_overwrite_flag(parser)   # e.g. to recalibrate a shipped profile in place
    parser.add_argument("--tiers", default=None, choices=("k8v4-k4v2",),
                        help="also calibrate precision-tier budgets (hetero-precision KV): the "
                             "profile carries each head's high-tier share (format version 2)")
    parser.add_argument("--tier-mass", type=float, default=0.9,
                        help="with --tiers: share of the retained set's importance the high "
                             "tier holds, in (0, 1]")


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:   # UsageError included; model and file errors are ValueErrors too
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename or ''}: {e.strerror or e}" if e.filename else str(e))


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tangram_jax.commands import atomic_path, write_text_atomic
    from tangram_jax.compression.calibration import (CalibrationRun, chat_tokenizer,
                                                     profile_from_run, run_calibration)
    from tangram_jax.compression.pilot_data import build_pilot_samples
    from tangram_jax.compression.report import format_summary, retention_boxplot, summarize

    ratios = _floats(str(args.ratio), "--ratio")
    group_sizes = _ints(str(args.group_size), "--group-size")
    lengths = _ints(args.lengths, "--lengths")
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [r for r in ratios if not 0 < r <= 1]
    if bad:
        raise ValueError(f"--ratio must lie in (0, 1], got {bad}")
    if args.samples <= 0:
        raise ValueError(f"--samples must be positive, got {args.samples}")
    if args.lambda_ < 0:
        raise ValueError(f"--lambda must be >= 0, got {args.lambda_}")
    if not 0 < args.tier_mass <= 1:
        raise ValueError(f"--tier-mass must lie in (0, 1], got {args.tier_mass}")
    several = len(ratios) * len(group_sizes) > 1
    if several and ("{rho" not in args.out or ("{g" not in args.out and len(group_sizes) > 1)):
        raise ValueError("with several ratios or group sizes, --out must name them with "
                         "placeholders, e.g. profile_rho{rho:.2f}_g{g}.json")
    if args.plot and len(ratios) > 1 and "{rho" not in args.plot:
        raise ValueError("with several ratios, --plot must contain a {rho} placeholder")
    if args.save_run and not args.save_run.endswith(".npz"):
        args.save_run += ".npz"   # what numpy would name it
    _check_outputs(args, ratios, group_sizes)
    # A saved run is read before the model is loaded: a bad file is reported at once.
    calib = _load_run(CalibrationRun, args.from_run) if args.from_run else None

    from tangram_jax.models.registry import load_model
    loaded = load_model(args.model)
    if args.chat_template is not None:
        from tangram_jax.models.tokenizer import load_chat_template
        loaded.tokenizer.use_chat_template(load_chat_template(args.chat_template))
    config = loaded.config
    heads = config.num_kv_heads
    for g in group_sizes:
        if g <= 0 or heads % g:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"--group-size {g} does not divide the {heads} KV heads of "
                             f"{loaded.name}; valid group sizes: {divisors}")

    if calib is not None:
        shape = next(iter(calib.retention.values())).shape[1:]
        if shape != (config.num_layers, heads):
            raise ValueError(f"--from-run {args.from_run} has [layers, heads] {shape}, the model "
                             f"has {(config.num_layers, heads)}")
        missing = [r for r in ratios if r not in calib.retention]
        if missing:
            raise ValueError(f"--from-run {args.from_run} has no ratio {missing}; it has "
                             f"{sorted(calib.retention)}")
    else:
        print(f"building {args.samples} pilot samples (seed {args.seed}, lengths {lengths})",
              file=sys.stderr)
        samples = build_pilot_samples(args.samples, chat_tokenizer(loaded.tokenizer),
                                      seed=args.seed, lengths=lengths, tasks=tasks)
        # Scores are computed once per sample; every ratio is selected from the same scores.
        calib = run_calibration(loaded.model, config, samples, ratios, method=args.method,
                                safeguard=args.safeguard,
                                progress=lambda it: tqdm(it, desc="calibrating", unit="sample"),
                                tier_mass=args.tier_mass if args.tiers else None)
        if args.save_run:
            with atomic_path(args.save_run) as tmp:
                calib.save(tmp)

    fingerprint = dict(config.fingerprint(), name=loaded.name)
    summaries = {}
    for rho in ratios:
        profile = profile_from_run(
            calib, rho, model=fingerprint, lambda_=args.lambda_, group_size=group_sizes[0],
            grouping=args.grouping, rescale=args.rescale, tiers=args.tiers,
            metadata=dict(seed=args.seed, lengths=sorted(set(lengths)),
                          command="tangram-jax " + " ".join(sys.argv[1:])))
        summary = summarize(calib, rho, profile.budget,
                            tuple(sorted(set(group_sizes) | {d for d in (1, 2, 3, 4) if heads % d == 0})),
                            lambda_=None if args.rescale else args.lambda_)
        summaries[rho] = summary
        profile = _with_summary(profile, summary)
        for g in group_sizes:
            out = args.out.format(rho=rho, g=g)
            with atomic_path(out) as tmp:
                profile.regroup(g, args.grouping).save(tmp)
            print(f"profile written to {out}", file=sys.stderr)
        if args.plot:
            plot = args.plot.format(rho=rho)
            with atomic_path(plot) as tmp:
                retention_boxplot(calib.retention[rho], profile.budget, rho, tmp,
                                  title=f"{loaded.name}: {calib.method} rho={rho}, "
                                        f"{len(calib.tasks)} samples (heads by budget)")
            print(f"plot written to {plot}", file=sys.stderr)
        print(format_summary(summary))
    if args.summary_json:
        write_text_atomic(args.summary_json,
                          json.dumps({str(r): s for r, s in summaries.items()}, indent=1))
    return 0


def _check_outputs(args, ratios, group_sizes) -> None:
    """Every output path (each ratio's and group size's) writable before any work starts."""
    from tangram_jax.commands import check_output_path
    try:
        outs = {args.out.format(rho=r, g=g) for r in ratios for g in group_sizes}
        plots = {args.plot.format(rho=r) for r in ratios} if args.plot else set()
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--out / --plot placeholders must be {{rho}} and {{g}} (with a format "
                         f"such as {{rho:.2f}}), got an error formatting them: {e}") from None
    for flag, paths in (("--out", outs), ("--plot", plots),
                        ("--summary-json", {args.summary_json} - {None}),
                        ("--save-run", {args.save_run} - {None})):
        for path in sorted(paths):
            check_output_path(flag, path, overwrite=args.overwrite)
    if args.from_run:
        import os
        if not os.path.isfile(args.from_run):
            raise ValueError(f"--from-run {args.from_run!r}: no such file")


def _load_run(run_cls, path: str):
    """A saved calibration run, or one clear error naming the file."""
    try:
        return run_cls.load(path)
    except Exception as e:   # noqa: BLE001 - np.load raises many kinds for a bad file
        raise ValueError(f"--from-run {path!r} is not a calibration run saved by --save-run "
                         f"({type(e).__name__}: {e})") from None


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
