"""A/B (GPU only): the stream-programs prototype (`decode_stream_programs.patch`, applied to
the tree first) against the item kernel, per format, in one process: each decode launch's
device time alone and the whole call's (the prototype merges its pieces in jnp), and the
relative error against the reference on 4 rows. A program count "d:NAME" runs the item kernel
with the environment variable DIAG=NAME at trace time: session 24's diagnostic switches
(`decode_diag_switches.patch`: DIAG=same_page, every block reads page 1; DIAG=scales_page1,
the per-slot scales and zeros of page 1). That patch applies to the tree, not on top of the
stream patch (one hunk conflicts): session 24 put the same two switches into the patched
kernel by hand to run both in one process. Run from the repository root:

    git apply benchmarks/prototypes/decode_stream_programs.patch
    PYTHONPATH=$PWD GIT_REV=$(git rev-parse --short HEAD) PRECS=bf16,k4v2 \
        python3 benchmarks/prototypes/stream_ab.py OUT.json 32x32768,64x32768 264,396
"""
import json, sys, os
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
import kv_precision_decode as kpd
from tangram_jax import kv_quant
from tangram_jax.benchmarking.timing import gpu_busy_time
from tangram_jax.pallas_kernels.decode_attention import (
    ragged_paged_decode_attention as rpda, ragged_paged_decode_attention_reference as ref_fn,
    decode_programs)
out_path, configs, progs = sys.argv[1], sys.argv[2].split(","), [x if x.startswith("d:") else int(x) for x in sys.argv[3].split(",")]
res = {"cap": os.environ.get("MAXNREG", "0"), "rev": os.environ.get("GIT_REV"),
       "device": str(jax.devices()[0]), "command": " ".join(sys.argv), "cells": []}
key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
for ci, cfg in enumerate(configs):
    batch, context = (int(x) for x in cfg.split("x"))
    k0 = jax.random.fold_in(key, ci)
    lengths, tables, num_pages = kpd.make_case(k0, batch, context)
    lens, tbl = jnp.asarray(lengths), jnp.asarray(tables)
    groups = lengths.shape[1]
    qs = jax.random.normal(jax.random.fold_in(k0, 1), (kpd.CALLS, batch, groups,
        kpd.GROUP_SIZE * kpd.NUM_Q_HEADS // kpd.NUM_KV_HEADS, kpd.HEAD_DIM), kpd.DTYPE)
    slots = int(lengths.sum()) * kpd.GROUP_SIZE
    for prec in os.environ.get("PRECS", "bf16,k4v2,k8v4-k4v2").split(","):
        programs = decode_programs(prec, kpd.NUM_PROGRAMS)
        if prec in kpd.PRECISION_TIERS:
            k, v, t_, l_, work, read = kpd.tiered_case(k0, prec, lens, batch, programs)
        else:
            k, v = kpd.random_pools(jax.random.fold_in(k0, 100 + ci), num_pages, kv_quant.page_format(prec))
            t_, l_ = tbl, lens
            work = kpd.work_list(prec, batch, programs)
            read = slots * kpd.slot_bytes(prec)
        variants = [0] + ([] if prec == "bf16" else progs)
        r4 = np.asarray(ref_fn(qs[0, :4], k, v, t_[:4], l_[:4]), np.float64)
        for P in variants:
            diag = P[2:] if isinstance(P, str) else ""
            if diag or os.environ.get("DIAG"):
                os.environ["DIAG"] = diag
                jax.clear_caches()
            P = 0 if diag else P
            kw = dict(stream_programs=P) if P else {}
            @jax.jit
            def block(qs, k, v):
                return [rpda(qs[i], k, v, t_, l_, work_list=work, **kw) for i in range(kpd.CALLS)]
            try:
                kern = {}
                jax.block_until_ready(block(qs, k, v))
                busy = gpu_busy_time(block, (qs, k, v), 7, kern) or 0.0
                # (the stream path builds its own stream table for the 4-row case)
                got = np.asarray(rpda(qs[0, :4], k, v, t_[:4], l_[:4], work_list=work, **kw), np.float64)
                err = float(np.linalg.norm(got - r4) / np.linalg.norm(r4))
                kern = {n: s / kpd.CALLS for n, s in kern.items()}
                dec = sum(s for n, s in kern.items() if "decode_attention" in n and "merge" not in n)
                cell = dict(batch=batch, context=context, precision=prec, stream_programs=P, diag=diag,
                            total_us=busy / kpd.CALLS * 1e6, decode_us=dec * 1e6,
                            kernels_us={n: s * 1e6 for n, s in kern.items()}, rel_err=err, bytes_read=read)
            except Exception as e:
                cell = dict(batch=batch, context=context, precision=prec, stream_programs=P, error=repr(e)[:800])
            print(json.dumps({k_: (round(v_, 2) if isinstance(v_, float) else v_) for k_, v_ in cell.items() if k_ != "kernels_us"}), flush=True)
            res["cells"].append(cell)
            json.dump(res, open(out_path, "w"), indent=1)
        del k, v
