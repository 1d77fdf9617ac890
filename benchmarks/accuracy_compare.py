"""Compare two runs' answers sample by sample (the `--answers-out` JSONL of benchmarks/accuracy.py).

Used for batch dependence: the same samples served by the same mode with --max-active 128 and 1
must give the same greedy answers unless numerics differ between batch shapes. Prints how many
answers (sample, turn) both runs have, how many are token for token identical, the first
differing position of each that is not, and the accuracy of each run on the shared answers.

    python benchmarks/accuracy_compare.py A.jsonl B.jsonl --mode full [--tasks TASKS.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    p.add_argument("--tasks", default=None,
                   help="task JSONL (accuracy_tasks.jsonl) to judge both runs' answers")
    args = p.parse_args(argv)
    for path in (args.a, args.b):
        if not Path(path).is_file():
            print(f"error: answers file {path} does not exist", file=sys.stderr)
            return 2
    a, b = load(args.a, args.mode), load(args.b, args.mode)
    shared = sorted(set(a) & set(b))
    if not shared:
        print(f"no answers of mode {args.mode!r} in both files "
              f"({len(a)} in {args.a}, {len(b)} in {args.b})")
        return 1
    same = [k for k in shared if a[k]["token_ids"] == b[k]["token_ids"]]
    print(f"mode {args.mode}: {len(shared)} answers in both runs, {len(same)} identical "
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
