"""Long-context prefill of a Llama-3.1-8B-shaped model against the measured bf16 matmul roofline.

Two parts, one JSON (`--out`: default a fresh file under benchmarks/results/runs/; the
committed prefill_8b.json only with --overwrite):

``--part kernel`` (one layer's attention shape: 32 query / 8 KV heads, head_dim 128, bf16, page 16)
1. the roofline: a large bf16 matrix product (8192^3) on random data, TFLOP/s from GPU busy time;
2. correctness at real shapes on fresh random data: `ragged_prefill_attention` against its float32
   jnp reference on a ragged batch (rows of different lengths, an empty row, NaN in every pool slot
   no group owns and in every padding token), for the full-KV pool (G 8) and a grouped one (G 2);
3. a tuning sweep (block_q, block_k, warps, stages) on one 8192-token row over 32k of history;
   the best tile then at histories 0, 32k and 90k, beside cuDNN's fused attention
   (`jax.nn.dot_product_attention(implementation="cudnn")`) on the same keys made contiguous;
4. balance across groups of different budgets: a 2048-token row over a grouped history with
   skewed group lengths, items heaviest first (`prefill_work_items`) vs in row order.

``--part runner`` (the whole model, `ModelRunner.prefill` on random bf16 weights built on the
device): a first turn of 8k / 32k / 100k tokens in `full`, `dynamic` and `tangram` at 0.25 (a
skewed profile), tokens/s and the fraction of the roofline, with the kernel breakdown from a
profiler trace.

FLOPs are counted honestly: GEMMs 2 * (non-embedding parameters) * tokens (the LM head once per
call's last token), attention 4 * heads * head_dim * (keys each query sees), i.e. causal = half
the square, history keys counted as retained (a compressed mode does less work, and the fraction
is of the work it does).

    GIT_REV=$(git rev-parse HEAD) python benchmarks/prefill_8b.py --part kernel --out x.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tangram_jax.benchmarking.timing import gpu_busy_time  # noqa: E402
from tangram_jax.pallas_kernels.prefill_attention import (  # noqa: E402
    PREFILL_TUNING, PrefillTuning, item_capacity, pack_rows, prefill_work_items,
    ragged_prefill_attention,
    ragged_prefill_attention_reference, row_alignment)
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.provenance import device_description, git_revision  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def busy(fn, args=(), reps=5, per_kernel=None):
    """GPU busy seconds per call (profiler), or the median wall time where no trace exists."""
    jax.block_until_ready(fn(*args))
    t = gpu_busy_time(fn, args, reps, per_kernel=per_kernel)
    if t:
        return t
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def matmul_roofline(n=8192, reps=10):
    """TFLOP/s of an n^3 bf16 matrix product on random data (f32 accumulation, bf16 out)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    t = busy(f, (a, b), reps)
    return 2 * n**3 / t / 1e12


def attention_flops(q_lens, hist_lens_per_head):
    """4 * d * sum over query heads and queries of the keys each one sees (history + causal)."""
    total = 0.0
    for n, hist in zip(q_lens, hist_lens_per_head):      # hist: [Hq] retained history per head
        total += 4 * D * (n * float(np.sum(hist)) + len(hist) * n * (n + 1) / 2)
    return total


def make_case(rng, row_lens, hists, group_size, nan_unowned=True, dtype=jnp.bfloat16,
              tuning=PREFILL_TUNING, spare_tokens=0):
    """Random ragged case: hists int [rows, groups]; pages scattered over the pool."""
    rows, groups = hists.shape
    starts, used = pack_rows(row_lens, row_alignment(tuning))
    n = used + spare_tokens
    max_pages = max(1, int(math.ceil(hists.max() / PAGE)))
    num_pages = rows * groups * max_pages + 1
    tables = rng.permutation(np.arange(1, num_pages))[:rows * groups * max_pages]
    tables = tables.reshape(rows, groups, max_pages).astype(np.int32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    ks = jax.random.split(key, 5)
    k_pages = jax.random.normal(ks[0], (num_pages, group_size, PAGE, D), dtype)
    v_pages = jax.random.normal(ks[1], (num_pages, group_size, PAGE, D), dtype)
    if nan_unowned:
        owned = np.zeros((num_pages, PAGE), bool)
        for r in range(rows):
            for g in range(groups):
                t = np.arange(hists[r, g])
                owned[tables[r, g, t // PAGE], t % PAGE] = True
        mask = jnp.asarray(owned)[:, None, :, None]
        k_pages = jnp.where(mask, k_pages, jnp.nan)
        v_pages = jnp.where(mask, v_pages, jnp.nan)
    q = jax.random.normal(ks[2], (n, HQ, D), dtype)
    k = jax.random.normal(ks[3], (n, HKV, D), dtype)
    v = jax.random.normal(ks[4], (n, HKV, D), dtype)
    inside = np.zeros(n, bool)
    for s, ln in zip(starts, row_lens):
        inside[s:s + ln] = True
    pad = jnp.asarray(~inside)[:, None, None]
    q, k, v = (jnp.where(pad, jnp.nan, x) for x in (q, k, v))
    ints = [jnp.asarray(np.asarray(x, np.int32)) for x in (tables, hists, starts, row_lens)]
    return [q, k, v, k_pages, v_pages, *ints], starts, inside


def check_correctness(rng) -> list[dict]:
    out = []
    for group_size, row_lens in ((HKV, [700, 0, 256, 1300]), (2, [700, 0, 256, 1300]),
                                 (HKV, [200, 0, 40]), (2, [200, 0, 40])):
        groups = HKV // group_size
        rows = len(row_lens)
        hists = rng.integers(0, 3000, size=(rows, groups))
        hists[0, 0] = 3000
        args, starts, inside = make_case(rng, row_lens, hists, group_size, spare_tokens=128)
        # The short rows leave room below target_programs: their histories split.
        n = args[0].shape[0]
        items = prefill_work_items(starts, row_lens, hists, num_tokens=n,
                                   num_items=item_capacity(n, groups, group_size))
        got, lse = ragged_prefill_attention(*args, jnp.asarray(items))
        ref, ref_lse = ragged_prefill_attention_reference(*args)
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        err = float(np.linalg.norm(got[inside] - ref[inside]) / np.linalg.norm(ref[inside]))
        row = dict(group_size=group_size, row_lens=row_lens, rel_err=err,
                   max_splits_used=int(items[:, 4].max()),
                   lse_max_abs_err=float(np.abs(lse[:, inside] - ref_lse[:, inside]).max()),
                   finite=bool(np.isfinite(got).all()), padding_zero=not got[~inside].any())
        row["ok"] = bool(err < 1e-2 and row["finite"] and row["padding_zero"]
                         and row["lse_max_abs_err"] < 0.05)
        out.append(row)
        print("correctness", row, flush=True)
    return out


def time_kernel(rng, row_lens, hists, group_size, tuning, order="heaviest", reps=5):
    """order: "heaviest" (items split and sorted as the runner does), "unsplit" (one item per
    query block and group, heaviest first), "row" (unsplit, in row/block/group order)."""
    args, starts, _ = make_case(rng, row_lens, hists, group_size, nan_unowned=False,
                                tuning=tuning)
    capacity = item_capacity(args[0].shape[0], hists.shape[1], group_size, tuning)
    items = prefill_work_items(starts, row_lens, hists, tuning=tuning, num_tokens=args[0].shape[0],
                               num_items=capacity if order == "heaviest" else None)
    if order == "row":
        items = items[np.lexsort((items[:, 2], items[:, 1], items[:, 0]))]
    items = jnp.asarray(items)
    f = jax.jit(lambda *a: ragged_prefill_attention(*a, tuning=tuning))
    per = {}
    t = busy(f, (*args, items), reps, per_kernel=per)
    kernel_s = sum(v for k, v in per.items() if "prefill" in k) or t
    heads_hist = [np.repeat(h, group_size * (HQ // HKV)) for h in hists]
    flops = attention_flops(row_lens, heads_hist)
    return dict(row_lens=list(map(int, row_lens)), hist_per_group=hists.tolist(),
                group_size=group_size, tuning=tuning.__dict__, order=order, total_ms=t * 1e3,
                kernel_ms=kernel_s * 1e3, tflops_kernel=flops / kernel_s / 1e12,
                tflops_total=flops / t / 1e12, flops=flops)


def cudnn_reference(rng, t_len, hist, reps=5):
    """cuDNN fused attention: t_len queries at the end of hist + t_len contiguous keys."""
    s = hist + t_len
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(ks[0], (1, t_len, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, s, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, s, HKV, D), jnp.bfloat16)
    mask = (jnp.arange(s)[None, :] <= hist + jnp.arange(t_len)[:, None])[None, None]
    f = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                               implementation="cudnn"))
    try:
        t = busy(f, (q, k, v, mask), reps)
    except Exception as e:   # noqa: BLE001 - a yardstick, not the product
        return dict(t_len=t_len, hist=hist, error=repr(e)[:300])
    flops = attention_flops([t_len], [np.full(HQ, hist)])
    return dict(t_len=t_len, hist=hist, ms=t * 1e3, tflops=flops / t / 1e12)


def kernel_part(args) -> dict:
    rng = np.random.default_rng(args.seed)
    report = {"roofline_tflops": matmul_roofline()}
    print(f"bf16 matmul roofline {report['roofline_tflops']:.0f} TFLOP/s", flush=True)
    report["correctness"] = check_correctness(rng)
    sweep = []
    hist32 = np.array([[32768]])
    # Run 1 swept (32|16|64, 64|128, 8|4 warps, 2|3 stages): (32, 64, 4, 2) won at 366 TFLOP/s;
    # this sweep looks around it.
    for bq, bk, w, s in [(32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 4, 2), (32, 128, 4, 3),
                         (16, 64, 2, 2), (32, 64, 8, 2)]:
        tuning = PrefillTuning(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
        try:
            r = time_kernel(rng, [8192], hist32, HKV, tuning)
        except Exception as e:   # noqa: BLE001 - a tile Triton cannot build is data too
            r = dict(tuning=tuning.__dict__, error=repr(e)[:300])
        sweep.append(r)
        print("sweep", r, flush=True)
    report["tuning_sweep"] = sweep
    best = max((r for r in sweep if "error" not in r), key=lambda r: r["tflops_kernel"])
    best_tuning = PrefillTuning(**best["tuning"])
    report["best_tuning"] = best["tuning"]
    full = []
    for hist in (0, 32768, 90112):
        r = time_kernel(rng, [8192], np.array([[hist]]), HKV, best_tuning)
        r["cudnn"] = cudnn_reference(rng, 8192, hist)
        full.append(r)
        print("full", r, flush=True)
    report["full_kv"] = full
    # Balance: G 2 (4 groups), budgets like a skewed 0.25 profile's heaviest-vs-lightest layer.
    balance = []
    for t_len in (2048, 256):
        hists = (np.array([[0.70, 0.20, 0.08, 0.02]]) * 32768).astype(np.int64)
        for order in ("heaviest", "unsplit", "row"):
            r = time_kernel(rng, [t_len], hists, 2, best_tuning, order=order)
            balance.append(r)
            print("balance", r, flush=True)
        even = np.full_like(hists, int(hists.mean()))
        r = time_kernel(rng, [t_len], even, 2, best_tuning)
        r["order"] = "equal-lengths (same total)"
        balance.append(r)
        print("balance", r, flush=True)
    report["balance"] = balance
    return report


# ----- the whole model through the runner -----------------------------------------------------
def _layout(mode: str, chunk: int, seed: int, layers: int, obs_window: int = 32):
    """full/dynamic: monolithic; tangram: control_plane.py's skewed profile (mean 0.25, G 2);
    with the engine's default protected tail (`EngineConfig.tail_rule`, the obs window)."""
    import dataclasses as dc
    from control_plane import layouts
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.kv_layout import KVLayout
    tail = EngineConfig.tail_rule, min(obs_window, chunk)
    if mode == "tangram":
        tangram, _, head_budgets = layouts(np.random.default_rng(seed), layers)
        return dc.replace(tangram, chunk_size=chunk).with_tail(*tail), float(head_budgets.mean())
    return KVLayout.monolithic(layers, HKV, D, page_size=PAGE, chunk_size=chunk,
                               name=mode).with_tail(*tail), 1.0


def _categories(per_kernel: dict) -> dict:
    """GPU seconds per call by kind of op (names as XLA/Pallas report them)."""
    import re
    kinds = {"prefill_attention": r"prefill", "compress": r"compress",
             "gemm": r"gemm|cublas|cutlass|matmul|dot|nvjet|sm90_xmma",
             "scatter_gather_sort": r"scatter|gather|sort|argsort|dynamic"}
    out = {k: 0.0 for k in (*kinds, "other")}
    for name, sec in per_kernel.items():
        kind = next((k for k, pat in kinds.items() if re.search(pat, name, re.I)), "other")
        out[kind] += sec
    return out


def prefill_turn(runner, scheduler, manager, tokens, request_id, max_prefill_rows, record=None):
    """Prefill one first turn through the scheduler and the runner's step plan (the engine's own
    prefill path: `step_plan.prefill_rows`, `ModelRunner.execute`); returns the turn's last
    logits (device)."""
    from tangram_jax.engine.prefill_calls import run_prefill_rows
    from tangram_jax.engine.step_plan import prefill_rows
    from tangram_jax.sampling import SamplingParams
    scheduler.add_request(request_id, [int(t) for t in tokens],
                          SamplingParams(temperature=0, max_tokens=1), arrival_time=0.0)
    last = None
    while last is None:
        out = scheduler.schedule()
        runner.update_block_tables(*manager.take_table_updates())
        rows = prefill_rows(out.prefill_chunks, manager)
        last_logits, retained, _, _ = run_prefill_rows(runner, rows, max_prefill_rows)
        if record is not None:
            record.append(len(rows))
        reclaim = retained if runner.runner_config.mode == "dynamic" else None
        scheduler.commit(out, {rows[i].request_id: 0 for i in last_logits}, reclaim)
        if last_logits:
            last = next(iter(last_logits.values()))
    jax.block_until_ready(last)
    scheduler.abort(request_id)
    return last


def runner_part(args, roofline_tflops: float, save=lambda rows: None) -> list[dict]:
    import gc
    from flax import nnx
    from decode_step_gpu import LLAMA_8B, TINY, model_config
    from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
    from tangram_jax.kv_layout import pages_for
    from tangram_jax.models.decoder import Decoder
    from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
    from tangram_jax.scheduler.scheduler import Scheduler

    config = model_config(TINY if args.tiny else LLAMA_8B)
    c = config
    layers, hidden = c.num_layers, c.hidden_size
    nonembed = layers * (hidden * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
                         + 3 * hidden * c.intermediate_size)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    rng = np.random.default_rng(args.seed)
    results = []
    for variant in args.modes.split(","):
        mode, _, chunk = variant.partition("@")
        chunk = int(chunk or args.chunk_size)
        layout, head_budget_mean = _layout(mode, chunk, args.seed, layers)
        longest = max(args.turns)
        per_seq = int(pages_for(layout.retained_counts(longest) + chunk, PAGE).sum())
        num_pages = int(per_seq * 1.1) + 64
        max_pages = int(pages_for(longest + chunk, PAGE))
        t0 = time.perf_counter()
        model = Decoder(config, dtype, rngs=nnx.Rngs(args.seed))
        manager = KVCacheManager(layout, num_pages, 2, max_pages,
                                 model_kv_shape=(layers, HKV, D),
                                 policy="reclaim" if mode == "dynamic" else "reserve")
        budget = args.max_num_batched_tokens
        runner = ModelRunner(model, config, layout, num_pages, manager.block_tables.shape,
                             runner_config=RunnerConfig(mode=mode, obs_window=32,
                                                        dynamic_ratio=args.ratio,
                                                        max_prefill_tokens=budget))
        del model
        scheduler = Scheduler(manager, max_num_batched_tokens=budget)
        build_s = time.perf_counter() - t0
        for turn in args.turns:
            tokens = rng.integers(0, config.vocab_size, turn)
            # Warm-up turn: the same piece shapes (a full budget piece and the tail), compiled
            # outside the timed region.
            warm = budget + turn % budget if runner.prefill_whole_rows else 2 * chunk + turn % chunk
            t0 = time.perf_counter()
            prefill_turn(runner, scheduler, manager, tokens[:warm], f"warm{turn}", 1)
            warm_s = time.perf_counter() - t0
            calls = []
            orig = runner.prefill

            def recording(tok, starts, slots, hists, *args, _orig=orig, _calls=calls, **kwargs):
                _calls.append(([len(t) for t in tok], [np.asarray(h) for h in hists]))
                return _orig(tok, starts, slots, hists, *args, **kwargs)
            runner.prefill = recording
            t0 = time.perf_counter()
            prefill_turn(runner, scheduler, manager, tokens, f"t{turn}", 1)
            seconds = time.perf_counter() - t0
            runner.prefill = orig
            # FLOPs of what this mode computed: GEMMs + LM head per call + attention over the
            # retained history of each (layer, group) and the causal row.
            gemm = 2.0 * nonembed * turn + 2.0 * hidden * config.vocab_size * len(calls)
            attn = 0.0
            q_heads_per_group = layout.group_size * (c.num_heads // c.num_kv_heads)
            for lens, hists in calls:
                for n, h in zip(lens, hists):
                    attn += 4 * D * q_heads_per_group * float(
                        (n * h.astype(np.float64) + n * (n + 1) / 2).sum())
            flops = gemm + attn
            row = dict(mode=mode, chunk_size=chunk, turn_tokens=turn, seconds=seconds,
                       tokens_per_s=turn / seconds, runner_calls=len(calls),
                       gemm_flops=gemm, attention_flops=attn,
                       fraction_of_roofline=flops / seconds / (roofline_tflops * 1e12),
                       roofline_seconds=flops / (roofline_tflops * 1e12),
                       warm_turn_seconds=warm_s, model_build_s=build_s,
                       head_budget_mean=head_budget_mean,
                       group_budget_mean=float(layout.group_budgets.mean()),
                       max_num_batched_tokens=budget)
            if turn in args.trace_turns:
                per = {}
                traced = gpu_busy_time(lambda: prefill_turn(runner, scheduler, manager, tokens,
                                                            f"trace{turn}", 1), (), 1,
                                       per_kernel=per)
                row["gpu_busy_s"] = traced
                row["gpu_s_by_kind"] = _categories(per)
                row["top_gpu_ops_s"] = {k: round(v, 5) for k, v in
                                        sorted(per.items(), key=lambda kv: -kv[1])[:12]}
            results.append(row)
            save(results)   # a run cut off by its time limit keeps what it measured
            print("runner", {k: v for k, v in row.items() if k != "top_gpu_ops_s"}, flush=True)
        del runner, scheduler, manager
        gc.collect()
    full = {r["turn_tokens"]: r for r in results if r["mode"] == "full"}
    for r in results:
        f = full.get(r["turn_tokens"])
        if f is None or r is f:
            continue
        r["speedup_vs_full"] = f["seconds"] / r["seconds"]
        att_full = (f.get("gpu_s_by_kind") or {}).get("prefill_attention")
        if att_full:   # half the attention time full KV would save at this mode's FLOPs
            saving = att_full * (1 - r["attention_flops"] / f["attention_flops"])
            r["attention_saving_s_at_full_rate"] = saving
            r["meets_half_attention_saving"] = bool(f["seconds"] - r["seconds"] >= 0.5 * saving)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("kernel", "runner", "all"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="full,dynamic,tangram",
                        help="runner part: modes, each optionally @chunk_size")
    parser.add_argument("--turns", type=int, nargs="+", default=[8192, 32768, 100000])
    parser.add_argument("--trace-turns", type=int, nargs="*", default=[32768, 100000])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--tiny", action="store_true",
                        help="runner part on a 2-layer model (CPU smoke test of the path)")
    parser.add_argument("--roofline-tflops", type=float, default=None,
                        help="skip measuring the matmul rate (runner part alone)")
    parser.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    outputs = resolve_outputs(parser, args, {"out": "prefill_8b"})
    run = start("prefill_8b", outputs, argv)
    result = {"benchmark": "prefill_8b", "device": device_description(),
              "git_revision": git_revision() or "unknown",
              "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "jax_version": jax.__version__}
    if args.part in ("kernel", "all"):
        result["kernel"] = kernel_part(args)
        roofline = result["kernel"]["roofline_tflops"]
    else:
        roofline = args.roofline_tflops or matmul_roofline()
        result["roofline_tflops"] = roofline
    def save(rows):
        result["runner"] = rows
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    if args.part in ("runner", "all"):
        result["runner"] = runner_part(args, roofline, save)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", flush=True)
    finish(run)
    k = result.get("kernel")
    if k:
        print(f"roofline {k['roofline_tflops']:.0f} TFLOP/s; correctness "
              f"{[c['ok'] for c in k['correctness']]}")
        print(f"{'what':34} {'ms':>8} {'TFLOP/s':>8}")
        for r in k["tuning_sweep"]:
            if "error" not in r:
                print(f"{'sweep ' + str(tuple(r['tuning'].values())):34} {r['kernel_ms']:8.2f} "
                      f"{r['tflops_kernel']:8.1f}")
        for r in k["full_kv"]:
            c = r["cudnn"]
            print(f"{'full T8192 hist ' + str(r['hist_per_group'][0][0]):34} {r['kernel_ms']:8.2f} "
                  f"{r['tflops_kernel']:8.1f}  cudnn {c.get('ms', float('nan')):.2f} ms "
                  f"{c.get('tflops', float('nan')):.1f}")
        for r in k["balance"]:
            print(f"{'bal T' + str(r['row_lens'][0]) + ' ' + r['order'][:20]:34} "
                  f"{r['kernel_ms']:8.2f} {r['tflops_kernel']:8.1f}")


    if result.get("runner"):
        print(f"roofline {roofline:.0f} TFLOP/s")
        print(f"{'mode':8} {'chunk':>5} {'turn':>7} {'s':>7} {'tok/s':>8} {'roof%':>6} "
              f"{'attn s':>7} {'gemm s':>7} {'vs full':>7}")
        for r in result["runner"]:
            kinds = r.get("gpu_s_by_kind") or {}
            print(f"{r['mode']:8} {r['chunk_size']:5d} {r['turn_tokens']:7d} {r['seconds']:7.2f} "
                  f"{r['tokens_per_s']:8.0f} {100 * r['fraction_of_roofline']:6.1f} "
                  f"{kinds.get('prefill_attention', float('nan')):7.2f} "
                  f"{kinds.get('gemm', float('nan')):7.2f} {r.get('speedup_vs_full', 1):7.2f}")


if __name__ == "__main__":
    main()
