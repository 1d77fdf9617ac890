"""The one result writer of the benchmarks: every JSON under `benchmarks/results/` carries where
it came from (device, git revision, command, UTC time, JAX version) beside the figures; and
where a benchmark's output goes (`output_path`): a fresh file under `benchmarks/results/runs/`
(git-ignored) unless the command names one, never over a file git tracks (the committed
results the READMEs quote) unless told to with --overwrite; and its up-front time estimate
(`start`, `finish`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

from tangram_jax.atomic_files import write_text_atomic
from tangram_jax.output_paths import UsageError, check_output_path
from tangram_jax.provenance import device_description, git_revision

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUNS_DIR = RESULTS_DIR / "runs"   # a run's own output by default (git-ignored)


def fresh_path(name: str, suffix: str = ".json") -> Path:
    """A new file name under `RUNS_DIR`: ``<name>-<UTC time><suffix>`` (``-2``, ``-3`` ... if
    taken); the folder is created."""
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = RUNS_DIR / f"{name}-{stamp}{suffix}", 1
    while path.exists() or path in _HANDED_OUT:   # not yet written: still taken
        n += 1
        path = RUNS_DIR / f"{name}-{stamp}-{n}{suffix}"
    _HANDED_OUT.add(path)
    return path


_HANDED_OUT: set[Path] = set()   # this process's fresh paths


def output_path(flag: str, given: str | os.PathLike | None, name: str, *, overwrite: bool,
                suffix: str = ".json") -> Path:
    """Where a benchmark writes the output of `flag`: `given`, checked before the work starts
    (its folder writable; a file git tracks only with `overwrite`: `commands.
    check_output_path`), or a fresh path (`fresh_path`). Raises `output_paths.UsageError`."""
    if given is None:
        return fresh_path(name, suffix)
    return check_output_path(flag, given, overwrite=overwrite)


def resolve_outputs(parser, args, names: dict[str, str], *, suffix: str = ".json") -> list[Path]:
    """For each output argument `dest` -> benchmark name in `names`: its path (`output_path`,
    the flag being ``--dest-with-dashes``; None: a fresh one), set on `args` as a string. A
    refused path is one error line, exit 2. Needs `add_overwrite_flag`."""
    paths = []
    for dest, name in names.items():
        flag = "--" + dest.replace("_", "-")
        try:
            path = output_path(flag, getattr(args, dest), name, overwrite=args.overwrite,
                               suffix=suffix)
        except UsageError as e:   # one line, exit 2 (argparse's error() adds the usage)
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        setattr(args, dest, str(path))
        paths.append(path)
    return paths


DURATIONS = RUNS_DIR / "durations.jsonl"   # every run's wall time, for the next estimate


@dataclasses.dataclass
class Run:
    """A benchmark run under way (`start`): what it is, when it began."""

    benchmark: str
    argv: list[str]
    started: float


def start(benchmark: str, outputs: list, argv: list[str] | None = None,
          estimate: tuple[float, str] | None = None) -> Run:
    """Say, before the work, where the results go and about how long it will take: `estimate`
    (seconds, and what they come from: a measured cost per unit of work or a simple model),
    else the wall time of the last run of the same benchmark and arguments on this kind of
    machine (`finish` records them). Returns the run for `finish`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if estimate is None:
        last = _last_duration(benchmark, argv)
        estimate = last and (last["seconds"], f"the last run of these arguments on this "
                                              f"machine kind took that, {last['utc_time']}")
    took = (f"about {duration_words(estimate[0])} ({estimate[1]})" if estimate else
            "no estimate yet (no earlier run of these arguments on this machine kind; this "
            f"run's time is recorded in {DURATIONS})")
    print(f"{benchmark}: writing {', '.join(str(p) for p in outputs)}; {took}", flush=True)
    return Run(benchmark, argv, time.perf_counter())


def finish(run: Run) -> float:
    """Record the run's wall time (git-ignored `DURATIONS`); returns it."""
    seconds = time.perf_counter() - run.started
    try:
        RUNS_DIR.mkdir(parents=True, exist_ok=True)
        with open(DURATIONS, "a", encoding="utf-8") as f:
            f.write(json.dumps({"benchmark": run.benchmark, "argv": run.argv,
                                "machine": machine_kind(), "seconds": round(seconds, 1),
                                "utc_time": _utc_now()}) + "\n")
    except OSError:
        pass   # a read-only checkout: the estimate is a convenience
    return seconds


def machine_kind() -> str:
    """What a duration is comparable across, known without starting JAX (which would fix the
    GPU allocator cap before the engine sets it): GPU or the CPU's core count."""
    return "gpu" if Path("/dev/nvidia0").exists() else f"cpu x{os.cpu_count()}"


def _last_duration(benchmark: str, argv: list[str]) -> dict | None:
    try:
        lines = DURATIONS.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    kind = machine_kind()
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("benchmark") == benchmark and rec.get("argv") == argv and \
                rec.get("machine") == kind:
            return rec
    return None


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration_words(seconds: float) -> str:
    """`seconds` as a short duration: s below 90 s, min below 90 min, else h."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def provenance(argv: list[str] | None = None) -> dict:
    """Device, revision (`GIT_REV` from the environment first: a copied tree on the device
    machine answers `git rev-parse` with a stale revision), command, time, JAX version."""
    import jax
    argv = sys.argv if argv is None else argv
    return {"device": device_description(),
            "git_revision": git_revision() or "unknown",
            "command": " ".join([Path(argv[0]).name, *argv[1:]]) if argv else "",
            "utc_time": _utc_now(),
            "jax_version": jax.__version__}


def write_result(path: str | os.PathLike, benchmark: str, body: dict,
                 argv: list[str] | None = None, measured_on: dict | None = None) -> Path:
    """Write ``{"benchmark": ..., provenance..., **body}`` as JSON to `path` (atomically: a
    run cut off mid-write leaves the previous file). `measured_on`: the device, revision and
    JAX version of figures measured elsewhere (a merge of runs), instead of this process's.
    Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": benchmark, **provenance(argv), **(measured_on or {}), **body}
    write_text_atomic(path, json.dumps(report, indent=2, default=_jsonable))
    return path


def _jsonable(x):
    import numpy as np
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
