"""Accuracy under KV compression: generated multi-turn tasks, every mode against full KV.

Serves the tasks of `tangram_jax.evaluation.tasks` (key-value retrieval, passkey in essays,
three facts asked over three turns of one session, variable tracking) on the embedded
SmolLM2-135M-Instruct in `full`, `tangram` (shipped calibrated profiles), `dynamic` (per-input
Ada-SnapKV) and `uniform` (every head keeps the ratio) at each keep ratio, greedy. Writes:

- the task samples as JSONL (`--tasks-out`, default beside `--out`; benchmarks/
  kvpress_accuracy.py reads the same file);
- `--out` (default a fresh benchmarks/results/runs/accuracy-<time>.json; a committed result
  only with --overwrite): device, git revision, command, and per task x mode x ratio n, correct,
  accuracy, Wilson 95% CI, greedy agreement and KL with full KV (follow-up turns of the
  multi-turn task separately), plus a check that full KV solves every task >= 50%;
- a PNG of accuracy vs ratio per task (with kvpress's lines when its JSON exists).

Before the work it prints about how long the run will take (`estimate_seconds`: sessions x
configurations x a measured cost per session, plus the engines' start-up), and after full KV,
the measured cost of the rest.

    tangram-jax bench accuracy -- --samples 100                 # the table in the README
    tangram-jax bench accuracy -- --samples 2 --modes full,tangram --ratios 0.25   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import finish, output_path, start  # noqa: E402
from tangram_jax.commands import UsageError, add_overwrite_flag  # noqa: E402
from tangram_jax.compression.chunk_scoring import SCORING_RULE_CHOICES  # noqa: E402
from tangram_jax.provenance import device_description, git_revision  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def _sizes_json(sizes):
    """The task sizes a run generated its samples with, for its JSON (one per task after a
    pilot)."""
    if isinstance(sizes, dict):
        return {task: dataclasses.asdict(s) for task, s in sizes.items()}
    return sizes and dataclasses.asdict(sizes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="model to serve (default: the embedded SmolLM2; or a .gguf / HF folder)")
    p.add_argument("--samples", type=int, default=100, help="samples per task")
    p.add_argument("--tasks", type=_csv(str), default=None, help="comma-separated (default all)")
    p.add_argument("--modes", type=_csv(str), default=["full", "tangram", "dynamic", "uniform"],
                   help="comma-separated; a mode may name its KV precision after a '+' "
                        "(tangram+k8v4, tangram+k8v4-k4v2: precision tiers, tangram only)")
    p.add_argument("--ratios", type=_csv(float), default=[1.0, 0.5, 0.25])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pilot-samples", type=int, default=0,
                   help="before the table, choose each task's size with a full-KV pilot of this "
                        "many samples per candidate size (another seed): the hardest size full "
                        "KV answers >= 65%% of the time; 0: the default sizes")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length limit")
    p.add_argument("--max-active", type=int, default=16,
                   help="sessions served at once (also max_num_seqs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest session's bound; fix it to share compiled "
                        "programs between the pilot's and the table's full-KV engines")
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-prefill-rows", type=int, default=4)
    p.add_argument("--layer-loop", default=None, choices=[None, "scan", "unrolled"])
    p.add_argument("--tail-rule", default=None,
                   help="EngineConfig.tail_rule (kv_layout.TAIL_RULES; default the engine's)")
    p.add_argument("--scoring-rule", default=None, choices=SCORING_RULE_CHOICES,
                   help="EngineConfig.scoring_rule of the tangram and uniform engines "
                        "(chunk_scoring.SCORING_RULES; default the engine's); full and dynamic "
                        "keep 'window'")
    p.add_argument("--retention", default=None, choices=("auto", "turn", "chunk"),
                   help="EngineConfig.retention of the tangram and uniform engines (kv_layout."
                        "RETENTIONS; default the engine's); dynamic compresses per chunk")
    p.add_argument("--turn-view", default=None, choices=("whole", "recent"),
                   help="EngineConfig.turn_view of the tangram and uniform engines (kv_layout."
                        "TURN_VIEWS; default the engine's)")
    p.add_argument("--chat-template", default=None,
                   help="EngineConfig.chat_template: a Jinja file or template text in place of "
                        "the model's own (models that ship none need it)")
    p.add_argument("--profile", action="append", default=[],
                   help="a budget profile file the tangram mode serves at its ratio (its rho) "
                        "instead of the shipped SnapKV one, e.g. one from `tangram-jax calibrate "
                        "--method keydiff`; repeat for other ratios. Rows are labelled with the "
                        "profile's method")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="EngineConfig.gpu_memory_utilization (default the engine's): the share "
                        "of the card each engine's process may take; give each of several "
                        "processes on one GPU its share")
    p.add_argument("--obs-window", type=int, default=None,
                   help="EngineConfig.obs_window (default the engine's)")
    p.add_argument("--decode-buckets", type=_csv(int), default=None,
                   help="decode batch shapes to compile (default: the engine's; on a GPU one "
                        "bucket = --max-active saves compile time for every engine)")
    p.add_argument("--prefill-token-buckets", type=_csv(int), default=None,
                   help="EngineConfig.prefill_token_buckets: full KV's prefill sizes to compile "
                        "(default the engine's ladder; on a GPU each is a compile of tens of "
                        "seconds, so a run of many short engines gives one or two)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-kl", action="store_true", help="skip the teacher-forced KL pass")
    p.add_argument("--kl-top-k", type=int, default=256,
                   help="full KV's distribution is kept as its top k tokens plus the rest")
    p.add_argument("--tasks-out", default=None,
                   help="JSONL of the generated samples (default: beside --out, "
                        "<out>_tasks.jsonl)")
    p.add_argument("--tasks-in", default=None,
                   help="serve the samples of this JSONL (e.g. a previous run's) instead of "
                        "generating them (no pilot; --samples first samples of each task)")
    p.add_argument("--out", default=None,
                   help="result JSON (default: a fresh benchmarks/results/runs/"
                        "accuracy-<time>.json; a file git tracks only with --overwrite)")
    p.add_argument("--answers-out", default=None,
                   help="JSONL of every free-run answer (mode, sample id, turn, text, token ids)")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--kvpress", default=str(RESULTS / "accuracy_kvpress.json"),
                   help="kvpress results to draw beside ours, if the file exists")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    try:   # every output checked before the work (a committed result only with --overwrite)
        args.out = str(output_path("--out", args.out, "accuracy", overwrite=args.overwrite))
        stem = Path(args.out).with_suffix("")
        args.plot = str(output_path("--plot", args.plot or f"{stem}.png", "accuracy",
                                    overwrite=args.overwrite))
        if not args.tasks_in:
            args.tasks_out = str(output_path("--tasks-out", args.tasks_out or
                                             f"{stem}_tasks.jsonl", "accuracy_tasks",
                                             overwrite=args.overwrite))
        if args.answers_out:
            output_path("--answers-out", args.answers_out, "", overwrite=args.overwrite)
    except UsageError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")

    from tangram_jax.evaluation import tasks as task_mod
    from tangram_jax.evaluation.harness import HarnessConfig, choose_sizes, mode_specs, run_table
    from tangram_jax.evaluation.report import markdown_table, plot_accuracy

    tasks = tuple(args.tasks) if args.tasks else task_mod.TASKS
    t0 = time.perf_counter()
    specs = mode_specs(args.modes, args.ratios)
    cfg = HarnessConfig(
        model=args.model, max_tokens=args.max_tokens, max_active=args.max_active,
        max_model_len=args.max_model_len,
        kl=not args.no_kl, kl_top_k=args.kl_top_k, scoring_rule=args.scoring_rule,
        retention=args.retention,
        profiles=tuple(args.profile),
        engine_kwargs=dict(chunk_size=args.chunk_size, dtype=args.dtype,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_prefill_rows=args.max_prefill_rows, layer_loop=args.layer_loop,
                           **({"decode_buckets": tuple(args.decode_buckets)}
                              if args.decode_buckets else {}),
                           **({"prefill_token_buckets": tuple(args.prefill_token_buckets)}
                              if args.prefill_token_buckets else {}),
                           **({"tail_rule": args.tail_rule} if args.tail_rule else {}),
                           **({"turn_view": args.turn_view} if args.turn_view else {}),
                           **({"chat_template": args.chat_template}
                              if args.chat_template else {}),
                           **({"obs_window": args.obs_window} if args.obs_window else {}),
                           **({"gpu_memory_utilization": args.gpu_memory_utilization}
                              if args.gpu_memory_utilization else {})))
    sizes, pilot = task_mod.TaskSizes(), None
    if args.tasks_in:
        given = task_mod.read_jsonl(args.tasks_in)
        samples = [x for t in tasks for x in [y for y in given if y.task == t][:args.samples]]
        sizes = None
        print(f"{len(samples)} samples of {len(tasks)} tasks from {args.tasks_in}")
    else:
        if args.pilot_samples:
            sizes, pilot = choose_sizes(tasks, args.pilot_samples, args.seed, cfg)
        samples = task_mod.generate_all(tasks, args.samples, args.seed, sizes)
        task_mod.write_jsonl(samples, args.tasks_out)
        print(f"{len(samples)} samples of {len(tasks)} tasks ({sizes}) -> {args.tasks_out}")
    command = " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))
    outputs = [Path(args.out), Path(args.plot)] + ([] if args.tasks_in else [Path(args.tasks_out)])
    run = start("bench accuracy", outputs, argv, estimate=_estimate(samples, specs, cfg))

    def write_partial(partial: dict) -> None:
        # After every (mode, ratio): a run stopped by a time limit keeps its finished columns.
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"benchmark": "accuracy", "device": device_description(),
             "git_revision": git_revision() or "unknown", "command": command,
             "config": vars(args), "task_sizes": _sizes_json(sizes),
             "pilot": pilot,
             "seconds": round(time.perf_counter() - t0, 1), **partial},
            indent=1))

    def write_answers(label: str, outputs: dict) -> None:
        with open(args.answers_out, "a", encoding="utf-8") as f:
            for sample_id, turns in outputs.items():
                for turn, out in enumerate(turns):
                    f.write(json.dumps({"mode": label, "id": sample_id, "turn": turn,
                                        "text": out.text, "token_ids": out.token_ids}) + "\n")

    if args.answers_out:
        Path(args.answers_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.answers_out).write_text("")
    table = run_table(samples, specs, cfg, on_partial=write_partial,
                      on_answers=write_answers if args.answers_out else None)
    report = {
        "benchmark": "accuracy",
        "device": device_description(),
        "git_revision": git_revision() or "unknown",
        "command": command,
        "config": vars(args),
        "tasks_file": str(Path(args.tasks_in or args.tasks_out).name),
        "task_sizes": _sizes_json(sizes),
        "pilot": pilot,
        "seconds": round(time.perf_counter() - t0, 1),
        **table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    reports = [report]
    if args.kvpress and Path(args.kvpress).is_file():
        kvpress = json.loads(Path(args.kvpress).read_text())
        # kvpress_accuracy.py serves the embedded model: its rows stand beside this run's only
        # for that model on the same samples.
        if args.model is None and Path(kvpress["config"]["tasks_file"]).name == \
                report["tasks_file"]:
            reports.append(kvpress)
        else:
            print(f"kvpress results of {args.kvpress} left out: they are of the embedded model "
                  f"on {kvpress['config']['tasks_file']}")
    plot = args.plot
    plot_accuracy(plot, *reports)
    print(markdown_table(*reports))
    for c in report["checks"]:
        if not c["solvable"]:
            print(f"WARNING: full KV answers {c['task']} only {100 * c['full_kv_accuracy']:.0f}% "
                  f"of the time (< {100 * c['threshold']:.0f}%): the task does not test "
                  "compression on this model")
    print(f"KL: {report['kl_status']}")
    finish(run)
    print(f"wrote {args.out} and {plot}")
    return 0


def _estimate(samples, specs, cfg) -> tuple[float, str] | None:
    """The up-front estimate on a CPU (`harness.estimate_seconds`: the sessions' tokens x a
    cost per token measured on a 2-core CPU); None on a GPU (`start` then falls back to an
    earlier run's time)."""
    from tangram_jax.benchmarking.results import machine_kind
    from tangram_jax.evaluation.harness import (estimate_seconds, harness_tokenizer,
                                                missing_logprob_api, session_lengths)

    if machine_kind() == "gpu":
        return None
    tokens = sum(session_lengths(harness_tokenizer(cfg), samples, cfg.max_tokens))
    kl = cfg.kl and not missing_logprob_api()
    seconds = estimate_seconds(tokens, len(specs), kl)
    return seconds, (f"{len(samples)} sessions of {tokens:,} tokens in all, x {len(specs)} "
                     f"configurations{' + the KL passes' if kl else ''}, at a cost per token "
                     f"measured on a 2-core CPU; a busy machine is slower")


if __name__ == "__main__":
    sys.exit(main())
