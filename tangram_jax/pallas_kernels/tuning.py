"""Tuned launch parameters of the Pallas kernels, as data: by device, then by page format (as
JAX's TPU kernels keep theirs in `tuned_block_sizes.py`).

Every value is the fastest of a sweep at a Llama-3.1-8B layer (32 query / 8 KV heads, head_dim
128, G 2, page 16); the sweeps are benchmarks' results (`benchmarks/results/kv_precision_decode*.json`
for decode, `decode_attention.json` for bf16 decode, `prefill_8b.json` for prefill) and the
current figures are rows of `benchmarks/README.md`. Why a kernel takes a parameter is said where
the kernel uses it; how a value was found is in git history and the benchmarks' results logs.

Only an H100 has been swept: every device reads the `TUNED_DEVICE` entries until it has its own
(the H200 ran the bf16 decode kernel at the same settings).
"""

from __future__ import annotations

TUNED_DEVICE = "H100"

# Decode launch, by page format: (block_tokens, num_warps), 3 pipeline stages. Precision tiers in
# one launch: ((high tier's, low tier's) block_tokens, num_warps). The quantised formats are
# 10-20% slower at bf16's 32/2; K4V2 runs one warp a program (no cross-warp reductions or
# barriers in its issue-bound loop).
DECODE_TUNINGS = {
    "H100": {"bf16": (32, 2), "k8v8": (128, 4), "k8v4": (64, 2), "k4v2": (64, 1),
             "k8v4-k4v2": ((128, 256), 4)},
}

# Programs a decode launch's split map is sized for, as a multiple of the engine's
# `num_programs`, by page format (precision tiers: 1). More, smaller items even out the SMs'
# last wave of programs until each item's prologue costs more than the tail it removes
# (`benchmarks/results/kv_precision_decode_num_programs.json`).
DECODE_PROGRAM_SCALES = {
    "H100": {"bf16": 1, "k8v8": 2, "k8v4": 4, "k4v2": 4},
}

# The decode merge launch: work items one step reads at once (at most), the float32 elements of
# a step's partial outputs (head_dim is split to fit), warps a program
# (`benchmarks/results/kv_precision_decode_partials_merge.json`).
MERGE_TUNINGS = {
    "H100": {"chunk_items": 32, "tile_f32": 4096, "num_warps": 2},
}

# Chunked-prefill attention: query block, key block, warps, pipeline stages. On one 8192-token
# row over 32k of history (TFLOP/s): (32, 64, 4, 2) 366; (32, 64, 8, 2) 235; (32, 128, 8, 2)
# 280; (32, 64, 8, 3) 239; (16, 64, 4, 2) 263; (64, 64, 8, 2) 294; (32, 128, 8, 3) 297;
# (16, 128, 4, 3) 197; cuDNN on the same keys made contiguous 284.
PREFILL_TUNINGS = {
    "H100": {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 2},
}

DECODE_TUNING = DECODE_TUNINGS[TUNED_DEVICE]
DECODE_PROGRAM_SCALE = DECODE_PROGRAM_SCALES[TUNED_DEVICE]
MERGE_TUNING = MERGE_TUNINGS[TUNED_DEVICE]
PREFILL = PREFILL_TUNINGS[TUNED_DEVICE]
