"""Host time of the control plane per engine step: Tangram (Budget Reservation) against the
dynamic compress-and-reclaim baseline, in one run, on the CPU.

Shape: Llama-3.1-8B's KV cache (32 layers, 8 KV heads, head_dim 128), G = 2, page_size 16,
a skewed per-head budget profile averaging rho = 0.25 (clustered by budget), prompts of a few
thousand tokens. A steady stream: `batch` sequences decode; whenever one finishes a queued
request is admitted and prefilled in chunks, so steps mix decode growth, admission and prefill
the way serving does. The device is simulated by committing exactly what each step scheduled.

Per step we time the scheduler's own work (`schedule` + `commit` + `finish`, recorded in
`SchedulerMetrics.step_host_seconds`): admission and reservation, decode growth (and in the
baseline the reclaim after compression), chunk planning, and the device feed (decode slots padded
to a bucket, their lengths, and the block-table writes since the last step). The full block
table of the decode batch is NOT copied every step: the engine keeps a device-resident table and
applies the update log; what that full copy would cost is reported separately for reference.

    python benchmarks/control_plane.py [--steps 400] [--out benchmarks/results/control_plane.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run from a checkout without installing the package

from tangram_jax.compression.clustering import budget_aware_groups
from tangram_jax.kv_layout import KVLayout, pages_for
from tangram_jax.provenance import device_description, git_revision
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

LAYERS, KV_HEADS, HEAD_DIM, GROUP, PAGE, CHUNK, RHO = 32, 8, 128, 2, 16, 256, 0.25
PROMPT_RANGE, OUTPUT_RANGE = (2048, 4096), (64, 512)


def skewed_head_budgets(rng: np.random.Generator, num_layers: int = LAYERS) -> np.ndarray:
    """[layers, kv_heads] budgets, long-tailed (a few heads keep most, most keep little),
    rescaled so the mean is RHO; clipped to (0.02, 1]."""
    raw = rng.lognormal(mean=0.0, sigma=1.0, size=(num_layers, KV_HEADS))
    b = raw / raw.mean() * RHO
    for _ in range(20):   # clipping at 1 lowers the mean; re-scale the unclipped part
        b = np.clip(b, 0.02, 1.0)
        b *= RHO / b.mean()
    return np.clip(b, 0.02, 1.0)


def layouts(rng: np.random.Generator, num_layers: int = LAYERS
            ) -> tuple[KVLayout, KVLayout, np.ndarray]:
    """(Tangram layout, monolithic layout of the dynamic baseline, head budgets [layers, heads])."""
    head_budgets = skewed_head_budgets(rng, num_layers)
    perm, group_budgets = budget_aware_groups(head_budgets, GROUP)
    tangram = KVLayout(num_layers=num_layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       group_size=GROUP, page_size=PAGE, chunk_size=CHUNK, head_perm=perm,
                       group_budgets=group_budgets, name="tangram")
    dynamic = KVLayout.monolithic(num_layers, KV_HEADS, HEAD_DIM, page_size=PAGE, chunk_size=CHUNK,
                                  name="dynamic")
    return tangram, dynamic, head_budgets


def run_case(layout: KVLayout, policy: str, batch: int, steps: int, warmup: int,
             head_budgets: np.ndarray, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    max_tokens = PROMPT_RANGE[1] + OUTPUT_RANGE[1] + 1
    max_pages = int(pages_for(max_tokens, PAGE))
    # Enough pages for every slot at the longest context: the comparison is of host work, not of
    # memory pressure (so neither side preempts).
    per_seq = int(pages_for(layout.retained_counts(max_tokens) + 1, PAGE).sum())
    manager = KVCacheManager(layout, batch * per_seq + 1, batch, max_pages,
                             model_kv_shape=(LAYERS, KV_HEADS, HEAD_DIM), policy=policy)
    sched = Scheduler(manager, max_num_batched_tokens=2048 + batch, fairness_skips=8)
    counter = 0
    target: dict[str, int] = {}

    def arrive():
        nonlocal counter
        counter += 1
        rid = f"r{counter}"
        n = int(rng.integers(*PROMPT_RANGE))
        sched.add_request(rid, rng.integers(0, 32000, n).tolist())
        target[rid] = int(rng.integers(*OUTPUT_RANGE))

    for _ in range(batch + 8):
        arrive()
    # Fill the batch, then age it so finishes are spread over steps.
    full_gather_s = []
    decode_sizes = []
    admitting = []   # steps that also admitted, prefilled or finished something
    cpu_times = []   # the same work in thread CPU time (insensitive to other processes)
    for step in range(warmup + steps):
        if step == warmup:
            sched.metrics.step_host_seconds.clear()
            manager.reclaim_seconds, manager.pages_reclaimed = 0.0, 0
        c0 = time.thread_time()
        out = sched.schedule()
        cpu = time.thread_time() - c0
        sampled = {c.seq.request_id: 1 for c in out.prefill_chunks if c.is_last}
        sampled.update({q.request_id: 2 for q in out.decode_seqs})   # the device's output
        reclaim = None
        if policy == "reclaim":
            # The dynamic method's per-input selection: each head keeps about its budget, the
            # monolithic page table must hold the layer's largest head.
            reclaim = {}
            for c in out.prefill_chunks:
                if c.is_last:
                    written = manager.lengths[c.seq.slot, :, 0] + c.num_tokens
                    noisy = np.clip(head_budgets * rng.uniform(0.8, 1.2, head_budgets.shape),
                                    0, 1).max(axis=1)
                    reclaim[c.seq.request_id] = np.ceil(noisy * written).astype(np.int64)[:, None]
        c0 = time.thread_time()
        sched.commit(out, sampled, reclaim_lengths=reclaim)
        cpu += time.thread_time() - c0
        finished = [q for q in out.decode_seqs if q.status is SequenceStatus.DECODE
                    and q.num_output_tokens >= target[q.request_id]]
        c0 = time.thread_time()
        for q in finished:
            sched.finish(q.request_id)   # adds its own time to the step's host time
        cpu += time.thread_time() - c0
        for _ in finished:
            arrive()
        if step >= warmup:
            decode_sizes.append(len(out.decode_seqs))
            cpu_times.append(cpu)
            admitting.append(bool(out.prefill_chunks) or bool(finished))
            if step % 10 == 0:
                g0 = time.perf_counter()
                _ = manager.block_tables[out.decode_slots]
                full_gather_s.append(time.perf_counter() - g0)
    times = np.asarray(sched.metrics.step_host_seconds)
    admitting = np.asarray(admitting)
    usage = manager.usage()
    return {
        "_times": times,
        "_cpu_times": np.asarray(cpu_times),
        "layout": layout.name,
        "policy": policy,
        "groups_per_layer": layout.num_groups,
        "steps_measured": int(times.size),
        "decode_batch_median": float(np.median(decode_sizes)),
        "host_ms_per_step_median": float(np.median(times) * 1e3),
        "host_ms_per_step_mean": float(times.mean() * 1e3),
        "host_ms_per_step_p90": float(np.percentile(times, 90) * 1e3),
        "host_cpu_ms_per_step_median": float(np.median(cpu_times) * 1e3),
        "host_ms_decode_only_steps_median": float(np.median(times[~admitting]) * 1e3)
        if (~admitting).any() else None,
        "host_ms_admitting_steps_median": float(np.median(times[admitting]) * 1e3)
        if admitting.any() else None,
        "fraction_of_steps_admitting": float(admitting.mean()),
        "reclaim_ms_total": manager.reclaim_seconds * 1e3,
        "pages_reclaimed": manager.pages_reclaimed,
        "admitted": sched.metrics.num_admitted,
        "preemptions": sched.metrics.num_preemptions,
        "pool_utilisation_end": usage["pool_utilisation"],
        "fragmentation_end": usage["fragmentation"],
        "full_block_table_gather_ms_median": float(np.median(full_gather_s) * 1e3),
    }


def attention_step_gpu_ms(batch: int, context: float) -> tuple[float | None, str]:
    """Decode-step attention GPU time (32 layers) from the kernel benchmark, if it exists.

    Takes the AOT kernel's per-layer time at this batch and the nearest measured context,
    scaled linearly to `context` (the kernel is memory-bound: time ~ KV bytes ~ context), times
    the number of layers. This leaves out the weight GEMMs, so the real decode step is longer
    and the fraction computed from it is an upper bound.
    """
    path = os.path.join(ROOT, "benchmarks", "results", "decode_attention.json")
    if not os.path.exists(path):
        return None, ("benchmarks/results/decode_attention.json does not exist yet: check the "
                      "absolute figure against its decode-step time when it does")
    with open(path) as f:
        kernel = json.load(f)
    rows = [r for r in kernel.get("cases", [])
            if r.get("variant") == "aot" and r.get("batch") == batch and "time_s" in r]
    if not rows:
        return None, f"decode_attention.json has no AOT case at batch {batch}"
    row = min(rows, key=lambda r: abs(np.log(r["context"] / context)))
    ms = row["time_s"] * (context / row["context"]) * LAYERS * 1e3
    return ms, (f"attention only: {LAYERS} x AOT kernel at batch {batch}, context "
                f"{row['context']} scaled to {context:.0f} on {kernel.get('device')}; "
                "weight GEMMs not included, so the fraction is an upper bound")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "control_plane.json"))
    args = parser.parse_args(argv)
    tangram, dynamic, head_budgets = layouts(np.random.default_rng(args.seed))
    load_before = os.getloadavg()
    cases = []
    for batch in args.batches:
        # Interleave the two policies over repeats so background load hits both alike.
        runs = {"tangram": [], "dynamic_reclaim": []}
        for rep in range(args.repeats):
            runs["tangram"].append(run_case(tangram, "reserve", batch, args.steps, args.warmup,
                                            head_budgets, args.seed + rep))
            runs["dynamic_reclaim"].append(run_case(dynamic, "reclaim", batch, args.steps,
                                                    args.warmup, head_budgets, args.seed + rep))
        summary = {}
        for name, reps in runs.items():
            pooled = np.concatenate([r.pop("_times") for r in reps])
            pooled_cpu = np.concatenate([r.pop("_cpu_times") for r in reps])
            per_rep = [r["host_ms_per_step_median"] for r in reps]
            summary[name] = dict(reps[0], host_ms_per_step_median=float(np.median(pooled) * 1e3),
                                 host_ms_per_step_p90=float(np.percentile(pooled, 90) * 1e3),
                                 host_ms_per_step_mean=float(pooled.mean() * 1e3),
                                 host_cpu_ms_per_step_median=float(np.median(pooled_cpu) * 1e3),
                                 host_cpu_ms_per_step_p90=float(np.percentile(pooled_cpu, 90)
                                                                * 1e3),
                                 host_cpu_ms_per_step_mean=float(pooled_cpu.mean() * 1e3),
                                 per_repeat_median_ms=per_rep,
                                 best_repeat_median_ms=min(per_rep))
        t, d = summary["tangram"], summary["dynamic_reclaim"]
        context = float(np.mean(PROMPT_RANGE) + np.mean(OUTPUT_RANGE) / 2)
        gpu_ms, gpu_note = attention_step_gpu_ms(batch, context)
        cases.append({
            "batch": batch,
            "tangram": t,
            "dynamic_reclaim": d,
            "tangram_over_reclaim_median_ratio": t["host_ms_per_step_median"]
            / d["host_ms_per_step_median"],
            "tangram_over_reclaim_cpu_median_ratio": t["host_cpu_ms_per_step_median"]
            / d["host_cpu_ms_per_step_median"],
            "decode_step_gpu_ms": gpu_ms,
            "tangram_fraction_of_decode_step": (t["host_ms_per_step_median"] / gpu_ms
                                                if gpu_ms else None),
            "tangram_cpu_fraction_of_decode_step": (t["host_cpu_ms_per_step_median"] / gpu_ms
                                                    if gpu_ms else None),
            "goal": "Tangram host control plane < 2% of a decode step's GPU time",
            "goal_note": gpu_note,
        })
        print(f"batch {batch}: tangram {t['host_ms_per_step_median']:.3f} ms/step "
              f"(thread CPU {t['host_cpu_ms_per_step_median']:.3f}) "
              f"(decode-only {t['host_ms_decode_only_steps_median']}, best repeat "
              f"{t['best_repeat_median_ms']:.3f}), dynamic reclaim "
              f"{d['host_ms_per_step_median']:.3f} ms/step (thread CPU "
              f"{d['host_cpu_ms_per_step_median']:.3f}, best repeat "
              f"{d['best_repeat_median_ms']:.3f}), full table gather "
              f"{t['full_block_table_gather_ms_median']:.3f} ms", flush=True)
    result = {
        "device": device_description(),
        "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "timing_caveat": ("shared CPU: other processes ran during the measurement (see load "
                          "average), which inflates wall-clock figures; host_cpu_ms_* is the "
                          "same work in thread CPU time, closer to what a dedicated host core "
                          "would take. Medians over all steps of all repeats, plus each "
                          "repeat's median"),
        "git_revision": git_revision() or "unknown",
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "model_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "group_size": GROUP, "page_size": PAGE, "chunk_size": CHUNK,
                        "rho": RHO, "prompt_tokens": list(PROMPT_RANGE),
                        "output_tokens": list(OUTPUT_RANGE),
                        "head_budget_mean": float(head_budgets.mean()),
                        "group_budget_mean": float(tangram.group_budgets.mean())},
        "what_is_timed": ("per engine step: Scheduler.schedule + commit + finish (admission and "
                          "reservation, decode growth, reclaim in the baseline, chunk planning, "
                          "decode slots/lengths and the block-table update log for a "
                          "device-resident table); median over measured steps"),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
