#!/usr/bin/env bash
# The long-session accuracy table on a GPU: full KV against tangram's retention rules and views.
#
# The long-session tasks (evaluation.tasks.LONG_TASKS: door codes asked over three turns, a pass
# key, key-value pairs asked over two turns, in essay text spanning many prefill chunks), the
# committed samples (results/accuracy_tasks_long.jsonl, ~1.2k tokens: 9-10 chunks of 128),
# 100 samples a task, greedy, bf16, served by three processes side by side on one GPU (each
# with full KV beside it, whose answers the merge checks equal): tangram at the defaults
# (retention turn, view recent), tangram with view whole, tangram with retention chunk, and
# dynamic (per-input selection, compressing per chunk) as the part `dynamic`.
# Run from the repository root on the device machine after `benchmarks/gpu_model.sh` has the
# model in /tmp (two calls carry its two pieces):
#   GIT_REV=... [PARTS="recent whole chunk dynamic"] [RATIOS=0.25,0.5] \
#     bash benchmarks/accuracy_long_gpu.sh SECONDS
# Writes long_<part>.json for each part in PARTS and the merged accuracy_long.json (+ PNG) to $OUT.
set -uo pipefail
LIMIT=${1:-560}
export PYTHONUNBUFFERED=1
source benchmarks/gpu_model.sh || exit 1
AUTOTUNE_OFF=--xla_gpu_autotune_level=0
if XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF" python3 -c "import jax; (jax.numpy.ones(4) + 1).block_until_ready()" \
    > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF"
fi
PARTS=${PARTS:-recent whole chunk}
# The processes share the card (SmolLM2 with a 48-row pool needs a few GiB each).
export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / len('$PARTS'.split()), 2))")
CHUNK=${CHUNK:-128}
SAMPLES=${SAMPLES:-100}
COMMON=(--model /tmp/smollm2.gguf --tasks long_facts,long_passkey,long_kv --samples "$SAMPLES"
        --ratios "${RATIOS:-0.25,0.5}" --chunk-size "$CHUNK" --max-num-batched-tokens $((CHUNK + 64))
        --max-prefill-rows 1 --max-active 48 --decode-buckets 48 --layer-loop scan
        --dtype bfloat16 --no-kl --max-model-len 3072 --kvpress /nonexistent --modes full,tangram
        --tasks-in benchmarks/results/accuracy_tasks_long.jsonl)
declare -A EXTRA=([recent]="--turn-view recent" [whole]="--turn-view whole" [chunk]="--retention chunk"
                  [dynamic]="--modes full,dynamic")
for part in $PARTS; do
  # shellcheck disable=SC2086
  timeout $((LIMIT - SECONDS - 20)) python3 benchmarks/accuracy.py "${COMMON[@]}" ${EXTRA[$part]} \
    --out "$OUT/long_$part.json" > "$OUT/long_$part.log" 2>&1 &
done
wait
# shellcheck disable=SC2046
python3 benchmarks/accuracy_merge.py $(for part in $PARTS; do echo "$OUT/long_$part.json"; done) \
  --out "$OUT/accuracy_long.json"
