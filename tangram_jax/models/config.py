"""One configuration object for every supported GQA decoder family.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` in both the transformers 4.x layout
(`rope_theta` and `rope_scaling` at the top level) and the 5.x layout (`rope_parameters`).
Anything the decoder does not implement (other RoPE types, per-layer sliding windows, MLP bias,
activations other than SiLU) is rejected here with a message naming it, rather than being
silently computed differently from the reference implementation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# HF `architectures` class names -> our family names.
_HF_CLASS_TO_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when set)
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Bias on o_proj: HF Llama/Qwen3 put it there when `attention_bias` is set; Qwen2 never does.
    o_proj_bias: bool = False
    # Mistral's sliding attention window (every layer), in tokens; None = full causal attention.
    sliding_window: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window}")
        _validate_rope_scaling(self.rope_scaling)
        # A frozen dataclass holding a dict is not hashable; store the eos ids as a tuple of ints.
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    def __hash__(self):
        items = dataclasses.astuple(self)
        return hash(tuple(tuple(sorted(x.items())) if isinstance(x, dict) else x for x in items))

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head; query head i reads KV head i // q_per_kv."""
        return self.num_heads // self.num_kv_heads

    def fingerprint(self) -> dict:
        """The shape facts a budget profile depends on (checked when a profile is loaded)."""
        return dict(
            architecture=self.architecture,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
            vocab_size=self.vocab_size,
        )

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Maps a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        architecture = _architecture_of(d)

        def need(key):
            if key not in d or d[key] is None:
                raise ValueError(f"config.json ({architecture}) is missing required field {key!r}")
            return d[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = d.get("head_dim") or hidden_size // num_heads

        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with 'silu' only)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (no supported family uses MLP biases)")

        rope_theta, rope_scaling = _rope_of(d)

        if architecture == "qwen2":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = bool(d.get("attention_bias", False))
            o_proj_bias = attention_bias

        sliding_window = None
        if architecture == "mistral":
            sliding_window = d.get("sliding_window")
        elif d.get("use_sliding_window"):
            raise ValueError(
                f"{architecture} with use_sliding_window=True (per-layer sliding windows) is not supported"
            )

        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(t) for t in eos)
        else:
            eos_ids = (int(eos),)

        return cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture == "qwen3",
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            sliding_window=None if sliding_window is None else int(sliding_window),
        )


def _architecture_of(d: dict) -> str:
    names = []
    model_type = d.get("model_type")
    if model_type is not None:
        if model_type in SUPPORTED_ARCHITECTURES:
            return model_type
        names.append(f"model_type={model_type!r}")
    for cls_name in d.get("architectures") or ():
        if cls_name in _HF_CLASS_TO_ARCHITECTURE:
            return _HF_CLASS_TO_ARCHITECTURE[cls_name]
        names.append(f"architectures={cls_name!r}")
    found = ", ".join(names) if names else "neither model_type nor architectures given"
    raise ValueError(
        f"unknown architecture ({found}); supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"({', '.join(_HF_CLASS_TO_ARCHITECTURE)})"
    )


def _rope_of(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout; rope_scaling None means plain RoPE."""
    params: dict[str, Any] = dict(d.get("rope_scaling") or {})
    params.update(d.get("rope_parameters") or {})
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k != "type"}
    scaling["rope_type"] = rope_type
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return float(theta), scaling


def _validate_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unknown RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = scaling.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"llama3 rope_scaling needs a positive {key!r}, got {value!r}")
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
