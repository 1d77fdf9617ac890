"""Throwaway probe: does a jitted call block the host while the device runs an earlier one?"""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

dev = jax.devices()[0]
N = int(os.environ.get("PROBE_LAYERS", "120"))
D = int(os.environ.get("PROBE_DIM", "8192"))


def body(x, w):
    y = x
    for _ in range(N):          # unrolled: fusions + GEMMs, command-buffer eligible
        y = jnp.tanh(y @ w) * 0.5
    return y


long_a = jax.jit(body)
long_b = jax.jit(lambda x, w: body(x, w) + 1)


def _small(pages, *ints):
    return pages.at[0, 0].add(sum(i.sum() for i in ints).astype(pages.dtype))


small = jax.jit(_small)
small_cond = jax.jit(lambda pages, *ints: jax.lax.cond(
    ints[0].sum() > 0, lambda: _small(pages, *ints), lambda: pages))
small_donate = jax.jit(_small, donate_argnums=0)

k = jax.random.normal(jax.random.key(0), (D, D), jnp.bfloat16)
x1 = jax.device_put(k, dev)
x2 = jax.device_put(k * 1.0, dev)
w = jax.device_put(k * 0.01, dev)
ints_np = [np.arange(4096, dtype=np.int32) + i for i in range(8)]
ints_dev = [jax.device_put(a, dev) for a in ints_np]
pages = jax.device_put(jnp.zeros((D // 2, D // 2), jnp.bfloat16), dev)

# warm every program
for f in (long_a, long_b):
    f(x1, w).block_until_ready()
small(pages, *ints_np).block_until_ready()
small(pages, *ints_dev).block_until_ready()
small_cond(pages, *ints_dev).block_until_ready()
p = small_donate(jnp.zeros_like(pages), *ints_np)
p = small_donate(p, *ints_dev).block_until_ready()
p2 = small_donate(long_a(x1, w)[:D // 2, :D // 2] * 0 + p, *ints_dev)
p2.block_until_ready()
pages_fresh = lambda: jax.device_put(jnp.zeros((D // 2, D // 2), jnp.bfloat16), dev)

t = time.perf_counter(); long_a(x1, w).block_until_ready(); long_ms = (time.perf_counter() - t) * 1e3


def timed(after):
    """Dispatch long_a, then time `after()`'s host call; returns ms."""
    jax.block_until_ready(x1)
    y = long_a(x1, w)
    time.sleep(0.002)
    t = time.perf_counter()
    out = after(y)
    dt = (time.perf_counter() - t) * 1e3
    jax.block_until_ready((y, out))
    return dt


cases = {
    "small_np": lambda y: small(pages, *ints_np),
    "small_dev": lambda y: small(pages, *ints_dev),
    "device_put_np": lambda y: jax.device_put(ints_np, dev),
    "small_donate_written_np": lambda y: small_donate(y[:D // 2, :D // 2], *ints_np),
    "small_donate_ready_dev": None,
    "same_program_other_input": lambda y: long_a(x2, w),
    "same_program_same_input": lambda y: long_a(x1, w),
    "other_program": lambda y: long_b(x1, w),
    "same_program_chained": lambda y: long_a(y, w),
    "np_asarray_ready": lambda y: np.asarray(ints_dev[0]),
    "small_cond_dev": lambda y: small_cond(pages, *ints_dev),
    "small_cond_after_long": lambda y: small_cond(y[:D // 2, :D // 2], *ints_dev),
}
res = {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
       "long_ms": long_ms}
for name, f in cases.items():
    if f is None:
        ts = []
        for _ in range(5):
            fresh = pages_fresh()
            fresh.block_until_ready()
            ts.append(timed(lambda y, fresh=fresh: small_donate(fresh, *ints_dev)))
    else:
        ts = [timed(f) for _ in range(5)]
    res[name] = round(statistics.median(ts), 3)
print(json.dumps(res))
out = os.environ.get("OUT")
if out:
    tag = sys.argv[1] if len(sys.argv) > 1 else "default"
    with open(f"{out}/probe_{tag}.json", "w") as fh:
        json.dump(res, fh, indent=1)
