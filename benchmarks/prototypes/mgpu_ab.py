"""A/B (GPU only): the Mosaic GPU K4V2 decode prototype against the Triton kernel and bf16 in
one process, pages of PAGE slots (default 32: the prototype needs >= 32), correctness against
the reference on 4 rows. Run from the repository root:

    PYTHONPATH=$PWD GIT_REV=$(git rev-parse --short HEAD) python3 benchmarks/prototypes/mgpu_ab.py \
        64x32768,32x32768 3,2
"""
import json, os, sys, traceback
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/prototypes")
import jax, jax.numpy as jnp, numpy as np
import kv_precision_decode as kpd
kpd.PAGE_SIZE = int(os.environ.get("PAGE", "32"))
from tangram_jax import kv_quant
from tangram_jax.benchmarking.timing import wall_quantiles
from tangram_jax.pallas_kernels import split_map as sm
from tangram_jax.pallas_kernels import decode_attention as da
import decode_attention_mgpu as dm

out = {"device": str(jax.devices()[0]), "rev": os.environ.get("GIT_REV"),
       "command": " ".join(sys.argv), "page_size": kpd.PAGE_SIZE, "runs": []}
CALLS = kpd.CALLS
configs = [(int(b), int(c)) for b, c in (s.split("x") for s in sys.argv[1].split(","))]
stages_list = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [3]

def mgpu_attend(q, k, v, t, n, work, stages):
    o, lse, w = dm.decode_partials_mgpu(q, k, v, t, n, work, stages=stages)
    return da.merge_partials_pallas(o, lse, w, num_groups=q.shape[1], out_dtype=q.dtype,
                                    interpret=False)

for batch, context in configs:
    key = jax.random.key(batch * 7 + context)
    lengths, tables, num_pages = kpd.make_case(key, batch, context)
    lens, tbl = jnp.asarray(lengths), jnp.asarray(tables)
    groups = lengths.shape[1]
    qs = jax.random.normal(jax.random.fold_in(key, 1), (CALLS, batch, groups, 8, 128), kpd.DTYPE)
    work = sm.build_split_map(kpd.BUDGETS, da.decode_programs("k4v2", kpd.NUM_PROGRAMS), batch,
                              group_size=kpd.GROUP_SIZE).work_list(0)
    work_bf = sm.build_split_map(kpd.BUDGETS, kpd.NUM_PROGRAMS, batch,
                                 group_size=kpd.GROUP_SIZE).work_list(0)
    kk, vk = jax.random.split(jax.random.fold_in(key, 5))
    k4 = kpd.random_pool(kk, num_pages, 4)
    v2 = kpd.random_pool(vk, num_pages, 2)
    res = {"batch": batch, "context": context, "items": int(work.shape[0]), "us": {}}
    # correctness on 4 rows
    try:
        r = 4
        got = mgpu_attend(qs[0, :r], k4, v2, tbl[:r], lens[:r], jnp.asarray(work), 3)
        ref = da.ragged_paged_decode_attention_reference(qs[0, :r], k4, v2, tbl[:r], lens[:r])
        tri = da.ragged_paged_decode_attention(qs[0, :r], k4, v2, tbl[:r], lens[:r], work_list=work)
        g, rf, t = (np.asarray(x, np.float64) for x in (got, ref, tri))
        res["mgpu_rel_err"] = float(np.linalg.norm(g - rf) / np.linalg.norm(rf))
        res["triton_rel_err"] = float(np.linalg.norm(t - rf) / np.linalg.norm(rf))
        res["mgpu_finite"] = bool(np.isfinite(g).all())
        print(batch, context, "errors mgpu", res["mgpu_rel_err"], "triton", res["triton_rel_err"], flush=True)
    except Exception as e:
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"[:3000]
    def timed(name, fn, *args):
        try:
            t = wall_quantiles(jax.jit(fn), args, 7)[0] / CALLS
            res["us"][name] = t * 1e6
            print(batch, context, name, f"{t*1e6:.1f} us", flush=True)
        except Exception as e:
            traceback.print_exc()
            res["us"][name] = f"{type(e).__name__}: {e}"[:1500]
    wj = jnp.asarray(work)
    for rnd in range(2):
        timed(f"triton_k4v2_{rnd}", lambda qs, k, v: [da.ragged_paged_decode_attention(
            qs[i], k, v, tbl, lens, work_list=work) for i in range(CALLS)], qs, k4, v2)
        for st in stages_list:
            timed(f"mgpu_k4v2_s{st}_{rnd}", lambda qs, k, v, st=st: [mgpu_attend(
                qs[i], k, v, tbl, lens, wj, st) for i in range(CALLS)], qs, k4, v2)
        timed(f"mgpu_partials_s{stages_list[0]}_{rnd}", lambda qs, k, v: [dm.decode_partials_mgpu(
            qs[i], k, v, tbl, lens, wj, stages=stages_list[0])[:2] for i in range(CALLS)], qs, k4, v2)
    del k4, v2
    kb = kpd.random_pool(kk, num_pages, None); vb = kpd.random_pool(vk, num_pages, None)
    timed("bf16", lambda qs, k, v: [da.ragged_paged_decode_attention(
        qs[i], k, v, tbl, lens, work_list=work_bf) for i in range(CALLS)], qs, kb, vb)
    del kb, vb
    res["ideal_us_k4v2"] = res["us"].get("bf16", float("nan")) * kpd.slot_bytes("k4v2") / kpd.slot_bytes("bf16") if isinstance(res["us"].get("bf16"), float) else None
    out["runs"].append(res)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "mgpu_ab.json"), "w"), indent=1)
print(json.dumps(out, indent=1))
