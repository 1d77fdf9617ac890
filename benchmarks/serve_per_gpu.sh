#!/usr/bin/env bash
# `tangram-jax bench serve` with its configurations spread over this host's GPUs, one merged report.
#
#   benchmarks/serve_per_gpu.sh OUT.json CONFIG[,CONFIG...] [bench serve flags...]
#
# CONFIG: a `--variants` name, or NAME@tpN for that configuration with tensor parallelism over
# N GPUs (`--tensor-parallel-size N`), e.g. `tangram,tangram@tp2`. Each configuration is one
# process on its own GPUs (CUDA_VISIBLE_DEVICES: the lowest free ids), started in the order
# given as soon as enough GPUs are free, serving into its own report and log under OUT's name
# with `.parts/` (beside OUT: only OUT and its plot sit in OUT's folder); then one report
# merged from them (`bench serve --merge`: rows of other TP sizes are named NAME@tpN).
# Device time counts the machine, not its GPUs: four configurations on four GPUs cost one's
# wall time. The configurations share the host (CPU, PCIe root, host memory); the merged
# report says so in its `merged_from` commands.
#
#   benchmarks/serve_per_gpu.sh OUT.json full,full/recompute,tangram,tangram/recompute \
#       --model random-llama-8b --classes mid --sessions 16 --think-time 30 --kv-gib 16
#   benchmarks/serve_per_gpu.sh OUT.json tangram,tangram@tp2 --model random-llama-8b \
#       --classes mid --sessions 16 --followups 3 --kv-gib 16   # --kv-gib: bytes a GPU
#
# Every further argument goes to each `bench serve` unchanged (give --max-model-len when runs
# of other workloads are to be merged later: its default follows the longest workload).
set -euo pipefail
if (( $# < 2 )); then
  echo "usage: $0 OUT.json CONFIG[,CONFIG...] [bench serve flags...]" >&2; exit 2
fi
out=$1; variants=$2; shift 2
for arg in "$@"; do
  if [[ $arg == --tensor-parallel-size* ]]; then
    echo "$0: give tensor parallelism per configuration (CONFIG@tpN), not $arg" >&2; exit 2
  fi
done
IFS=, read -ra configs <<< "$variants"
ngpu=$(nvidia-smi -L | wc -l)
(( ngpu >= 1 )) || { echo "$0: no GPU visible" >&2; exit 2; }
names=(); sizes=()
for cfg in "${configs[@]}"; do
  name=$cfg; tp=1
  if [[ $cfg == *@* ]]; then
    name=${cfg%@*}; tp=${cfg##*@}
    [[ $tp =~ ^tp[1-9][0-9]*$ ]] || {
      echo "$0: configuration '$cfg': after @ give tpN (N GPUs, e.g. tangram@tp2)" >&2; exit 2; }
    tp=${tp#tp}
  fi
  (( tp <= ngpu )) || {
    echo "$0: configuration '$cfg' needs $tp GPUs; this host has $ngpu" >&2; exit 2; }
  names+=("$name"); sizes+=("$tp")
done
partdir="${out%.json}.parts"
mkdir -p "$partdir"
free=(); for (( g = 0; g < ngpu; g++ )); do free[g]=1; done
declare -A gpus_of=() part_of=()
parts=(); status=0

reap_one() {  # wait until one running configuration ends; free its GPUs
  while :; do
    for pid in "${!gpus_of[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        if ! wait "$pid"; then
          echo "$0: ${part_of[$pid]%.json}'s run failed (log: ${part_of[$pid]%.json}.log)" >&2
          status=1
        fi
        for g in ${gpus_of[$pid]}; do free[g]=1; done
        unset "gpus_of[$pid]" "part_of[$pid]"
        return
      fi
    done
    sleep 1
  done
}

for i in "${!configs[@]}"; do
  tp=${sizes[i]}
  while :; do
    pick=()
    for (( g = 0; g < ngpu && ${#pick[@]} < tp; g++ )); do
      (( free[g] )) && pick+=("$g")
    done
    (( ${#pick[@]} == tp )) && break
    reap_one
  done
  part="$partdir/run$i.json"
  parts+=("$part")
  tp_flag=(); (( tp > 1 )) && tp_flag=(--tensor-parallel-size "$tp")
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${pick[*]}") python3 -u -m tangram_jax.cli bench serve -- \
      "$@" --variants "${names[i]}" "${tp_flag[@]}" --json "$part" > "${part%.json}.log" 2>&1 &
  gpus_of[$!]="${pick[*]}"; part_of[$!]=$part
  for g in "${pick[@]}"; do free[g]=0; done
done
while (( ${#gpus_of[@]} )); do reap_one; done
have=(); for p in "${parts[@]}"; do [[ -s $p ]] && have+=("$p"); done
(( ${#have[@]} )) || { echo "$0: no report came back" >&2; exit 1; }
python3 -m tangram_jax.cli bench serve -- --merge "${have[@]}" --json "$out" --overwrite
exit $status
