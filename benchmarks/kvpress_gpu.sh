#!/usr/bin/env bash
# kvpress_accuracy.py on the device machine. Its image has torch and transformers 5.17, no internet; kvpress
# 0.5.5 and the versions it pins (transformers 5.2, tokenizers 0.22, datasets and the small
# packages it imports) travel as one tarball of the CPU venv's site-packages (pure Python but
# tokenizers' abi3 library, x86-64); the Hugging Face folder is made there from the joined GGUF
# (benchmarks/kvpress_hf_folder.py). Then benchmarks/kvpress_accuracy.py runs on the GPU.
#   PKGS=.gpu/kvp/kvpress-pkgs.tar.gz MODEL_PARTS=.gpu/model WHEELS=.gpu/acc-wheels \
#     [PRESS_PARTS="snapkv kvzip*8 ..."] [LIMIT=SECONDS] \
#     bash benchmarks/kvpress_gpu.sh --tasks-file TASKS.jsonl [kvpress_accuracy.py args]
# PRESS_PARTS runs each named press (kvpress_accuracy.py's --presses; NAME*N: as N processes, a
# shard of the samples each) as its own process beside the others on the one GPU, each with full
# KV (whose answers the merge checks equal), stopped at LIMIT seconds with the samples each
# finished, and merges them (kvpress_accuracy.py --merge) into accuracy_kvpress.json; without it
# one process runs every press in turn.
# Make the tarball here with:
#   (cd .cache/kvpress-venv/lib/python3.*/site-packages && tar czf PKGS --exclude=__pycache__ \
#     kvpress transformers datasets dill multiprocess _multiprocess cachetools fire termcolor tokenizers \
#     {kvpress,transformers,datasets,dill,multiprocess,cachetools,fire,termcolor,tokenizers}-*.dist-info)
# (the dist-info folders: transformers checks its pins by the installed versions' metadata)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PKGS=${PKGS:-.gpu/kvp/kvpress-pkgs.tar.gz}
SITE=/tmp/kvpress-site; mkdir -p "$SITE"
tar xzf "$PKGS" -C "$SITE" || exit 1
source benchmarks/gpu_model.sh || exit 1
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 benchmarks/kvpress_hf_folder.py /tmp/smollm2.gguf /tmp/smollm2-hf 2>&1 | grep -v Warn || exit 1
if [ -z "${PRESS_PARTS:-}" ]; then
  python3 benchmarks/kvpress_accuracy.py --model-dir /tmp/smollm2-hf --device cuda \
    --out "$OUT/accuracy_kvpress.json" "$@" 2>&1 | tee "$OUT/kvpress.log" | grep -v -i warn
  exit
fi
LIMIT=${LIMIT:-560}
parts=()
for entry in $PRESS_PARTS; do
  press=${entry%%\**}; shards=1
  [ "$press" != "$entry" ] && shards=${entry#*\*}
  for ((k = 0; k < shards; k++)); do
    part="$OUT/kvpress_${press//+/_}_$k.json"   # file names of letters, digits, _ . - travel back
    parts+=("$part")
    timeout $((LIMIT - SECONDS - 15)) python3 benchmarks/kvpress_accuracy.py \
      --model-dir /tmp/smollm2-hf --device cuda --presses "$press" --shard "$k/$shards" \
      --out "$part" "$@" > "${part%.json}.log" 2>&1 &
  done
done
wait
python3 benchmarks/kvpress_accuracy.py --merge "${parts[@]}" --out "$OUT/accuracy_kvpress.json"
