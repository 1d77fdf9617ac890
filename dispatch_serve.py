"""Throwaway probe: time each jitted program's host call while serving (`bench serve` args)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

from tangram_jax import cli
from tangram_jax.engine import model_runner as mr

stats: dict = {}
spy_started = []


class Timed:
    def __init__(self, name, fn):
        self._name, self._fn = name, fn

    def __getattr__(self, attr):
        return getattr(self._fn, attr)

    def __call__(self, *a, **k):
        n = stats.setdefault(self._name, [])
        if self._name == "_prefill" and len(n) == 60 and os.environ.get("PROBE_SPY") \
                and not spy_started:
            spy_started.append(1)
            subprocess.Popen([os.environ["PROBE_SPY"], "record", "--native", "--threads",
                              "-r", "40", "-d", "6", "-f", "raw", "-o",
                              f"{os.environ['OUT']}/spy_{sys.argv[1]}.txt",
                              "--pid", str(os.getpid())], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        t = time.perf_counter()
        out = self._fn(*a, **k)
        n.append(time.perf_counter() - t)
        return out


orig_init = mr.ModelRunner.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    for name in ("_prefill", "_decode", "_mixed", "_sample_rows", "_apply_table_updates",
                 "_apply_writes"):
        setattr(self, name, Timed(name, getattr(self, name)))


mr.ModelRunner.__init__ = init
rc = cli.main(sys.argv[2:])
summary = {}
for k, v in stats.items():
    v = np.array(v) * 1e3
    summary[k] = {"n": len(v), "sum_s": round(float(v.sum() / 1e3), 3),
                  "p50_ms": round(float(np.percentile(v, 50)), 3),
                  "p90_ms": round(float(np.percentile(v, 90)), 3),
                  "max_ms": round(float(v.max()), 3)}
print("PROBE", sys.argv[1], json.dumps(summary))
sys.exit(rc)
