"""Tiny random Gemma-3, Qwen3-MoE and GPT-OSS checkpoints saved by transformers, for the model
and engine tests of those families.

Each is built in transformers with random weights (norms, biases, sinks and routers too, so a
mapping mistake cannot hide behind an all-ones or all-zeros tensor) and saved as safetensors with
the byte-level tokenizer of `tiny_engine` beside it, so `load_model` and the engine take the
folder as they would a Hub download. Windows are short (6 tokens) so test prompts of 20-40 tokens
reach far past them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from tiny_engine import build_tiny_model

WINDOW = 6
_COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=272, max_position_embeddings=512, head_dim=16, bos_token_id=1,
               eos_token_id=2)

# name -> (config class, model class, extra config). Together they cover: local and global
# layers interleaved (Gemma-3: 3 local around 1 global; GPT-OSS alternating), a local RoPE base,
# linear RoPE scaling on the global layers, query_pre_attn_scalar != head_dim, final logit
# softcapping, tied embeddings (Gemma-3); softmax-then-top-k routing with renormalised weights
# (Qwen3-MoE); top-k-then-softmax routing with biases, the clamped SwiGLU, attention sinks, q/k/v/o
# biases and YaRN (GPT-OSS).
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=96, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=128,
                             rope_theta=150000.0))),
}


def build_family_model(family: str, folder, seed: int = 0):
    """Random tiny transformers model of `family`, saved to `folder` with a tokenizer; returns
    the torch model (eval, float32)."""
    config_cls, model_cls, extra = FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**_COMMON, **extra)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config).eval()
    gemma = family == "gemma3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:      # Gemma scales by 1 + w: its w are around 0
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):   # Gemma's are scaled by sqrt(hidden)
                p.copy_(torch.randn_like(p) * (0.1 if gemma else 1.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = build_tiny_model(folder / "_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    shutil.rmtree(tokenizer)
    return model
