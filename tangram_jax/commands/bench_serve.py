"""`tangram-jax bench serve`: SCBench-shaped multi-turn sessions, closed and open loop, in every
configuration of the ablation (`tangram_jax.benchmarking.serve.VARIANTS`) and, with `--vllm`,
through vLLM's CPU backend on the same sessions and KV bytes; one JSON and one PNG.

    tangram-jax bench serve -- --context-tokens 1000 --sessions 8 --followups 2 \
        --question-tokens 24 --answer-tokens 32 --kv-gib 1 --variants full,tangram --vllm
    # GPU, Llama-3.1-8B shape with random bf16 weights built on the device:
    tangram-jax bench serve -- --model random-llama-8b --classes mid,long --sessions 16 \
        --rates 0.05,0.1 --kv-cache-tokens 400000
    # configurations run apart (one a GPU: benchmarks/serve_per_gpu.sh), then one report:
    tangram-jax bench serve -- --merge a.json b.json --json both.json
"""

from __future__ import annotations

import argparse
import os
import sys

from tangram_jax.commands import UsageError, add_overwrite_flag, check_output_path

DEFAULT_VARIANTS = "full,reserve-mono,ragged,tangram,dynamic"
# Engine fields this command sets itself (per configuration, or from its own flags).
_OWN_FIELDS = ("model", "mode", "profile", "ratio", "group_size", "warmup", "kv_cache_tokens",
               "kv_cache_memory_bytes", "num_pages", "split_map")


def _positive_floats(what: str, distinct: bool = False):
    """argparse type: comma-separated numbers > 0 (`distinct`: none twice, returned sorted)."""
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got "
                                             f"{text!r}") from None
        if any(not 0 < v < float("inf") for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text!r}")
        if distinct:
            if not values:
                raise argparse.ArgumentTypeError(f"give at least one of the {what}")
            if len(set(values)) < len(values):
                raise argparse.ArgumentTypeError(f"{what} must be distinct, got {text!r}")
            values = sorted(values)
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    from tangram_jax.benchmarking.models import RANDOM_8B, RANDOM_TINY
    from tangram_jax.benchmarking.serve import VARIANTS
    from tangram_jax.benchmarking.workload import CONTEXT_CLASSES
    from tangram_jax.commands import positive_int
    from tangram_jax.engine.config import add_cli_args
    p = argparse.ArgumentParser(prog="tangram-jax bench serve",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help=f"'smollm2' (embedded, shipped profiles), '{RANDOM_8B}' / '{RANDOM_TINY}' "
                        f"(random weights built on the device, a skewed profile), or a HF folder")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="configurations, comma-separated: " + "; ".join(
                       f"{k}: {v}" for k, v in VARIANTS.items()) + ". A configuration may name "
                   "its KV precision after a '+' (tangram+k8v4, tangram+k8v4-k4v2), else it "
                   "takes --kv-precision; precision tiers (k8v4-k4v2) serve tangram-mode "
                   "configurations only (e.g. --kv-precision k8v4-k4v2 --variants "
                   "full+bf16,tangram+bf16,tangram). A name ending in /recompute evicts idle "
                   "sessions by dropping their KV (no host-memory tier); beside the same "
                   "name without it, the report compares offload with recompute "
                   "(e.g. --think-time 30 --variants full,full/recompute,tangram,"
                   "tangram/recompute)")
    p.add_argument("--classes", default="mid",
                   help=f"context classes of the closed-loop runs, comma-separated "
                        f"({', '.join(f'{k} {v}' for k, v in CONTEXT_CLASSES.items())} tokens)")
    p.add_argument("--context-tokens", type=positive_int, default=None,
                   help="one closed-loop workload of this context length instead of --classes")
    p.add_argument("--sessions", type=positive_int, default=8, help="sessions per workload")
    p.add_argument("--followups", type=int, default=2, help="follow-up turns per session")
    p.add_argument("--question-tokens", type=positive_int, default=64)
    p.add_argument("--answer-tokens", type=positive_int, default=128,
                   help="output tokens of every turn (greedy, EOS ignored)")
    p.add_argument("--rates", type=_positive_floats("rates"), default=[],
                   help="open-loop session rates (sessions/s, Poisson), comma-separated")
    p.add_argument("--rate-variants", default="full,tangram",
                   help="configurations that also serve the open-loop workloads")
    p.add_argument("--rate-sessions", type=positive_int, default=None,
                   help="sessions of each open-loop workload (default --sessions)")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean think time, seconds: each follow-up is sent an exponential time "
                        "of this mean after the previous answer ended (0: at once)")
    p.add_argument("--ratio", type=float, default=0.25, help="retention target rho")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="heads per group G of ragged/tangram (default: 1 for the embedded "
                        "model's 3 KV heads, 2 otherwise)")
    p.add_argument("--profile-seed", type=int, default=0,
                   help="seed of the skewed profile of random / HF models")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-gib", type=_positive_floats("pool sizes (GiB)", distinct=True),
                      default=None,
                      help="KV pool bytes, GiB, the same in every configuration and for vLLM "
                           "(EngineConfig.kv_cache_memory_bytes: a quantised or tiered KV "
                           "precision holds more tokens in them); several, comma-separated, "
                           "sweep the pool: every configuration at every size, one report and "
                           "a plot of turns/s and follow-up TTFT against the pool")
    pool.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                      help="KV pool as bf16 full-KV tokens' head-token slots, the same slots in "
                           "every configuration (the same bytes for bf16 ones; a quantised "
                           "precision holds them in fewer bytes)")
    p.add_argument("--vllm", action="store_true",
                   help="also serve the closed-loop workloads with vLLM's CPU backend")
    p.add_argument("--vllm-model", default="/work/main/.cache/smollm2-135m-hf",
                   help="the model as a Hugging Face folder for vLLM (float32)")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's virtual environment")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the sessions' tokens and arrivals")
    p.add_argument("--json", default=None, help="output JSON (default: a fresh "
                   "benchmarks/results/runs/serve-<time>.json; a file git tracks, such as the "
                   "committed serve_<cpu|gpu>.json, only with --overwrite)")
    p.add_argument("--plot", default=None, help="output PNG (default: the JSON's name, .png)")
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations the output JSON already holds from an earlier "
                        "invocation of the same benchmark (same device, model, pool, engine "
                        "settings and workloads: refused otherwise) and run only the others; "
                        "for runs longer than one process may take; needs --json")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a folder holding another revision's tangram_jax package (and that "
                        "revision in DIR/REVISION): the same command runs from it first, in "
                        "its own process, and the report holds its results and ours over its "
                        "(turns_per_s_vs_baseline): a before / after on one machine, e.g. "
                        "git archive REV tangram_jax | tar -x -C DIR && echo REV > DIR/REVISION")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="instead of running: merge these reports of runs that measured the "
                        "same thing (device, revision, model, pool, engine settings), e.g. one "
                        "configuration a GPU side by side, or one workload a run, into --json "
                        "and its plot, ratios computed across them")
    add_overwrite_flag(p)
    add_cli_args(p, exclude=_OWN_FIELDS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        return _merge(args, argv)

    from tangram_jax.benchmarking import serve
    from tangram_jax.benchmarking.models import (RANDOM_8B, RANDOM_TINY, random_model_source,
                                                  random_model_config)
    from tangram_jax.benchmarking.results import finish, output_path, start, write_result
    from tangram_jax.benchmarking.workload import (CONTEXT_CLASSES, SessionSpec,
                                                   context_class_of)
    from tangram_jax.engine.config import from_cli_args
    from tangram_jax.models.registry import load_model

    variants = [v for v in args.variants.split(",") if v]
    rate_variants = [v for v in args.rate_variants.split(",") if v] if args.rates else []
    for v in variants + rate_variants:
        try:
            serve.parse_variant(v, args.kv_precision)
        except ValueError as e:
            raise UsageError(f"--variants: {e}") from None
    if args.followups < 0:
        raise UsageError(f"--followups must be >= 0, got {args.followups}")
    if not 0 <= args.think_time < float("inf"):
        raise UsageError(f"--think-time must be a number of seconds >= 0, got {args.think_time}")
    if not 0 < args.ratio <= 1:
        raise UsageError(f"--ratio must be in (0, 1], got {args.ratio}")
    if args.resume and args.json is None:
        raise UsageError("--resume needs --json: the output of the run to resume")
    if args.baseline is not None:
        if args.resume or args.vllm:
            raise UsageError("--baseline runs both sides in one invocation: without --resume "
                             "and --vllm")
        if not os.path.isfile(os.path.join(args.baseline, "tangram_jax", "__init__.py")):
            raise UsageError(f"--baseline {args.baseline!r} holds no tangram_jax package "
                             f"(expected {os.path.join(args.baseline, 'tangram_jax')})")
    pools = args.kv_gib or [None]       # GiB per sweep point; [None]: --kv-cache-tokens
    if args.vllm and len(pools) > 1:
        raise UsageError(f"--vllm serves one pool; --kv-gib sweeps {len(pools)}: give one size")
    out = output_path("--json", args.json, "serve", overwrite=args.overwrite)
    plot_path = check_output_path("--plot", args.plot or out.with_suffix(".png"),
                                  overwrite=args.overwrite)
    run = start("bench serve", [out, plot_path], argv)

    # The model: built anew for every configuration (the runner takes its layers over).
    if args.model in (RANDOM_8B, RANDOM_TINY):
        dtype = args.dtype if args.dtype != "auto" else "bfloat16"
        factory = random_model_source(args.model, dtype)
        model_config, profile_seed = random_model_config(args.model), args.profile_seed
    else:
        loaded = load_model(args.model, dtype=args.dtype)
        model_config, name = loaded.config, args.model
        del loaded
        factory = lambda: load_model(name, dtype=args.dtype)   # noqa: E731
        profile_seed = None if args.model == "smollm2" else args.profile_seed
    group_size = args.group_size or (1 if model_config.num_kv_heads == 3 else 2)

    # The workloads: closed loop per context class (or one length), open loop per rate.
    common = dict(num_sessions=args.sessions, followups=args.followups,
                  question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
                  seed=args.workload_seed, think_time=args.think_time)
    if args.context_tokens:
        lengths = [(f"{context_class_of(args.context_tokens)}-{args.context_tokens}",
                    args.context_tokens)]
    else:
        classes = [c for c in args.classes.split(",") if c]
        for c in classes:
            if c not in CONTEXT_CLASSES:
                raise UsageError(f"--classes: unknown class {c!r}; expected "
                                 f"{', '.join(CONTEXT_CLASSES)}")
        lengths = [(c, CONTEXT_CLASSES[c]) for c in classes]
    closed = [(name, SessionSpec(context_tokens=n, **common)) for name, n in lengths]
    rate_spec = dict(common, num_sessions=args.rate_sessions or args.sessions)
    rated = [(f"{lengths[0][0]}@{r:g}/s", SessionSpec(context_tokens=lengths[0][1],
                                                       arrival="poisson", session_rate=r,
                                                       **rate_spec)) for r in args.rates]
    longest = max(s.session_tokens() for _, s in closed + rated)
    itemsize = 2 if (args.dtype in ("bfloat16", "float16") or
                     (args.dtype == "auto" and profile_seed is not None)) else 4
    token_bytes = 2 * model_config.num_layers * model_config.num_kv_heads * \
        model_config.head_dim * itemsize
    if not args.kv_cache_tokens and not args.kv_gib:
        raise UsageError("give the KV pool: --kv-gib or --kv-cache-tokens (equal bytes in every "
                         "configuration)")
    kv_tokens = [args.kv_cache_tokens] if args.kv_cache_tokens else \
        [int(gib * 2**30 // token_bytes) for gib in pools]
    engine_cfg = from_cli_args(args)
    fields = {name: getattr(engine_cfg, name) for name in args._engine_fields}
    if fields.get("max_model_len") is None:
        fields["max_model_len"] = longest + 64

    def pool_fields(gib: float | None) -> dict:
        """--kv-gib: equal bytes (each configuration's page format decides the tokens they
        hold); --kv-cache-tokens: equal slots."""
        if gib is None:
            return dict(fields, kv_cache_tokens=args.kv_cache_tokens)
        return dict(fields, kv_cache_memory_bytes=int(gib * 2**30))

    workloads = [{"name": n, "arrival": s.arrival, "session_rate": s.session_rate,
                  "context_tokens": s.context_tokens, "sessions": s.num_sessions,
                  "followups": s.followups, "question_tokens": s.question_tokens,
                  "answer_tokens": s.answer_tokens, "turns": s.num_turns,
                  "think_time": s.think_time}
                 for n, s in closed + rated]
    report = {"model": args.model, "model_shape": {
                  k: getattr(model_config, k) for k in ("num_layers", "hidden_size", "num_heads",
                                                        "num_kv_heads", "head_dim", "vocab_size")},
              "ratio": args.ratio, "group_size": group_size,
              "kv_cache_tokens": kv_tokens[0] if len(kv_tokens) == 1 else kv_tokens,
              "kv_cache_gib": pools if len(pools) > 1 else
              pools[0] or kv_tokens[0] * token_bytes / 2**30,
              "pool_sized_by": "bytes" if args.kv_gib else "bf16 full-KV tokens' slots",
              "engine_fields": fields,
              "workloads": workloads, "results": []}

    def save():
        write_result(out, "serve", report, ["tangram-jax bench serve", *(argv or sys.argv[1:])])

    if args.baseline is not None:   # first, as in the startup benchmark's A/B
        baseline = _run_baseline(args.baseline, argv if argv is not None else sys.argv[1:],
                                 out)
    done = set()
    if args.resume and out.exists():
        earlier = _resumable(out, report)
        report["results"] = [r for r in earlier["results"] if r["variant"] != "vllm"]
        report["earlier_invocations"] = earlier.get("earlier_invocations", []) + [
            {k: earlier.get(k) for k in ("git_revision", "command", "utc_time")}]
        done = {(r["variant"], r.get("kv_cache_gib")) for r in report["results"]}
        print(f"resuming {out}: keeping "
              f"{', '.join(sorted(v for v, _ in done)) or 'nothing'}")
    # One build a configuration: a sweep builds the largest pool it has left and serves each
    # size from it (`Engine.limit_kv_cache`: the compiled steps do not depend on the pages
    # handed out, so a size costs its serving, not a start-up).
    for variant in dict.fromkeys(variants + rate_variants):
        todo = [gib for gib in pools if (variant, gib) not in done]
        if not todo:
            continue
        mine = (closed if variant in variants else []) + \
            (rated if variant in rate_variants else [])
        limits = [int(gib * 2**30) for gib in todo] if len(pools) > 1 else [None]
        # The generator first: zip runs it to its end (freeing the engines) before stopping.
        for result, gib in zip(serve.run_variant(
                variant, factory, model_config, pool_fields(todo[-1]), mine, group_size,
                args.ratio, profile_seed, limits), todo):
            report["results"].append(dict(result, kv_cache_gib=gib))
            save()    # after every run: a run cut short keeps what it measured
    if args.vllm:
        # kv_cache_tokens rounds --kv-gib down to whole tokens: within a token of whole GiB.
        gib = kv_tokens[0] * token_bytes / 2**30
        if abs(gib - round(gib)) > token_bytes / 2**30 or round(gib) < 1:
            raise UsageError(f"--vllm needs a whole number of GiB of KV (VLLM_CPU_KVCACHE_SPACE), "
                             f"got {gib:.3f}: use --kv-gib N")
        report["results"].append(serve.run_vllm(
            args.vllm_model, closed, model_config.vocab_size, int(round(gib)),
            fields["max_model_len"], args.vllm_python or serve.VLLM_PYTHON))
        save()
    serve.add_ratios(report)
    if args.baseline is not None:
        serve.add_baseline(report, baseline)
        for r in report["results"]:
            for w in r["workloads"]:
                if "turns_per_s_vs_baseline" in w:
                    print(f"{r['variant']} {w['workload']}: {w['turns_per_s']:.3f} turns/s, "
                          f"{w['turns_per_s_vs_baseline']:.3f}x the baseline's "
                          f"({baseline.get('git_revision')})")
    if len(pools) > 1:
        report["eviction_onset"] = serve.eviction_onset(report)
    save()
    (serve.plot_sweep if len(pools) > 1 else serve.plot)(report, plot_path)
    print(serve.table(report))
    finish(run)
    print(f"wrote {out} and {plot_path}")
    return 0


# Our own outputs, left out of the command the baseline runs (it writes to a file of ours).
_OUTPUT_FLAGS = ("--baseline", "--json", "--plot")


def _run_baseline(folder: str, argv: list[str], out) -> dict:
    """Run `argv` (this invocation's, less `_OUTPUT_FLAGS` and --overwrite) as `bench serve`
    from the package in `folder` (first on its path, in its own process, `GIT_REV` from
    folder/REVISION) and return its report; a failure raises UsageError (its output is on
    this process's)."""
    import json
    import subprocess
    from pathlib import Path

    command, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _OUTPUT_FLAGS:
            skip = True
        elif a != "--overwrite" and not a.startswith(tuple(f + "=" for f in _OUTPUT_FLAGS)):
            command.append(a)
    root = Path(folder).resolve()
    revision = root / "REVISION"
    target = Path(out).with_name(Path(out).stem + ".baseline.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("GIT_REV", None)   # ours would name the baseline's results wrongly
    if revision.is_file():
        env["GIT_REV"] = revision.read_text().strip()
    print(f"baseline: bench serve from {root} ({env.get('GIT_REV', 'revision unknown')})",
          flush=True)
    target.unlink(missing_ok=True)   # a file of ours (older revisions have no --overwrite)
    done = subprocess.run([sys.executable, "-m", "tangram_jax.cli", "bench", "serve", "--",
                           *command, "--json", str(target)], cwd=root, env=env)
    if done.returncode != 0 or not target.is_file():
        raise UsageError(f"--baseline: bench serve from {root} failed (exit status "
                         f"{done.returncode}); its output is above")
    report = json.loads(target.read_text())
    target.unlink()
    target.with_suffix(".png").unlink(missing_ok=True)
    return report


def _merge(args, argv: list[str] | None) -> int:
    """`--merge A.json B.json ...`: one report of runs measured elsewhere (`serve.
    merge_reports`), written with their device and revision, plus its plot and table."""
    import json
    from pathlib import Path

    from tangram_jax.benchmarking import serve
    from tangram_jax.benchmarking.results import output_path, write_result
    if args.json is None:
        raise UsageError("--merge needs --json: the merged report's path")
    if args.resume:
        raise UsageError("--merge and --resume exclude each other: a merge runs nothing")
    reports = []
    for name in args.merge:
        try:
            reports.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as e:
            raise UsageError(f"--merge: cannot read {name!r} as a report: {e}") from None
    try:
        merged = serve.merge_reports(reports)
    except ValueError as e:
        raise UsageError(f"--merge: {e}") from None
    out = output_path("--json", args.json, "serve", overwrite=args.overwrite)
    plot_path = check_output_path("--plot", args.plot or out.with_suffix(".png"),
                                  overwrite=args.overwrite)
    measured_on = {k: merged.pop(k) for k in ("device", "git_revision", "jax_version")
                   if k in merged}
    write_result(out, "serve", merged, ["tangram-jax bench serve", *(argv or sys.argv[1:])],
                 measured_on=measured_on)
    merged.update(measured_on)
    sweep = isinstance(merged.get("kv_cache_gib"), list)
    (serve.plot_sweep if sweep else serve.plot)(merged, plot_path)
    print(serve.table(merged))
    print(f"merged {len(reports)} reports into {out} and {plot_path}")
    return 0


def _resumable(path, report: dict) -> dict:
    """The earlier report at `path` if it measured what `report` describes, on this device."""
    import json

    from tangram_jax.provenance import device_description
    earlier = json.loads(path.read_text())
    current = json.loads(json.dumps(report, default=str))   # tuples as lists, like the file
    current["device"] = device_description()
    for key in ("device", "model", "model_shape", "ratio", "group_size", "kv_cache_tokens",
                "engine_fields", "workloads"):
        if earlier.get(key) != current.get(key):
            raise UsageError(f"--resume: {path} measured another {key} ({earlier.get(key)!r}, "
                             f"now {current.get(key)!r}); give another --json or drop --resume")
    return earlier


if __name__ == "__main__":
    sys.exit(main())
