#!/usr/bin/env bash
# `tangram-jax bench serve` with its configurations spread over this host's GPUs, one merged report.
#
# One process a GPU (CUDA_VISIBLE_DEVICES), each serving its share of the configurations
# (round-robin) into its own report and log under OUT's name with `.parts/` (beside OUT: only
# OUT and its plot sit in OUT's folder), then one report merged from them (`bench serve --merge`).
# Device time counts the machine, not its GPUs: four configurations on four GPUs cost one's
# wall time.
# The configurations share the host (CPU, PCIe root, host memory); the merged report says so
# in its `merged_from` commands.
#
#   benchmarks/serve_per_gpu.sh OUT.json full,full/recompute,tangram,tangram/recompute \
#       --model random-llama-8b --classes mid --sessions 16 --think-time 30 --kv-gib 16
#
# Every further argument goes to each `bench serve` unchanged (give --max-model-len when runs
# of other workloads are to be merged later: its default follows the longest workload).
set -euo pipefail
if (( $# < 2 )); then
  echo "usage: $0 OUT.json VARIANT[,VARIANT...] [bench serve flags...]" >&2; exit 2
fi
out=$1; variants=$2; shift 2
IFS=, read -ra configs <<< "$variants"
ngpu=$(nvidia-smi -L | wc -l)
(( ngpu >= 1 )) || { echo "$0: no GPU visible" >&2; exit 2; }
nproc=$(( ${#configs[@]} < ngpu ? ${#configs[@]} : ngpu ))
partdir="${out%.json}.parts"
mkdir -p "$partdir"
parts=(); pids=()
for (( g = 0; g < nproc; g++ )); do
  share=()
  for (( i = g; i < ${#configs[@]}; i += nproc )); do share+=("${configs[i]}"); done
  part="$partdir/gpu$g.json"
  parts+=("$part")
  CUDA_VISIBLE_DEVICES=$g python3 -u -m tangram_jax.cli bench serve -- "$@" \
      --variants "$(IFS=,; echo "${share[*]}")" --json "$part" --resume \
      > "$partdir/gpu$g.log" 2>&1 &
  pids+=($!)
done
status=0
for g in "${!pids[@]}"; do
  if ! wait "${pids[g]}"; then
    echo "$0: GPU $g's run failed (log: $partdir/gpu$g.log)" >&2; status=1
  fi
done
have=(); for p in "${parts[@]}"; do [[ -s $p ]] && have+=("$p"); done
(( ${#have[@]} )) || { echo "$0: no report came back" >&2; exit 1; }
python3 -m tangram_jax.cli bench serve -- --merge "${have[@]}" --json "$out" --overwrite
exit $status
