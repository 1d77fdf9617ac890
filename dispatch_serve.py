"""Throwaway probe: time the engine's prefill dispatch while serving (`bench serve` args)."""
import json
import os
import sys
import time

import jax
import numpy as np

from tangram_jax import cli
from tangram_jax.engine import prefill_step as ps

PUT = os.environ.get("PROBE_PUT") == "1"
stats = {"put": PUT, "xla_flags": os.environ.get("XLA_FLAGS", ""), "calls": [], "puts": []}
orig = ps.PrefillSteps._call_prefill


def patched(self, args, static):
    if PUT:
        t = time.perf_counter()
        rep = self.placement.replicated
        args = jax.tree.map(lambda a: jax.device_put(a, rep) if isinstance(a, np.ndarray)
                            else a, args)
        stats["puts"].append(time.perf_counter() - t)
    if len(stats["calls"]) == 40 and os.environ.get("PROBE_SPY"):
        import subprocess
        subprocess.Popen([os.environ["PROBE_SPY"], "record", "--native", "--threads", "-r", "25",
                          "-d", "8", "-f", "raw", "-o", f"{os.environ['OUT']}/spy.txt",
                          "--pid", str(os.getpid())], stdout=open(f"{os.environ['OUT']}/spy.log", "w"),
                         stderr=subprocess.STDOUT)
    t = time.perf_counter()
    out = orig(self, args, static)
    stats["calls"].append(time.perf_counter() - t)
    return out


ps.PrefillSteps._call_prefill = patched
rc = cli.main(sys.argv[2:])
for k in ("calls", "puts"):
    v = np.array(stats[k]) * 1e3
    stats[k] = ({"n": len(v), "sum_s": float(v.sum() / 1e3), "p10_ms": float(np.percentile(v, 10)),
                 "p50_ms": float(np.percentile(v, 50)), "p90_ms": float(np.percentile(v, 90))}
                if len(v) else None)
print("PROBE", json.dumps(stats))
with open(f"{os.environ['OUT']}/serve_probe_{sys.argv[1]}.json", "w") as fh:
    json.dump(stats, fh, indent=1)
sys.exit(rc)
