"""A Hugging Face folder of the embedded SmolLM2 made from the GGUF the engine serves, for kvpress.

transformers reads the GGUF (dequantised to float32) but refuses to save a GGUF-loaded model, so
its state_dict is copied into a fresh LlamaForCausalLM and that is saved, with the tokenizer.
Used by `kvpress_setup.sh` (CPU) and `kvpress_gpu.sh` (the device machine):

    python benchmarks/kvpress_hf_folder.py MODEL.gguf OUT_DIR
"""

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf, out = Path(argv[0]), Path(argv[1])
    if not gguf.is_file():
        print(f"error: GGUF {gguf} does not exist", file=sys.stderr)
        return 2
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  torch_dtype=torch.float32)
    fresh = LlamaForCausalLM(loaded.config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a conversion bug.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise SystemExit(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
