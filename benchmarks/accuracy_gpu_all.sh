#!/usr/bin/env bash
# Issue 12's accuracy runs in one device call, side by side on the one GPU (a 135M model leaves
# the card and its 16 cores mostly idle; every part writes its JSON as it goes):
#   A. the table: size pilot, then full / tangram / dynamic / uniform at 0.25 and 0.5 with KL
#      (accuracy_gpu.sh), every answer kept (accuracy_answers.jsonl);
#   B. kvpress on A's samples at the same ratios (kvpress_gpu.sh);
#   C. batch dependence: full KV serving A's first samples one session at a time
#      (--max-active 1); accuracy_compare.py compares its answers with A's;
#   D. the previous table's samples (benchmarks/results/accuracy_tasks.jsonl as committed before
#      this run) in full and tangram@0.25 on this code: did the ragged-prefill merge move it?
#   E. chunk-local scoring (chunk 512: a turn in 2-4 chunks, each scored by its own last
#      queries) and the `none` tail rule at chunk 2048, tangram@0.25, on A's samples.
# Everything lands in /tmp/run and comes back as $OUT/accuracy_run.tar.gz (a call returns at
# most 8 files). Run from the repository root (or its copy) on the device machine:
#   GIT_REV=... MODEL_PARTS=.gpu/model WHEELS=.gpu/acc-wheels PKGS=.gpu/kvp/kvpress-pkgs.tar.gz \
#     bash benchmarks/accuracy_gpu_all.sh SAMPLES SECONDS
set -uo pipefail
SAMPLES=${1:-100}; LIMIT=${2:-520}
FINAL_OUT=${OUT:-/tmp/out}; export OUT=/tmp/run; mkdir -p "$OUT" "$FINAL_OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_model.sh || exit 1
left() { echo $((LIMIT - SECONDS)); }
COMMON=(--max-tokens 8 --decode-buckets 128 --max-num-batched-tokens 8192 --max-prefill-rows 4
        --layer-loop scan --max-model-len 2048)
cp benchmarks/results/accuracy_tasks.jsonl /tmp/previous_tasks.jsonl
# A canary through every code path (generation, prefix, compression, KL, answers) on 2 samples
# with A's engine shapes: a broken run stops here, and A finds the programs compiled.
LOG=$OUT/canary.log timeout ${CANARY_SECONDS:-300} bash benchmarks/accuracy_gpu.sh --samples 2 --modes full,uniform \
  --ratios 0.25 --max-active 128 --chunk-size 2048 --out "$OUT/canary.json" \
  --tasks-out /tmp/canary_tasks.jsonl --answers-out /tmp/canary_answers.jsonl "${COMMON[@]}" \
  > /dev/null 2>&1
if ! grep -q '"complete": true' "$OUT/canary.json" 2>/dev/null; then
  echo "canary failed:"; tail -40 "$OUT/canary.log"; exit 1
fi
grep -E "built|KL" "$OUT/canary.log"
LOG=$OUT/A.log timeout "$(left)" bash benchmarks/accuracy_gpu.sh --samples "$SAMPLES" \
  --pilot-samples 20 --max-active 128 --chunk-size 2048 --ratios 0.25,0.5 \
  --answers-out "$OUT/accuracy_answers.jsonl" "${COMMON[@]}" > /dev/null 2>&1 &
# B and C start once A has written its samples (after its pilot), and give up if A died.
wait_for_tasks() { while [ ! -s "$OUT/accuracy_tasks.jsonl" ]; do kill -0 $A 2>/dev/null || exit 1; sleep 2; done; sleep 1; }
(wait_for_tasks
 timeout "$(left)" bash benchmarks/kvpress_gpu.sh --tasks-file "$OUT/accuracy_tasks.jsonl" \
   --samples "$SAMPLES" --ratios 0.5,0.25 --max-tokens 8 > "$OUT/B.log" 2>&1) &
(wait_for_tasks
 cp "$OUT/accuracy_tasks.jsonl" /tmp/tasks.jsonl
 LOG=$OUT/C.log timeout "$(left)" bash benchmarks/accuracy_gpu.sh --tasks-in /tmp/tasks.jsonl \
   --samples 25 --modes full --max-active 1 --chunk-size 2048 --no-kl \
   --out "$OUT/accuracy_max_active1.json" --tasks-out /tmp/unused.jsonl \
   --answers-out "$OUT/answers_max_active1.jsonl" "${COMMON[@]}" > /dev/null 2>&1) &
(LOG=$OUT/D.log timeout "$(left)" bash benchmarks/accuracy_gpu.sh \
   --tasks-in /tmp/previous_tasks.jsonl --samples 100 --modes full,tangram --ratios 0.25 \
   --max-active 128 --max-model-len 1536 --chunk-size 2048 --no-kl --max-tokens 16 \
   --decode-buckets 128 --max-num-batched-tokens 8192 --max-prefill-rows 4 --layer-loop scan \
   --out "$OUT/accuracy_previous_tasks.json" --tasks-out /tmp/unused2.jsonl > /dev/null 2>&1
 wait_for_tasks; cp "$OUT/accuracy_tasks.jsonl" /tmp/tasks_e.jsonl
 for cfg in "512 window" "2048 none"; do
   set -- $cfg
   LOG=$OUT/E_$1_$2.log timeout "$(left)" bash benchmarks/accuracy_gpu.sh \
     --tasks-in /tmp/tasks_e.jsonl --samples 50 --modes full,tangram --ratios 0.25 \
     --max-active 128 --chunk-size "$1" --tail-rule "$2" --no-kl \
     --out "$OUT/accuracy_chunk$1_$2.json" --tasks-out /tmp/unused3.jsonl "${COMMON[@]}" \
     > /dev/null 2>&1
 done) &
wait
python3 benchmarks/accuracy_compare.py "$OUT/accuracy_answers.jsonl" \
  "$OUT/answers_max_active1.jsonl" --mode full --tasks /tmp/tasks.jsonl > "$OUT/C_compare.txt" 2>&1
cat "$OUT/C_compare.txt"
for f in "$OUT"/*.log; do echo "== $f"; grep -v -i -E "warn|^\s*$" "$f" | tail -22; done
tar czf "$FINAL_OUT/accuracy_run.tar.gz" -C "$OUT" .
