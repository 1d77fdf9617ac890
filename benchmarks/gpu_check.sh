#!/usr/bin/env bash
# Kernel checks at real shapes on the GPU, then the decode benchmark (one device call).
#   GIT_REV=<sha> bash benchmarks/gpu_check.sh [tests|bench|all] [extra benchmark args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
if [[ $what == tests || $what == all ]]; then
  TANGRAM_KERNEL_SCALE=gpu timeout 300 python3 -m pytest -q -p no:cacheprovider -x \
    tests/kernels/test_split_map.py tests/kernels/test_decode.py tests/kernels/test_compress.py \
    tests/kernels/test_prefill.py tests/kernels/test_large_pool.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/decode_attention.py --out "$OUT/decode_attention.json" "$@" 2>&1 \
    | tee "$OUT/bench.log" | grep -v Warning
fi
