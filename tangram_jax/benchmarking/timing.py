"""The one timing helper of the benchmarks: wall time of a call ended by `block_until_ready`,
GPU busy time from a profiler trace, and percentiles of a list of samples."""

from __future__ import annotations

import contextlib
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
    trace = {}
    with device_trace(trace, top=None):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    devices = trace["devices"]
    first = devices.get("GPU:0")
    if not first:
        return None
    if per_kernel is not None:
        per_kernel.update({k: s / reps for k, s in first["kernels"].items()})
    if per_device is not None:
        per_device.update({d: {"busy_s": v["busy_s"] / reps,
                               "kernels": {k: s / reps for k, s in v["kernels"].items()}}
                           for d, v in devices.items()})
    return first["busy_s"] / reps


@contextlib.contextmanager
def device_trace(summary: dict, top: int | None = 12):
    """Profile the block's GPU work (CUPTI: ~1 us more a kernel launch; keep the block short,
    a serving run's trace is millions of events and minutes to collect); on exit `summary`
    receives
    ``{"seconds": s traced, "devices": {"GPU:0": {"busy_s": s, "programs": {program: s},
    "kernels": {name: s}}}}``: each GPU's seconds of stream activity in all, by XLA program
    (the trace's ``hlo_module``: a step's jitted program, numeric suffixes folded) and by
    kernel (fusion_3, fusion_12 -> fusion), each its `top` largest (None: all). No devices
    where the trace has no GPU events (CPU)."""
    import jax
    from jax._src.lib import _profile_data
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        started = time.perf_counter()
        try:
            yield summary
        finally:
            summary.update(seconds=time.perf_counter() - started, devices={})
            jax.profiler.stop_trace()
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return
        data = _profile_data.ProfileData.from_file(paths[0])
        names = []
        for plane in data.planes:
            device = re.match(r"/device:(GPU:\d+)", plane.name)
            if device is None:
                continue
            busy, programs, kernels = 0, {}, {}
            for line in plane.lines:
                names.append(line.name)
                if not line.name.startswith("Stream"):
                    continue
                for e in line.events:
                    ns = e.duration_ns
                    busy += ns
                    name = _fold(e.name)
                    kernels[name] = kernels.get(name, 0) + ns
                    module = _fold(next((str(v) for k, v in e.stats if k == "hlo_module"), "?"))
                    programs[module] = programs.get(module, 0) + ns
            if busy:
                summary["devices"][device.group(1)] = {
                    "busy_s": busy * 1e-9, "programs": _largest(programs, top),
                    "kernels": _largest(kernels, top)}
    if not _PRINTED_LINES and names:
        _PRINTED_LINES.append(names)
        print("profiler GPU lines:", sorted(set(names))[:12], flush=True)


def _fold(name: str) -> str:
    return re.sub(r"([._]\d+)+$", "", name)


def _largest(ns: dict, top: int | None) -> dict:
    """Seconds of the `top` largest entries of a name -> nanoseconds dict, largest first."""
    ranked = sorted(ns.items(), key=lambda kv: -kv[1])
    return {k: v * 1e-9 for k, v in (ranked if top is None else ranked[:top])}


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
