"""Decode attention over quantised KV pages (bf16 / K8V8 / K8V4 / K4V2), 8B layer, GPU only. On
the same retained tokens, at a Llama-3.1-8B layer shape: time per launch, bytes read, and the speed-up
over bf16 as a fraction of the byte-ratio ideal; plus kernel-vs-reference correctness at real
shapes on fresh random data.

One layer (32 query / 8 KV heads, head_dim 128, G = 2 -> 4 groups, page 16). Every sequence
retains ``context * r_g`` tokens in group g, r = (0.2, 0.4, 0.6, 0.8) (mean 0.5), the AOT split
map of those budgets drives the kernel. The pool is random (values N(0, 1) in bf16; codes
uniform random bytes with random scales and zeros: the kernel's work does not depend on the
values). Time: GPU busy time (the profiler's kernel durations: the decode launches and the merge)
of a jitted block of `CALLS` launches (each its own q), divided by the launches, as
`decode_attention.py` times bf16; the pool is far larger than L2, so every launch reads it from
HBM. The block's wall clock per launch is kept beside it (`wall_time_s`): it adds the host's
dispatch and synchronisation of the block, 50-120 us a launch at these sizes whatever the
format (H100, benchmarks/NOTES_decode.md), which is not attention time. The ideal
speed-up of a format is ``bytes(bf16) / bytes(format)`` per retained slot (codes plus the scales
and zeros of K and V: 512 / 272 / 216 / 112 bytes a slot at head_dim 128).

Precision tiers (``k8v4-k4v2``, `kv_layout.TieredLayout`): the same retained tokens of every
group split into a K8V4 tier of ``TIER_HIGH_SHARE`` of them and a K4V2 tier of the rest, each in
its own pool and block table; attended as the engine does (`ragged_paged_decode_attention` on
`kv_quant.TieredPages`): the untiered kernel once per tier's pool, each launch with its tier's
work list (`split_map.build_tier_split_map`: the AOT map over the tier groups, weighed by
their bytes, cut by tier), then one merge of both tiers' partials: 3 launches a layer. Its
ideal is the bytes ratio of that mix.

    GIT_REV=$(git rev-parse HEAD) python benchmarks/kv_precision_decode.py --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax import kv_quant
from tangram_jax.benchmarking.timing import gpu_busy_time, wall_quantiles
from tangram_jax.provenance import device_description, git_revision
from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag
from tangram_jax.kv_layout import PRECISION_TIERS
from tangram_jax.pallas_kernels import split_map as sm
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.decode_attention import (decode_partials,
                                                         ragged_paged_decode_attention,
                                                         ragged_paged_decode_attention_reference)
from tangram_jax.pallas_kernels.decode_merge import merge_partials_pallas
from tangram_jax.pallas_kernels.decode_pools import decode_programs, decode_tuning


NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, GROUP_SIZE, PAGE_SIZE = 32, 8, 128, 2, 16
BUDGETS = np.array([[0.2, 0.4, 0.6, 0.8]])
NUM_PROGRAMS = 132 * 4          # the engine's num_programs (--num-programs)
CALLS = 8
DTYPE = jnp.bfloat16
TIER_HIGH_SHARE = 0.5


def slot_bytes(precision: str) -> float:
    """Bytes one retained (token, KV head) slot costs, K and V together (precision tiers: the
    mean over the `TIER_HIGH_SHARE` mix)."""
    if precision in PRECISION_TIERS:
        high, low = (slot_bytes(t) for t in PRECISION_TIERS[precision])
        return TIER_HIGH_SHARE * high + (1 - TIER_HIGH_SHARE) * low
    return kv_quant.page_bytes(kv_quant.page_format(precision), 1, 1, HEAD_DIM, DTYPE)


def make_case(key, batch: int, context: int):
    """Lengths [batch, groups] and block tables over a shuffled pool of exactly their pages."""
    groups = NUM_KV_HEADS // GROUP_SIZE
    lengths = np.broadcast_to(np.round(context * BUDGETS[0]).astype(np.int32), (batch, groups))
    max_pages = int(-(-lengths.max() // PAGE_SIZE))
    num_pages = batch * groups * max_pages + 1
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    tables = (1 + rng.permutation(num_pages - 1)).reshape(batch, groups, max_pages)
    return np.ascontiguousarray(lengths), tables.astype(np.int32), num_pages


def random_pool(key, num_pages: int, bits: int | None, groups: int = 1, unit: int = 8,
                slot_pairs: bool = False, page_format: str | None = None):
    """A K or V pool of random contents in the format of `bits` (`groups` scales a row, codes
    in `unit`-bit units, in slot pairs when set: the page format's `code_unit`, `slot_pairs`;
    tagged with the format's name, `page_format`)."""
    shape = (num_pages, GROUP_SIZE, PAGE_SIZE, HEAD_DIM)
    if bits is None:
        return jax.random.normal(key, shape, DTYPE)
    k1, k2, k3 = jax.random.split(key, 3)
    spec = kv_quant.pool_arrays(shape, DTYPE, bits, make=jax.ShapeDtypeStruct, groups=groups,
                                unit=unit, slot_pairs=slot_pairs, page_format=page_format)
    # Codes drawn as 32-bit words and viewed as units: uint8 draws go through a 4x-sized
    # intermediate (the 128k pools of run 1 ran out of memory asking exactly 4 bytes per code).
    *lead, width = spec.codes.shape
    per_word = 4 // jnp.dtype(spec.codes.dtype).itemsize
    words = jax.random.bits(k1, (*lead, width // per_word), jnp.uint32)
    codes = jax.lax.bitcast_convert_type(words, spec.codes.dtype).reshape(spec.codes.shape)
    scale = jax.random.uniform(k2, spec.scale.shape, jnp.float32, 0.5, 1.5) * (
        2.0 / ((1 << bits) - 1))
    zero = jax.random.uniform(k3, spec.zero.shape, jnp.float32, -1.5, -0.5)
    return dataclasses.replace(spec, codes=codes, scale=scale, zero=zero)


def random_pools(key, num_pages: int, fmt: kv_quant.PageFormat) -> tuple:
    """(k, v) pools of random contents in page format `fmt`."""
    kk, vk = jax.random.split(key)
    return (random_pool(kk, num_pages, fmt.key_bits, unit=fmt.code_unit,
                        slot_pairs=fmt.slot_pairs, page_format=fmt.name),
            random_pool(vk, num_pages, fmt.value_bits, fmt.value_groups, fmt.code_unit,
                        fmt.slot_pairs, fmt.name))


def programs_of(precision: str, num_programs: int, program_scale: str) -> int:
    """The split map's program target of `precision`: the engine's (`decode_programs`: the
    format's measured multiple of num_programs) with `program_scale` "auto", else num_programs
    times that integer for every format."""
    if program_scale == "auto":
        return decode_programs(precision, num_programs)
    return num_programs * int(program_scale)


def run_config(key, batch, context, block_tokens_by_precision, correctness_rows,
               num_programs, program_scale="auto"):
    lengths, tables, num_pages = make_case(key, batch, context)
    groups = lengths.shape[1]
    slots = int(lengths.sum()) * GROUP_SIZE
    # A q array a launch (not slices of one array: a slice is a copy, 1.5 us a launch in every
    # format's time until session 28, which the engine's q, the projection's output, never pays).
    qs = [jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, 1), i),
                            (batch, groups, GROUP_SIZE * NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM),
                            DTYPE) for i in range(CALLS)]
    out = {"batch": batch, "context": context, "num_programs": num_programs,
           "program_scale": program_scale,
           "retained_slots": slots,
           "lengths_per_group": lengths[0].tolist(), "num_pages": num_pages, "formats": {}}
    lens = jnp.asarray(lengths)
    tbl = jnp.asarray(tables)
    for precision, block_list in block_tokens_by_precision.items():
        programs = programs_of(precision, num_programs, program_scale)
        try:
            out["formats"][precision] = _measure(key, precision, block_list, num_pages, slots,
                                                 qs, tbl, lens, correctness_rows, programs,
                                                 num_programs)
        except Exception as e:   # a format that fails to compile or run is reported, not fatal
            out["formats"][precision] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"batch {batch} ctx {context} {precision}: FAILED {e!r}"[:2000], flush=True)
    base = out["formats"].get("bf16", {})
    for precision, entry in out["formats"].items():
        if "time_s" not in entry or "time_s" not in base:
            continue
        ideal = base["bytes_read"] / entry["bytes_read"]
        speedup = base["time_s"] / entry["time_s"]
        entry.update(ideal_speedup=ideal, speedup=speedup, fraction_of_ideal=speedup / ideal)
        if "wall_time_s" in entry and "wall_time_s" in base:   # the block's wall clock, host in
            entry["wall_fraction_of_ideal"] = base["wall_time_s"] / entry["wall_time_s"] / ideal
    return out


def tiered_case(key, precision, lens, batch, num_programs):
    """The same retained tokens as tier groups: (k, v `kv_quant.TieredPages`, tables [batch,
    2 groups, max_pages], lengths [batch, 2 groups], the (high, low) work lists, bytes read).
    Each tier pool holds exactly its tier's pages (shuffled), the high tier `TIER_HIGH_SHARE`
    of a group's tokens."""
    lengths = np.asarray(lens)
    high = np.round(lengths * TIER_HIGH_SHARE).astype(np.int32)
    tier_lens = np.stack([high, lengths - high], axis=-1).reshape(lengths.shape[0], -1)
    tier_groups = tier_lens.shape[1]
    width = int(-(-tier_lens.max() // PAGE_SIZE))
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    pages = batch * tier_groups * width + 1
    tables = (1 + rng.permutation(pages - 1)).reshape(batch, tier_groups, width).astype(np.int32)
    pools = []
    for i, tier in enumerate(PRECISION_TIERS[precision]):
        pools.append(random_pools(jax.random.fold_in(key, 200 + i), pages,
                                  kv_quant.page_format(tier)))
    (k_hi, v_hi), (k_lo, v_lo) = pools
    read = GROUP_SIZE * sum(int(tier_lens[:, t::2].sum()) * slot_bytes(tier)
                            for t, tier in enumerate(PRECISION_TIERS[precision]))
    return (kv_quant.TieredPages(k_hi, k_lo), kv_quant.TieredPages(v_hi, v_lo),
            jnp.asarray(tables), jnp.asarray(tier_lens),
            tier_work_lists(precision, batch, num_programs), read)


def work_list(precision, batch, num_programs, group_order=False):
    """The work list the engine builds for `precision` at a program target (precision tiers:
    the (high, low) pair, `tier_work_lists`); `group_order`: its items in group order (the
    order before session 28's longest first, `split_map.longest_first`)."""
    if precision in PRECISION_TIERS:
        return tier_work_lists(precision, batch, num_programs, group_order)
    smap = sm.build_split_map(BUDGETS, num_programs, batch, group_size=GROUP_SIZE)
    return _ordered(smap, group_order).work_list(0)


def _ordered(smap, group_order):
    return dataclasses.replace(smap, group_orders=None) if group_order else smap


def tier_work_lists(precision, batch, num_programs, group_order=False) -> tuple:
    """The (high, low) work lists of the tiers' AOT map, as the engine builds them
    (`decode_step.decode_split_map`: tier groups weighed by their slot bytes)."""
    smap = sm.build_tier_split_map(BUDGETS, np.full(BUDGETS.shape, TIER_HIGH_SHARE),
                                   tuple(slot_bytes(t) for t in PRECISION_TIERS[precision]),
                                   num_programs, batch, group_size=GROUP_SIZE)
    return tuple(w[0] for w in _ordered(smap, group_order).tier_work_lists())


def per_tier_decode(q, k_pages, v_pages, block_tables, lengths, *, work_list,
                    block_tokens=None, num_warps=None, num_stages: int = 3,
                    heads_per_program: int = 1):
    """The baseline of the one-launch tiered decode: a decode launch per precision tier (each
    over its tier groups' rows of the shared tables, `decode_partials` with `tier`), then one
    merge launch of both launches' partials. Arguments as `ragged_paged_decode_attention` over
    `kv_quant.TieredPages`; block_tokens an int or a (high, low) pair, None: each tier's
    page format's `DECODE_TUNING`."""
    pools = kv_quant.tier_pools(k_pages, v_pages)
    interpret = backend.resolve_interpret(None)
    parts = []
    for t, ((k, v), work) in enumerate(zip(pools, work_list)):
        tuned = decode_tuning(k, v)
        tokens = block_tokens[t] if isinstance(block_tokens, tuple) else block_tokens
        parts.append(decode_partials(
            q, k, v, block_tables, lengths, jnp.asarray(work, jnp.int32), tier=t,
            num_tiers=len(pools), block_tokens=tokens or tuned[0],
            num_warps=num_warps or tuned[1], num_stages=num_stages,
            heads_per_program=heads_per_program, interpret=interpret))
    return merge_partials_pallas(tuple(p[0] for p in parts), tuple(p[1] for p in parts),
                                 tuple(p[2] for p in parts), num_groups=q.shape[1],
                                 out_dtype=q.dtype, interpret=interpret)


def _tuning(tuning) -> dict:
    """Kernel keywords of a sweep entry "block_tokens[/num_warps[/num_stages[/heads]]]", or
    "default": none (each pool's page format's `DECODE_TUNING`, what the engine runs).
    Precision tiers: block_tokens "high+low" gives each tier its own, and a suffix
    ":per-tier" launches each tier on its own (`per_tier_decode`; default one launch). The
    suffixes of `_entry_suffixes` are not kernel keywords and are dropped here."""
    tuning, _, launch = _entry_suffixes(tuning)[0].partition(":")
    if launch not in ("", "per-tier"):
        raise ValueError(f"a sweep entry's launch suffix must be ':per-tier', got {launch!r}")
    kw = {"per_tier": True} if launch else {}
    if tuning == "default":
        return kw
    block, *rest = tuning.split("/")
    parts = [int(x) for x in rest]
    blocks = tuple(int(x) for x in block.split("+"))
    kw.update(zip(("num_warps", "num_stages", "heads_per_program"), parts),
              block_tokens=blocks if len(blocks) > 1 else blocks[0])
    return {"num_warps": 2, **kw}


def _entry_suffixes(tuning) -> tuple[str, int | None, bool]:
    """A sweep entry "tuning[@S][~group]" as (tuning, S or None, group order): "@S" sizes
    its split map for num_programs x S for this entry alone (None: the run's); "~group"
    lists its work items in group order, not the maps' longest first."""
    rest, tilde, order = str(tuning).partition("~")
    if tilde and order != "group":
        raise ValueError(f"a sweep entry's order suffix must be '~group', got {tuning!r}")
    spec, at, scale = rest.partition("@")
    return spec, (int(scale) if at else None), bool(tilde)


def _measure(key, precision, block_list, num_pages, slots, qs, tbl, lens, correctness_rows,
             num_programs, base_programs):
    """One format's entry: time per launch for each block size, the best, bandwidth, check.
    num_programs: the run's program target of `precision`; an entry's own scale S ("@S")
    targets base_programs x S (the engine's num_programs)."""
    batch = qs[0].shape[0]
    if precision in PRECISION_TIERS:
        k_pages, v_pages, tbl, lens, work, read = tiered_case(key, precision, lens, batch,
                                                              num_programs)
    else:
        k_pages, v_pages = random_pools(jax.random.fold_in(
            key, 100 + kv_quant.KV_PRECISIONS.index(precision)), num_pages,
            kv_quant.page_format(precision))
        work = work_list(precision, batch, num_programs)
        read = slots * slot_bytes(precision)

    def work_at(tuning):
        """The work list of a sweep entry: its program scale (none: the run's), its order."""
        _, scale, group_order = _entry_suffixes(tuning)
        if scale is None and not group_order:
            return work
        return work_list(precision, batch,
                         num_programs if scale is None else base_programs * scale, group_order)

    def attend(q, k, v, t, n, work=work_at(None), per_tier=False, **kw):
        launch = per_tier_decode if per_tier else ragged_paged_decode_attention
        return launch(q, k, v, t, n, work_list=work, **kw)
    reference = ragged_paged_decode_attention_reference
    # Kernel launches a layer's decode attention makes (pallas_calls in its program).
    launches = str(jax.make_jaxpr(lambda q, k, v: attend(q, k, v, tbl, lens))(
        qs[0], k_pages, v_pages)).count("pallas_call[")
    entry = {"bytes_read": read, "launches": launches, "num_programs": num_programs,
             "by_block_tokens": {}}
    for tuning in block_list:            # "block_tokens[/num_warps[/num_stages]]"
        @jax.jit
        def block(qs, k_pages, v_pages, kw=dict(_tuning(tuning), work=work_at(tuning))):
            return [attend(qs[i], k_pages, v_pages, tbl, lens, **kw) for i in range(CALLS)]
        try:
            wall = wall_quantiles(block, (qs, k_pages, v_pages), 7)[0] / CALLS
            kernels = {}
            busy = gpu_busy_time(block, (qs, k_pages, v_pages), 7, kernels)
        except Exception as e:   # e.g. a tuning needing more shared memory than an SM has
            entry.setdefault("failed_tunings", {})[str(tuning)] = f"{type(e).__name__}: {e}"[:500]
            print(f"{precision} {tuning}: FAILED {e!r}"[:500], flush=True)
            continue
        entry["by_block_tokens"][str(tuning)] = busy / CALLS if busy else wall
        entry.setdefault("wall_by_block_tokens", {})[str(tuning)] = wall
        entry.setdefault("kernels_s_by_block_tokens", {})[str(tuning)] = {
            k: v / CALLS for k, v in sorted(kernels.items())}
        entry["time_source"] = "gpu_busy" if busy else "wall"
    if not entry["by_block_tokens"]:
        raise RuntimeError(f"every tuning failed: {entry['failed_tunings']}")
    best = min(entry["by_block_tokens"], key=entry["by_block_tokens"].get)
    entry["block_tokens"] = best
    entry["time_s"] = entry["by_block_tokens"][best]
    entry["wall_time_s"] = entry["wall_by_block_tokens"][best]
    entry["kernels_s"] = entry["kernels_s_by_block_tokens"][best]
    entry["bandwidth_gb_s"] = entry["bytes_read"] / entry["time_s"] / 1e9
    if correctness_rows:
        r = correctness_rows
        q = qs[0][:r]
        got = attend(q, k_pages, v_pages, tbl[:r], lens[:r], work=work_at(best),
                     **_tuning(best))
        ref = reference(q, k_pages, v_pages, tbl[:r], lens[:r])
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        entry["check_rows"] = r
        entry["rel_err_vs_reference"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        entry["finite"] = bool(np.isfinite(got).all())
    del k_pages, v_pages
    print(f"batch {batch} rows {precision}: {entry['time_s'] * 1e6:.1f} us "
          f"({entry['time_source']}; wall {entry['wall_time_s'] * 1e6:.1f} us) "
          f"{entry['bandwidth_gb_s']:.0f} GB/s blocks {entry['by_block_tokens']} "
          f"err {entry.get('rel_err_vs_reference')}", flush=True)
    return entry


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    p.add_argument("--configs", default="32x32768,64x32768,32x131072,64x131072")
    p.add_argument("--sweep", default="32,64", help="block_tokens[/num_warps[/num_stages[/heads_per_program]]] "
                   "or 'default' (the library's per-format tuning), tried at the first config; "
                   "the best is used for the others. Tiers: block_tokens 'high+low', suffix "
                   "':per-tier' (a launch per tier); any entry: suffix '@S' (its own program "
                   "scale), then '~group' (its work items in group order, not longest first)")
    p.add_argument("--precisions",
                   default=",".join(kv_quant.KV_PRECISIONS + tuple(PRECISION_TIERS)))
    p.add_argument("--num-programs", type=int, default=NUM_PROGRAMS,
                   help="the engine's num_programs (default 528)")
    p.add_argument("--program-scale", default="auto",
                   help="'auto': each format's split map sized as the engine sizes it "
                   "(tuning.DECODE_PROGRAM_SCALE); an integer N: num_programs x N "
                   "for every format")
    p.add_argument("--baseline-sweep", default=None,
                   help="tunings tried for bf16 (default: --sweep)")
    p.add_argument("--one-process", action="store_true",
                   help="measure every configuration in this process (default with a sweep; "
                   "with 'default' tunings each configuration runs in a fresh process)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "kv_precision_decode"})
    run = start("kv_precision_decode", outputs, argv)
    if jax.default_backend() == "cpu":
        sys.exit("GPU only")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    sweep = args.sweep.split(",")
    precisions = tuple(args.precisions.split(","))
    base_sweep = args.baseline_sweep.split(",") if args.baseline_sweep else sweep
    if len(configs) > 1 and not args.one_process and sweep == base_sweep == ["default"]:
        # A process per configuration: measured in one process after the others, K8V8 at 64 x
        # 128k ran 4505 us, alone 3573 (H100, session 15): what earlier configurations leave
        # in the allocator and caches is not part of a configuration's time.
        _isolated(args, configs)
        finish(run)
        return
    results = []
    key = jax.random.key(int.from_bytes(os.urandom(4), "little"))   # fresh data every run
    chosen = None
    for i, (batch, context) in enumerate(configs):
        blocks = {p: (base_sweep if p == "bf16" else sweep) for p in precisions} \
            if chosen is None else \
            {p: [chosen[p]] for p in precisions}
        res = run_config(jax.random.fold_in(key, i), batch, context, blocks,
                         correctness_rows=4 if context <= 32768 else 0,
                         num_programs=args.num_programs, program_scale=args.program_scale)
        if chosen is None:
            chosen = {p: e.get("block_tokens", sweep[0]) for p, e in res["formats"].items()}
        results.append(res)
        _write(args.out, results, precisions)
    for res in results:
        print(res["batch"], res["context"],
              {p: round(e["fraction_of_ideal"], 3) for p, e in res["formats"].items()
               if "fraction_of_ideal" in e})
    finish(run)


def _isolated(args, configs):
    """Each configuration in its own process (this script with that one configuration), the
    results written together to `args.out` as one run."""
    results = []
    for batch, context in configs:
        part = f"{args.out}.{batch}x{context}.part"
        cmd = [sys.executable, os.path.abspath(__file__), "--out", part, "--configs",
               f"{batch}x{context}", "--sweep", args.sweep, "--precisions", args.precisions,
               "--num-programs", str(args.num_programs), "--program-scale", args.program_scale,
               "--one-process"]
        if args.baseline_sweep:
            cmd += ["--baseline-sweep", args.baseline_sweep]
        subprocess.run(cmd, check=True)
        with open(part) as f:
            results += json.load(f)["results"]
        os.remove(part)
        _write(args.out, results, tuple(args.precisions.split(",")))


def _write(path, results, precisions):
    """The JSON so far (rewritten after every configuration: a run cut short keeps its part)."""
    doc = {"benchmark": "kv_precision_decode", "device": device_description(),
           "jax": jax.__version__, "git_revision": git_revision() or "unknown",
           "command": " ".join(sys.argv), "shape": dict(q_heads=NUM_Q_HEADS,
                                                       kv_heads=NUM_KV_HEADS,
                                                       head_dim=HEAD_DIM, group_size=GROUP_SIZE,
                                                       page_size=PAGE_SIZE,
                                                       budgets=BUDGETS[0].tolist()),
           "slot_bytes": {p: slot_bytes(p) for p in precisions},
           "calls_per_block": CALLS, "results": results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
