"""One accuracy table from the parts of one run (`accuracy_gpu_all.sh` runs a process a part).

    python benchmarks/accuracy_merge.py --out benchmarks/results/accuracy.json \\
        --kvpress benchmarks/results/accuracy_kvpress.json A1.json A2.json ...

Writes the merged JSON (`tangram_jax.evaluation.report.merge_reports`: full KV's rows checked
equal across parts and kept once; rows of a non-default scoring rule labelled ``mode (rule)``),
its PNG beside it, and prints the markdown table (with kvpress's rows when its JSON is given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.evaluation.report import markdown_table, merge_reports, plot_accuracy  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="+", help="accuracy.py JSONs of one run")
    p.add_argument("--out", default=None, help="merged JSON; the PNG goes beside it "
                   "(default: a fresh file under benchmarks/results/runs/; a file git "
                   "tracks only with --overwrite)")
    p.add_argument("--kvpress", default=None, help="kvpress JSON to draw and tabulate beside ours")
    p.add_argument("--mixed-revisions", action="store_true",
                   help="admit parts of different git revisions (full KV's rows must still agree)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "accuracy_merge"})
    run = start("accuracy_merge", outputs, argv)
    merged = merge_reports(*(json.loads(Path(f).read_text()) for f in args.parts),
                           mixed_revisions=args.mixed_revisions)
    Path(args.out).write_text(json.dumps(merged, indent=1))
    reports = [merged]
    if args.kvpress:
        reports.append(json.loads(Path(args.kvpress).read_text()))
    plot_accuracy(Path(args.out).with_suffix(".png"), *reports)
    print(markdown_table(*reports))
    finish(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
