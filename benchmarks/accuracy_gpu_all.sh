#!/usr/bin/env bash
# Every accuracy run in one device call, one process a part. Each part writes its JSON after each
# (mode, ratio), so a part cut by the time limit keeps its finished columns:
#   A1-A3. the table on the committed samples (benchmarks/results/accuracy_tasks.jsonl, the
#      samples of the README table and of the kvpress runs), 100 a task, with KL: full with
#      tangram / dynamic / uniform at 0.25 and 0.5 (one mode per process: each serves full KV
#      too, for its KL reference);
#   B. tangram under each scoring rule named in $SCORING_RULES (EngineConfig.scoring_rule), same
#      samples;
#   C. KV precision: tangram+k8v4 and tangram+k8v4-k4v2 at 0.25 and 0.5, same samples,
#      with KL to full KV and every answer (tangram bf16 of A1 is the pair: compare answers sample
#      by sample, `accuracy_compare.py`, and the KLs);
#   D. the solvable task set: new samples of the current generator (answer prefixes, essay kv
#      retrieval), task sizes chosen by a 20-sample full-KV pilot, full and tangram.
#   They run A, C, B, D: a call cut by its time limit keeps the earlier letters.
# Everything lands in /tmp/run and comes back as $OUT/accuracy_run.tar.gz. Run from the repository
# root on the device machine, after a call that carried the model's first piece:
#   GIT_REV=... MODEL_PARTS=.gpu/model WHEELS=.gpu/acc-wheels NEEDLE_PKGS=.gpu/acc-pkgs \
#     SCORING_RULES="window+context window+keydiff" bash benchmarks/accuracy_gpu_all.sh SECONDS
set -uo pipefail
LIMIT=${1:-560}
FINAL_OUT=${OUT:-/tmp/out}; export OUT=/tmp/run; mkdir -p "$OUT" "$FINAL_OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu_model.sh || exit 1
left() { echo $((LIMIT - SECONDS)); }
# XLA's GEMM autotuning made each new prefill shape a 40-50 s compile (run of e4210d6: 5 shapes
# in 280 s, float32 weights); the table needs dozens of shapes. Autotuning picks faster GEMMs,
# not different results, so the accuracy run turns it off (probed first: an unknown flag aborts).
AUTOTUNE_OFF=--xla_gpu_autotune_level=0
if XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF" python3 -c "import jax; (jax.numpy.ones(4) + 1).block_until_ready()" \
    > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_OFF"
fi
echo "XLA_FLAGS=${XLA_FLAGS:-}"
export JAX_LOG_COMPILES=1   # each log then says what compiled and for how long
TASKS=benchmarks/results/accuracy_tasks.jsonl
# The README table's engine settings (rev e578b41), so this run compares with it cell by cell.
# 48 sessions at a time (not the table's 128): the harness fixes the pool at max-active full-length
# sessions (4.2 GiB at 128), and seven pools of that size with their steps' transients did not fit
# on one card beside each other (run of ba20a72: every part out of memory).
MAX_ACTIVE=${MAX_ACTIVE:-48}
# One prefill row a call and one padded size of it: each prefill shape is a compile of ~40 s on
# the GPU (run of 8b3e7b1: full KV's 12 shapes, 1, 2 or 4 rows x the ~1.5x ladder, took 480 s of
# every process), serving padded calls of a 135M model takes seconds.
ONE_SHAPE=(--max-num-batched-tokens 2112 --max-prefill-rows 1 --prefill-token-buckets 2112)
# bf16, as the engine serves on a GPU: float32 prefill steps ran 15x slower there (a probe of the
# harness's settings on an H100: 359 ms vs 23 ms a prefill step, 18 vs 6 ms a decode step), which
# made a full-KV column of 400 sessions take 261 s; every mode of the table runs in this dtype.
DTYPE=${DTYPE:-bfloat16}
ONE_SHAPE+=(--dtype "$DTYPE")
TABLE=(--tasks-in "$TASKS" --samples 100 --ratios 0.25,0.5 --max-model-len 1536 --chunk-size 2048
       --max-active "$MAX_ACTIVE" --decode-buckets "$MAX_ACTIVE" "${ONE_SHAPE[@]}"
       --layer-loop scan --tasks-out /tmp/unused.jsonl)
# Each engine caps JAX's allocator at its gpu_memory_utilization: a share of the card each
# (seven processes at 0.9 each left five without memory).
SHARE=${SHARE:-0.11}
# What the card holds while the parts run (each process adds its context and programs to its share).
(while sleep 15; do echo "$SECONDS s: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done) \
  > "$OUT/gpu_memory.log" 2>&1 &
SAMPLER=$!
# Which parts run (their letters), one after another unless PARALLEL=1: processes share the GPU
# by time slices, and a 135M model's steps are many small kernels, so parallel parts slowed each
# other far more than they overlapped (run of 931e3f9, four parts in bf16: 97 s a full-KV column
# of 400 sessions; a probe of the same settings alone served 96 sessions in 1.4 s).
PARTS=${PARTS:-ABCD}
# PARTS: letters (every part of that letter: "AC"), or part ids and letters separated by commas
# ("A1,C": the tangram column of A and the precision part only; "A1": that part alone).
wanted() {
  local id=${1%%_*} p
  if [[ $PARTS == *,* || $PARTS == *[0-9]* ]]; then
    for p in ${PARTS//,/ }; do [[ $id == "$p" || ${id:0:1} == "$p" ]] && return 0; done
    return 1
  fi
  [[ $PARTS == *${id:0:1}* ]]
}
# Everything so far, packed after each part: a device call cut by its own time limit (run of
# 4722624: the last part outlived LIMIT, the call ended before the final pack) keeps what finished.
pack() { tar czf "$FINAL_OUT/accuracy_run.tar.gz" -C "$OUT" .; }
part() {   # part NAME accuracy.py-args...: one process, its own log and JSON
  local name=$1; shift
  wanted "$name" || return 0
  (( $(left) > 30 )) || { echo "$name: skipped, $(left) s left"; return 0; }
  # -k: a process that ignores SIGTERM is killed 10 s later, so the script keeps to LIMIT.
  if [[ ${PARALLEL:-0} == 1 ]]; then
    LOG=$OUT/$name.log timeout -k 10 "$(left)" bash benchmarks/accuracy_gpu.sh --out "$OUT/$name.json" \
      --gpu-memory-utilization "$SHARE" "$@" > /dev/null 2>&1 &
  else
    LOG=$OUT/$name.log timeout -k 10 "$(left)" bash benchmarks/accuracy_gpu.sh --out "$OUT/$name.json" \
      --gpu-memory-utilization 0.5 "$@" > /dev/null 2>&1
    pack
  fi
}
part A1_tangram "${TABLE[@]}" --modes full,tangram --answers-out "$OUT/answers_tangram.jsonl"
part A2_dynamic "${TABLE[@]}" --modes full,dynamic
part A3_uniform "${TABLE[@]}" --modes full,uniform
part C_precision "${TABLE[@]}" --modes full,tangram+k8v4,tangram+k8v4-k4v2 \
  --answers-out "$OUT/answers_precision.jsonl"
for rule in ${SCORING_RULES:-}; do     # e.g. "window+context window+keydiff"
  part "B_${rule/+/_}" "${TABLE[@]}" --modes full,tangram --no-kl --scoring-rule "$rule" \
    --answers-out "$OUT/answers_${rule/+/_}.jsonl"
done
SOLVABLE=(--max-tokens 8 --max-model-len 2048 --chunk-size 2048 --max-active "$MAX_ACTIVE"
          --decode-buckets "$MAX_ACTIVE" "${ONE_SHAPE[@]}" --layer-loop scan)
part D_solvable --samples 100 --pilot-samples 20 --modes full,tangram,dynamic,uniform \
  --ratios 0.25,0.5 --no-kl "${SOLVABLE[@]}" --tasks-out "$OUT/accuracy_tasks_solvable.jsonl" \
  --answers-out "$OUT/answers_solvable.jsonl"
# The same solvable samples under each scoring rule (serial runs: the samples exist once D is done).
for rule in ${SCORING_RULES:-}; do
  [[ -s $OUT/accuracy_tasks_solvable.jsonl ]] || break
  part "D_solvable_${rule/+/_}" --tasks-in "$OUT/accuracy_tasks_solvable.jsonl" --samples 100 \
    --modes full,tangram --ratios 0.25,0.5 --no-kl --scoring-rule "$rule" "${SOLVABLE[@]}" \
    --tasks-out /tmp/unused.jsonl
done
for job in $(jobs -p); do [[ $job == "$SAMPLER" ]] || wait "$job"; done
kill "$SAMPLER" 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
for f in "$OUT"/*.log; do
  echo "== $f: $(grep "Finished XLA compilation" "$f" | sed -E 's/.* in ([0-9.]+) sec.*/\1/' |
    awk '{s += $1; n++} END {printf "%d compiles, %.0f s", n, s}')"
  grep -v -i -E "warn|^\s*$|^=== |external/xla|Compiling|Finished" "$f" | tail -14
done
pack
