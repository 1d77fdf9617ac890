"""Control-plane metrics: host time per step, pool use, fragmentation, reclaim, preemptions."""

from __future__ import annotations

import numpy as np


class SchedulerMetrics:
    """Counters the scheduler updates as it runs.

    `step_host_seconds[i]` is the host time of step i spent in the control plane: `schedule()`
    (admission, decode growth, preemption, chunk planning, device feed) plus `commit()` (length
    bookkeeping, reclaim in the dynamic baseline).
    """

    def __init__(self):
        self.step_host_seconds: list[float] = []
        self.num_preemptions = 0
        self.num_evictions = 0
        self.num_capped = 0
        self.num_rejected = 0
        self.num_admitted = 0

    def start_step(self, seconds: float) -> None:
        self.step_host_seconds.append(seconds)

    def add_to_step(self, seconds: float) -> None:
        if self.step_host_seconds:
            self.step_host_seconds[-1] += seconds

    def summary(self, usage: dict) -> dict:
        """Counters plus `usage` (a `KVCacheManager.usage()` snapshot) as one flat dict."""
        times = np.asarray(self.step_host_seconds)
        out = {
            "steps": int(times.size),
            "host_ms_per_step_median": float(np.median(times) * 1e3) if times.size else 0.0,
            "host_ms_per_step_p90": float(np.percentile(times, 90) * 1e3) if times.size else 0.0,
            "preemptions": self.num_preemptions,
            "evictions": self.num_evictions,
            "capped": self.num_capped,
            "rejected": self.num_rejected,
            "admitted": self.num_admitted,
        }
        out.update(usage)
        return out
