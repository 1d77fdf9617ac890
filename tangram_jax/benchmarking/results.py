"""The one result writer of the benchmarks: every JSON under `benchmarks/results/` carries where
it came from (device, git revision, command, UTC time, JAX version) beside the figures."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from tangram_jax.atomic_files import write_text_atomic
from tangram_jax.provenance import device_description, git_revision

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def provenance(argv: list[str] | None = None) -> dict:
    """Device, revision (`GIT_REV` from the environment first: a copied tree on the device
    machine answers `git rev-parse` with a stale revision), command, time, JAX version."""
    import jax
    argv = sys.argv if argv is None else argv
    return {"device": device_description(),
            "git_revision": git_revision() or "unknown",
            "command": " ".join([Path(argv[0]).name, *argv[1:]]) if argv else "",
            "utc_time": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ"),
            "jax_version": jax.__version__}


def write_result(path: str | os.PathLike, benchmark: str, body: dict,
                 argv: list[str] | None = None) -> Path:
    """Write ``{"benchmark": ..., provenance..., **body}`` as JSON to `path` (atomically: a
    run cut off mid-write leaves the previous file). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": benchmark, **provenance(argv), **body}
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
