"""`tangram-jax bench NAME`: run a benchmark of the harness (the checkout's `benchmarks/`).

Every script in `benchmarks/` is a benchmark of that name (`accuracy.py` is `bench accuracy`,
`gpu_check.sh` is `bench gpu_check`; a `_name.py` is a module the scripts import, no
benchmark); `serve` is part of the package. `tangram-jax bench` with no name lists them with
the first line of each script's header. Each benchmark measures Tangram
and its baselines in the same run and writes JSON with the device, the git revision and the
command: to a fresh `benchmarks/results/runs/NAME-<time>.json` unless its `--out` (`--json`)
names a file, and over a committed result only with `--overwrite`. Each says up front where it
writes and about how long it will take (`tangram_jax.benchmarking.results`); the results table
is `benchmarks/README.md`.
"""

from __future__ import annotations

import ast
import runpy
import subprocess
import sys
from pathlib import Path

HELP = ("Run a benchmark by name (`tangram-jax bench` lists them); writes a fresh "
        "benchmarks/results/runs/*.json unless told where (committed results only with "
        "--overwrite)")

# The benchmarks that live in the package rather than in the checkout's scripts.
PACKAGED = {
    "serve": "Multi-turn SCBench-shaped sessions, every mode of the ablation and vLLM beside it.",
}
SCRIPT_SUFFIXES = (".py", ".sh")


def benchmarks_dir() -> Path:
    """The checkout's `benchmarks/` folder (raises FileNotFoundError outside a checkout)."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    if not here.is_dir():
        raise FileNotFoundError("the benchmark harness lives in the source checkout's benchmarks/ "
                                "folder; install tangram-jax from a checkout (pip install -e .)")
    return here


def scripts(folder: Path | None = None) -> dict[str, Path]:
    """Benchmark name -> script: every `*.py` / `*.sh` directly in `benchmarks/`."""
    try:
        folder = benchmarks_dir() if folder is None else folder
    except FileNotFoundError:
        return {}
    found = {}
    for path in sorted(folder.iterdir()):
        if path.suffix in SCRIPT_SUFFIXES and path.is_file() and not path.name.startswith("_"):
            if path.stem in found or path.stem in PACKAGED:
                raise RuntimeError(f"two benchmarks are named {path.stem!r}: "
                                   f"{found.get(path.stem, 'the packaged one')} and {path}")
            found[path.stem] = path
    return found


def describe(path: Path) -> str:
    """The first sentence of a script's header (a Python module's docstring, or a shell
    script's comment lines after the shebang), on one line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        paragraph = (ast.get_docstring(ast.parse(text)) or "").strip().split("\n\n")[0]
    else:
        lines = []
        for line in text.splitlines()[1 if text.startswith("#!") else 0:]:
            body = line[1:] if line.startswith("#") else None
            if body is None or not body.strip() or body.startswith("   "):
                break   # the header's first paragraph ends at a blank or an indented usage line
            lines.append(body.strip())
        paragraph = " ".join(lines)
    sentence = " ".join(paragraph.split())
    return sentence[:sentence.index(". ") + 1] if ". " in sentence else sentence


def catalogue(folder: Path | None = None) -> dict[str, str]:
    """Benchmark name -> one-line description, every benchmark `bench NAME` runs."""
    out = dict(PACKAGED)
    out.update({name: describe(path) for name, path in scripts(folder).items()})
    return dict(sorted(out.items()))


def add_arguments(parser) -> None:
    parser.add_argument("benchmark", nargs="?", metavar="NAME",
                        choices=sorted(catalogue()),
                        help="the benchmark to run; `tangram-jax bench` with no name lists them")
    parser.add_argument("args", nargs="*", help="arguments passed to the benchmark "
                        "(put them after --, e.g. `tangram-jax bench end_to_end -- --turns 3`)")


def print_catalogue(out=None) -> None:
    out = sys.stdout if out is None else out
    names = catalogue()
    width = max(map(len, names))
    print("benchmarks (`tangram-jax bench NAME -- ARGS`; results in benchmarks/results/, the "
          "current table in benchmarks/README.md):", file=out)
    for name, what in names.items():
        print(f"  {name:<{width}}  {what}", file=out)


def run(args) -> int:
    if args.benchmark is None:
        print_catalogue()
        return 0
    if args.benchmark == "serve":   # part of the package, not a script of the checkout
        from tangram_jax.commands import bench_serve
        return bench_serve.main(list(args.args))
    return run_script(scripts()[args.benchmark], list(args.args))


def run_script(script: Path, argv: list[str]) -> int:
    """Run a benchmark script with `argv`: Python in this interpreter (as `python SCRIPT`
    would), shell scripts under bash from the checkout's root (their paths are relative to it).
    Returns the script's exit status."""
    if script.suffix == ".sh":
        return subprocess.run(["bash", str(script), *argv], cwd=script.parents[1]).returncode
    saved, sys.argv = sys.argv, [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:   # the benchmark's own exit: a status, or a message (status 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0
