"""Chunked-prefill kernels at a Llama-3.1-8B layer shape: Pallas vs their jnp references (GPU).

One 512-token chunk of one sequence (32 query / 8 KV heads, head_dim 128, G = 2, bf16, page 16)
over a retained history of `--hists` tokens per group: `chunk_prefill_attention` (with its
observation-window probabilities) and `compress_chunk_into_pages` (rho 0.25 profile). Times are
GPU busy time per call from a profiler trace, as in decode_attention.py.

    GIT_REV=$(git rev-parse HEAD) python benchmarks/prefill_kernels.py --out prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention import _gpu_busy_time, _median_time  # noqa: E402

from tangram_jax.kv_layout import chunk_keep_count  # noqa: E402
from tangram_jax.pallas_kernels.chunk_compress import (  # noqa: E402
    compress_chunk_into_pages, compress_chunk_into_pages_reference)
from tangram_jax.pallas_kernels.prefill_attention import (  # noqa: E402
    chunk_prefill_attention, chunk_prefill_attention_reference)

T, HQ, HKV, D, G, PS, OBS = 512, 32, 8, 128, 2, 16, 32
BUDGETS = np.array([0.04, 0.08, 0.20, 0.68])
DTYPE = jnp.bfloat16


def _time(fn, args, reps):
    t, _, _ = _median_time(fn, args, reps)
    gpu = _gpu_busy_time(fn, args, reps)
    return (gpu or t), t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/prefill_kernels.json")
    ap.add_argument("--hists", default="0,8192,32768")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    groups = HKV // G
    rows = []
    for hist in map(int, args.hists.split(",")):
        max_pages = (hist + T) // PS + 1
        num_pages = groups * max_pages
        ks = jax.random.split(jax.random.fold_in(key, hist), 6)
        q = jax.random.normal(ks[0], (T, HQ, D), DTYPE)
        k = jax.random.normal(ks[1], (T, HKV, D), DTYPE)
        v = jax.random.normal(ks[2], (T, HKV, D), DTYPE)
        kp = jax.random.normal(ks[3], (num_pages, G, PS, D), DTYPE)
        vp = jax.random.normal(ks[4], (num_pages, G, PS, D), DTYPE)
        tables = jnp.asarray(np.random.default_rng(hist).permutation(num_pages)
                             .reshape(groups, max_pages).astype(np.int32))
        hist_len = jnp.full((groups,), hist, jnp.int32)
        chunk_len = np.int32(T)
        attn_args = (q, k, v, kp, vp, tables, hist_len, chunk_len)
        f = jax.jit(lambda *a: chunk_prefill_attention(*a, obs_window=OBS))
        r = jax.jit(lambda *a: chunk_prefill_attention_reference(*a, obs_window=OBS))
        out, obs = f(*attn_args)
        ref, ref_obs = r(*attn_args)
        err = float(jnp.linalg.norm((out - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32)))
        t_kernel, w_kernel = _time(f, attn_args, args.reps)
        t_ref, w_ref = _time(r, attn_args, args.reps)
        kv_bytes = 2 * (hist * HKV + T * HKV) * D * 2
        rows.append(dict(kernel="chunk_prefill_attention", hist=hist, chunk=T, rel_err=err,
                         time_s=t_kernel, wall_time_s=w_kernel, reference_time_s=t_ref,
                         reference_wall_time_s=w_ref, kv_bytes=kv_bytes))
        print(f"prefill hist={hist:6d}: pallas {t_kernel * 1e6:8.1f} us, jnp reference "
              f"{t_ref * 1e6:8.1f} us, rel err {err:.2e}", flush=True)

        scores = jax.random.normal(ks[5], (HKV, T), jnp.float32)
        keep = jnp.asarray(chunk_keep_count(BUDGETS, T).astype(np.int32))
        comp_args = (k, v, scores, keep, chunk_len, kp, vp, tables, hist_len)
        got = jax.jit(compress_chunk_into_pages)(*comp_args[:5], jnp.copy(kp), jnp.copy(vp),
                                                 tables, hist_len)
        want = compress_chunk_into_pages_reference(*comp_args)
        exact = bool(all(jnp.array_equal(a, b) for a, b in zip(got, want)))
        del got, want

        def in_place(fn):
            """fn with the pool donated and fed back, as the engine runs it (no pool copy)."""
            step = jax.jit(fn, donate_argnums=(5, 6))
            state = [jnp.copy(kp), jnp.copy(vp)]

            def call():
                state[:] = step(k, v, scores, keep, chunk_len, state[0], state[1], tables,
                                hist_len)
                return state
            return call
        t_kc, w_kc = _time(in_place(compress_chunk_into_pages), (), args.reps)
        t_rc, w_rc = _time(in_place(compress_chunk_into_pages_reference), (), args.reps)
        rows.append(dict(kernel="compress_chunk_into_pages", hist=hist, chunk=T, exact=exact,
                         time_s=t_kc, wall_time_s=w_kc, reference_time_s=t_rc,
                         reference_wall_time_s=w_rc))
        print(f"compress hist={hist:6d}: pallas {t_kc * 1e6:8.1f} us, jnp reference "
              f"{t_rc * 1e6:8.1f} us, exact {exact}", flush=True)
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, git_revision=os.environ.get("GIT_REV", "unknown"),
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                  shape=dict(chunk=T, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                             group_size=G, page_size=PS, obs_window=OBS, dtype="bfloat16"),
                  cases=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
