"""Why greedy output can depend on what else is in the batch, on the CPU.

A full-KV pilot once answered differently from the table on the GPU (`NOTES_accuracy.md`).
The engine's GPU kernels split long attention reductions into shares merged by log-sum-exp
(flash-decoding), and how many shares a sequence gets depends on its batch mates:

1. prefill (`prefill_work_items`): spare items of a call go to the heaviest items first, so one
   row's history is cut into a number of splits that depends on the other rows' histories;
2. decode (`split_map.items_per_row`): items per row = num_programs / (batch bucket x G), so a
   sequence decoded in a batch of 1 is cut into many more shares than in a batch of 128.

This script shows both on the real kernels in interpret mode (small shapes): the split counts of
the same row alone and batched, and the largest difference in the attention output of the same
inputs computed with those different splits (float32: rounding-level, so a greedy answer flips
only where two tokens' logits are that close). The CPU engine uses the jnp references, which do
not split, so on a CPU greedy output is batch-independent (tests/engine/test_engine.py checks alone ==
batched); on a GPU it is not bit-for-bit. Writes `--out` (default a fresh file under
benchmarks/results/runs/; the committed accuracy_batch_invariance.json only with --overwrite).

    PYTHONPATH=$PWD python3 benchmarks/accuracy_batch_invariance.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tangram_jax.benchmarking.results import (RESULTS_DIR, finish,  # noqa: E402
                                               resolve_outputs, start)
from tangram_jax.commands import add_overwrite_flag, write_text_atomic  # noqa: E402
from tangram_jax.provenance import device_description, git_revision  # noqa: E402

COMMITTED = RESULTS_DIR / "accuracy_batch_invariance.json"


def prefill_splits() -> dict:
    """Splits of row 0's items alone and with a batch mate of longer history (same call size)."""
    from tangram_jax.pallas_kernels.prefill_attention import (PrefillTuning, pack_rows,
                                                              prefill_work_items, row_alignment)
    tuning = PrefillTuning(block_q=16, block_k=16, num_warps=4, num_stages=1, max_splits=4,
                           min_split_keys=8)
    out = {}
    for label, lens, hist in (("alone", [32], [[96, 64]]),
                              ("with a longer-history mate", [32, 32], [[96, 64], [160, 160]])):
        starts, used = pack_rows(lens, row_alignment(tuning))
        n = 128
        items = prefill_work_items(starts, lens, np.asarray(hist), tuning=tuning, num_tokens=n,
                                   num_items=(n // tuning.block_q) * 2 + 6)
        mine = items[items[:, 0] == 0]
        out[label] = sorted({(int(r[1]), int(r[2])): int(r[4]) for r in mine}.items())
    return {"row 0 (q_block, group) -> num_splits": {k: [[list(a), b] for a, b in v]
                                                     for k, v in out.items()}}


def decode_difference() -> dict:
    """The same decode inputs with 1 share per group vs 8: largest |difference| of the output."""
    import jax.numpy as jnp

    from tangram_jax.pallas_kernels.decode_attention import ragged_paged_decode_attention
    from tangram_jax.pallas_kernels.split_map import items_per_row, uniform_split_map
    rng = np.random.default_rng(0)
    batch, groups, g, heads, d, ps, max_pages = 2, 2, 1, 3, 64, 16, 32
    num_pages = batch * groups * max_pages
    q = jnp.asarray(rng.standard_normal((batch, groups, g * heads, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((num_pages, g, ps, d)) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_pages, g, ps, d)), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, groups, max_pages), jnp.int32)
    lengths = jnp.asarray([[500, 311], [512, 77]], jnp.int32)
    outs = {}
    for splits in (1, 8):
        work = uniform_split_map(1, groups, splits).work_list(0)
        outs[splits] = np.asarray(ragged_paged_decode_attention(q, k, v, tables, lengths,
                                                                work_list=work, interpret=True))
    diff = np.abs(outs[1] - outs[8])
    # SmolLM2-135M on an H100 (num_programs 528, 3 KV heads, G = 1): items per row by bucket.
    buckets = {b: items_per_row(528, b, 1, 3, 256) for b in (1, 8, 32, 128)}
    return {"max_abs_difference_1_vs_8_splits": float(diff.max()),
            "bit_identical": bool((diff == 0).all()),
            "max_abs_output": float(np.abs(outs[1]).max()),
            "smollm2_h100_items_per_row_by_decode_bucket": buckets}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "accuracy_batch_invariance"})
    try:   # a fixed workload: the committed run's time
        committed = json.loads(COMMITTED.read_text(encoding="utf-8"))
        estimate = (committed["seconds"], f"the committed run, {committed['device']}")
    except (OSError, ValueError, KeyError):
        estimate = None
    run = start("accuracy_batch_invariance", outputs, argv, estimate=estimate)
    t0 = time.perf_counter()
    report = {"benchmark": "accuracy_batch_invariance", "device": device_description(),
              "git_revision": git_revision() or "unknown",
              "command": "benchmarks/accuracy_batch_invariance.py",
              "prefill": prefill_splits(), "decode": decode_difference()}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_text_atomic(args.out, json.dumps(report, indent=1))
    finish(run)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
