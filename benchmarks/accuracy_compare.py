"""Compare two runs' answers sample by sample (the `--answers-out` JSONL of benchmarks/accuracy.py).

Used for batch dependence: the same samples served by the same mode with --max-active 128 and 1
must give the same greedy answers unless numerics differ between batch shapes. Prints how many
answers (sample, turn) both runs have, how many are token for token identical, the first
differing position of each that is not, and the accuracy of each run on the shared answers.

With `--mode-b` two modes are paired on the same samples (e.g. tangram@0.5 against
tangram+k8v4@0.5): with --tasks, per task the answers only one of them gets right and the
difference of accuracies (b - a, points) with a 95% interval over samples (a sample's turns
together), the resolution a paired comparison has where two columns' own intervals overlap.

    python benchmarks/accuracy_compare.py A.jsonl B.jsonl --mode full [--tasks TASKS.jsonl]
    python benchmarks/accuracy_compare.py A.jsonl B.jsonl --mode tangram@0.5 \
        --mode-b tangram+k8v4@0.5 --tasks TASKS.jsonl [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import resolve_outputs  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402


def load(path: str, mode: str) -> dict[tuple[str, int], dict]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if row["mode"] == mode:
                    out[(row["id"], row["turn"])] = row
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where a and b differ (len of the shorter if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--mode", default="full", help="the mode label to compare (e.g. full)")
    p.add_argument("--mode-b", default=None, help="run b's mode label (default: --mode)")
    p.add_argument("--json", default=None, help="write the paired comparison here (a file git "
                   "tracks only with --overwrite)")
    p.add_argument("--tasks", default=None,
                   help="task JSONL (accuracy_tasks.jsonl) to judge both runs' answers")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    if args.json:   # checked before the work
        resolve_outputs(p, args, {"json": "accuracy_compare"})
    for path in (args.a, args.b):
        if not Path(path).is_file():
            print(f"error: answers file {path} does not exist", file=sys.stderr)
            return 2
    mode_b = args.mode_b or args.mode
    a, b = load(args.a, args.mode), load(args.b, mode_b)
    shared = sorted(set(a) & set(b))
    if not shared:
        print(f"no answers of mode {args.mode!r} / {mode_b!r} in both files "
              f"({len(a)} in {args.a}, {len(b)} in {args.b})")
        return 1
    same = [k for k in shared if a[k]["token_ids"] == b[k]["token_ids"]]
    label = args.mode if mode_b == args.mode else f"{args.mode} vs {mode_b}"
    print(f"mode {label}: {len(shared)} answers in both runs, {len(same)} identical "
          f"token for token, {len(shared) - len(same)} differ")
    for k in shared:
        if a[k]["token_ids"] != b[k]["token_ids"]:
            at = first_difference(a[k]["token_ids"], b[k]["token_ids"])
            print(f"  {k[0]} turn {k[1]}: first difference at token {at}: "
                  f"{a[k]['text']!r} vs {b[k]['text']!r}")
    if args.tasks:
        from tangram_jax.evaluation.scoring import is_correct
        from tangram_jax.evaluation.tasks import read_jsonl
        answers = {s.id: s for s in read_jsonl(args.tasks)}
        for name, run in (("a", a), ("b", b)):
            right = sum(is_correct(answers[k[0]].turns[k[1]].answer, run[k]["text"])
                        for k in shared)
            print(f"run {name}: {right}/{len(shared)} correct")
        if args.mode_b:
            report = paired(shared, a, b, answers, is_correct)
            for task, row in report.items():
                print(f"  {task}: a {row['a_correct']}, b {row['b_correct']} of {row['answers']}"
                      f" ({row['identical']} identical); only a {row['only_a']}, only b "
                      f"{row['only_b']}; b - a {row['difference_points']:+.1f} points "
                      f"[{row['ci95_points'][0]:+.1f}, {row['ci95_points'][1]:+.1f}]")
            if args.json:
                Path(args.json).write_text(json.dumps(
                    {"a": args.a, "b": args.b, "mode_a": args.mode, "mode_b": mode_b,
                     "tasks_file": args.tasks, "answers": len(shared),
                     "identical": len(same), "by_task": report}, indent=1))
    return 0


def paired(shared, a, b, answers, is_correct) -> dict:
    """Per task: counts of correct answers of a and b, of answers only one gets right, and the
    accuracy difference b - a in points with a normal 95% interval over samples (the per-sample
    mean of b - a over its turns, so a multi-turn sample counts once)."""
    import numpy as np
    by_task: dict[str, dict[str, list]] = {}
    for k in shared:
        sample = answers[k[0]]
        truth = sample.turns[k[1]].answer
        ra, rb = is_correct(truth, a[k]["text"]), is_correct(truth, b[k]["text"])
        rows = by_task.setdefault(sample.task, {})
        rows.setdefault(k[0], []).append((ra, rb, a[k]["token_ids"] == b[k]["token_ids"]))
    report = {}
    for task, samples in sorted(by_task.items()):
        flat = [x for turns in samples.values() for x in turns]
        diffs = np.array([np.mean([rb - ra for ra, rb, _ in turns]) for turns in samples.values()])
        n = len(flat)
        # In points: 100 x the mean (and interval) of the per-sample differences.
        half = 196 * diffs.std(ddof=1) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        mean = 100 * diffs.mean()
        report[task] = {"samples": len(diffs), "answers": n,
                        "a_correct": sum(ra for ra, _, _ in flat),
                        "b_correct": sum(rb for _, rb, _ in flat),
                        "identical": sum(same for _, _, same in flat),
                        "only_a": sum(ra and not rb for ra, rb, _ in flat),
                        "only_b": sum(rb and not ra for ra, rb, _ in flat),
                        "difference_points": float(mean),
                        "ci95_points": [float(mean - half), float(mean + half)]}
    return report


if __name__ == "__main__":
    sys.exit(main())
