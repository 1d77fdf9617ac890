"""Control-plane metrics: host time per step, pool use, fragmentation, reclaim, preemptions.

Bounded for a long-running engine: per-step host times are kept as running totals (count, sum,
max) plus a window of the most recent steps for the percentiles, never a list of every step.
"""

from __future__ import annotations

import collections

import numpy as np

# Steps whose host times the percentiles are taken over (about a minute of a busy engine).
DEFAULT_WINDOW = 4096


class SchedulerMetrics:
    """Counters the scheduler updates as it runs.

    A step's host time is the time spent in the control plane: `schedule()` (admission, decode
    growth, preemption, chunk planning, device feed) plus `commit()` and `finish()` (length
    bookkeeping, reclaim in the dynamic baseline). `step_host_seconds` holds the last `window`
    steps' times; `num_steps`, `total_host_seconds` and `max_host_seconds` cover every step.
    """

    def __init__(self, window: int = DEFAULT_WINDOW):
        self.reset(window)
        self.num_preemptions = 0
        self.num_evictions = 0
        self.evicted_recompute_tokens = 0   # history tokens of evicted sessions (re-prefill cost)
        # Evictions swapped to the host tier, turns that copied a session back, the bytes
        # swapped out, and host copies dropped to make room (those sessions recompute).
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.swapped_out_bytes = 0
        self.num_host_drops = 0
        self.num_capped = 0
        self.num_rejected = 0
        self.num_admitted = 0

    def reset(self, window: int | None = None) -> None:
        """Forget the step times (e.g. after a benchmark's warmup); `window` resizes the window."""
        window = self._window.maxlen if window is None else int(window)
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self._window: collections.deque[float] = collections.deque(maxlen=window)
        self.num_steps = 0
        self.total_host_seconds = 0.0
        self.max_host_seconds = 0.0

    @property
    def step_host_seconds(self) -> np.ndarray:
        """Host seconds of the most recent steps (at most `window`), oldest first."""
        return np.fromiter(self._window, np.float64, len(self._window))

    def start_step(self, seconds: float) -> None:
        self._close_step()
        self._window.append(seconds)
        self.num_steps += 1

    def add_to_step(self, seconds: float) -> None:
        if self._window:
            self._window[-1] += seconds

    def _close_step(self) -> None:
        """Fold the step that just ended into the running totals."""
        if self._window:
            last = self._window[-1]
            self.total_host_seconds += last
            self.max_host_seconds = max(self.max_host_seconds, last)

    def summary(self, usage: dict) -> dict:
        """Counters plus `usage` (a `KVCacheManager.usage()` snapshot) as one flat dict."""
        times = self.step_host_seconds
        total = self.total_host_seconds + (times[-1] if times.size else 0.0)
        out = {
            "steps": self.num_steps,
            "host_ms_per_step_mean": float(total / self.num_steps * 1e3) if self.num_steps else 0.0,
            "host_ms_per_step_median": float(np.median(times) * 1e3) if times.size else 0.0,
            "host_ms_per_step_p90": float(np.percentile(times, 90) * 1e3) if times.size else 0.0,
            "host_ms_per_step_max": float(max(self.max_host_seconds,
                                              times[-1] if times.size else 0.0) * 1e3),
            "host_time_window_steps": int(times.size),
            "preemptions": self.num_preemptions,
            "evictions": self.num_evictions,
            "evicted_recompute_tokens": self.evicted_recompute_tokens,
            "swapped_out": self.num_swapped_out,
            "swapped_in": self.num_swapped_in,
            "swapped_out_bytes": self.swapped_out_bytes,
            "host_copies_dropped": self.num_host_drops,
            "capped": self.num_capped,
            "rejected": self.num_rejected,
            "admitted": self.num_admitted,
        }
        out.update(usage)
        return out
