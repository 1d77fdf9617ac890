#!/usr/bin/env bash
# The long-session accuracy table on a GPU, full KV against tangram's two retention rules.
#
# The long-session tasks (evaluation.tasks.LONG_TASKS:
# door codes asked over three turns, a pass key, key-value pairs asked over two turns, in essay
# text spanning many prefill chunks) served by full KV and tangram (retention "turn", the
# default) with task sizes chosen by a 20-sample full-KV pilot (part A), then the same samples
# by tangram with retention "chunk" and by dynamic (part B), 100 samples a task, greedy, bf16.
# Run from the repository root on the device machine after `benchmarks/gpu_model.sh` has the
# model in /tmp (two calls carry its two pieces):
#   GIT_REV=... PARTS=A bash benchmarks/accuracy_long_gpu.sh SECONDS     (then PARTS=B)
# Each part writes its JSON to $OUT (long_turn.json, long_chunk.json; the samples in
# long_tasks.jsonl). CHUNK (default 256) is the prefill chunk: 1.4k-2k-token contexts span 6-8.
set -uo pipefail
LIMIT=${1:-560}
export PYTHONUNBUFFERED=1
source benchmarks/gpu_model.sh || exit 1
AUTOTUNE_OFF=--xla_gpu_autotune_level=0
if XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF" python3 -c "import jax; (jax.numpy.ones(4) + 1).block_until_ready()" \
    > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF"
fi
CHUNK=${CHUNK:-256}
SAMPLES=${SAMPLES:-100}
COMMON=(--model /tmp/smollm2.gguf --tasks long_facts,long_passkey,long_kv --samples "$SAMPLES"
        --ratios 0.25,0.5 --chunk-size "$CHUNK" --max-num-batched-tokens $((CHUNK + 64))
        --max-prefill-rows 1 --max-active 48 --decode-buckets 48 --layer-loop scan
        --dtype bfloat16 --no-kl --max-model-len 3072 --kvpress /nonexistent)
PARTS=${PARTS:-A}
if [[ $PARTS == *A* ]]; then
  timeout $((LIMIT - SECONDS)) python3 benchmarks/accuracy.py "${COMMON[@]}" --modes full,tangram \
    --pilot-samples 20 --tasks-out "$OUT/long_tasks.jsonl" --out "$OUT/long_turn.json" \
    2>&1 | tee "$OUT/long_turn.log" | grep -v "^WARNING\|compil" | tail -25
  cp "$OUT/long_tasks.jsonl" /tmp/long_tasks.jsonl 2>/dev/null
fi
if [[ $PARTS == *B* ]]; then
  timeout $((LIMIT - SECONDS)) python3 benchmarks/accuracy.py "${COMMON[@]}" \
    --modes full,tangram,dynamic --retention chunk --tasks-in /tmp/long_tasks.jsonl \
    --out "$OUT/long_chunk.json" 2>&1 | tee "$OUT/long_chunk.log" | grep -v "^WARNING\|compil" | tail -25
fi
