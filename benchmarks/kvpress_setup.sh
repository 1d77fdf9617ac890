#!/usr/bin/env bash
# Sets up kvpress's own environment for benchmarks/kvpress_accuracy.py. Outside this package's
# environment (kvpress pins transformers/torch versions that clash with ours):
#   1. a virtual environment with kvpress and the CPU torch (PEERS.md: torch==2.13.0);
#   2. a Hugging Face folder of the embedded SmolLM2-135M-Instruct made from the same GGUF the
#      engine loads (transformers reads the GGUF but refuses to save a GGUF-loaded model, so its
#      state_dict is copied into a fresh LlamaForCausalLM and that is saved, float32).
# Both go under the git-ignored .cache/ of the checkout unless KVPRESS_VENV / KVPRESS_MODEL_DIR
# say otherwise.
#
#   bash benchmarks/kvpress_setup.sh && .cache/kvpress-venv/bin/python benchmarks/kvpress_accuracy.py
set -euo pipefail
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
cd "$(dirname "$0")/.."
VENV="${KVPRESS_VENV:-.cache/kvpress-venv}"
MODEL_DIR="${KVPRESS_MODEL_DIR:-.cache/smollm2-135m-hf}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import kvpress, gguf" 2>/dev/null; then
  "$VENV/bin/pip" install -q "kvpress==0.5.5" "torch==2.13.0" "gguf>=0.10"
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  GGUF="${SMOLLM2_GGUF:-$(python3 -c "from tangram_jax.models.registry import default_model_path; print(default_model_path())")}"
  "$VENV/bin/python" benchmarks/kvpress_hf_folder.py "$GGUF" "$MODEL_DIR"
fi
echo "kvpress venv: $VENV; model folder: $MODEL_DIR"
