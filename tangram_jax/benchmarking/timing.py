"""The one timing helper of the benchmarks: wall time of a call ended by `block_until_ready`,
GPU busy time from a profiler trace, and percentiles of a list of samples."""

from __future__ import annotations

import glob
import re
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

_PRINTED_LINES: list = []


def wall_times(fn: Callable, args: Sequence = (), reps: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of ``fn(*args)`` (each ended by `block_until_ready`),
    after `warmup` untimed calls (compilation)."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def median_wall(fn: Callable, args: Sequence = (), reps: int = 5, warmup: int = 1) -> float:
    """Median of `wall_times`."""
    return float(np.median(wall_times(fn, args, reps, warmup)))


def wall_quantiles(fn: Callable, args: Sequence = (), reps: int = 5,
                   warmup: int = 2) -> tuple[float, float, float]:
    """(median, 10th, 90th percentile) of `wall_times`: a figure and its spread."""
    times = wall_times(fn, args, reps, warmup)
    return (float(np.median(times)), float(np.percentile(times, 10)),
            float(np.percentile(times, 90)))


def gpu_busy_time(fn: Callable, args: Sequence = (), reps: int = 5,
                  per_kernel: dict | None = None, per_device: dict | None = None
                  ) -> float | None:
    """Seconds of GPU stream activity per call of ``fn(*args)`` on the first GPU, from a
    profiler trace (CUPTI): device time without the host's launch gaps. None where the trace
    has no GPU events (CPU). `per_kernel`, a dict, receives the first GPU's seconds per call by
    kernel name (numeric suffixes folded: fusion_3, fusion_12 -> fusion); `per_device`, a dict,
    every GPU's: ``{"GPU:1": {"busy_s": s, "kernels": {name: s}}}`` (a program over several
    devices: collectives and each shard's work)."""
    import jax
    from jax._src.lib import _profile_data
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return None
        data = _profile_data.ProfileData.from_file(paths[0])
    total, names = 0, []
    for plane in data.planes:
        device = re.match(r"/device:(GPU:\d+)", plane.name)
        if device is None:
            continue
        first = device.group(1) == "GPU:0"
        mine = {"busy_s": 0.0, "kernels": {}}
        for line in plane.lines:
            if first:
                names.append(line.name)
            if line.name.startswith("Stream"):
                for e in line.events:
                    name = re.sub(r"([._]\d+)+$", "", e.name)
                    seconds = e.duration_ns * 1e-9 / reps
                    mine["busy_s"] += seconds
                    mine["kernels"][name] = mine["kernels"].get(name, 0.0) + seconds
                    if first:
                        total += e.duration_ns
                        if per_kernel is not None:
                            per_kernel[name] = per_kernel.get(name, 0.0) + seconds
        if per_device is not None and mine["busy_s"]:
            per_device[device.group(1)] = mine
    if not _PRINTED_LINES:
        _PRINTED_LINES.append(names)
        print("profiler GPU lines:", sorted(set(names))[:12], flush=True)
    return total * 1e-9 / reps if total else None


def busy_or_wall(fn: Callable, args: Sequence = (), reps: int = 5,
                 per_kernel: dict | None = None) -> float:
    """GPU busy seconds per call, or the median wall time where there is no GPU trace."""
    import jax
    jax.block_until_ready(fn(*args))
    t = gpu_busy_time(fn, args, reps, per_kernel=per_kernel)
    return t if t else median_wall(fn, args, reps, warmup=0)


def percentiles(samples: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict:
    """{"n": count, "p50": ..., "p90": ..., "p99": ..., "mean": ...}; None values when empty."""
    x = np.asarray([s for s in samples if s is not None], np.float64)
    out = {"n": int(x.size)}
    for q in qs:
        out[f"p{q}"] = float(np.percentile(x, q)) if x.size else None
    out["mean"] = float(x.mean()) if x.size else None
    return out
