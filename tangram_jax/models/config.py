"""One configuration object for every supported decoder family.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` in both the transformers 4.x layout
(`rope_theta` and `rope_scaling` at the top level) and the 5.x layout (`rope_parameters`, per
layer type for Gemma-3). Anything the decoder does not implement (other RoPE types, MLP bias,
activations other than SiLU / tanh-GELU, attention logit softcapping) is rejected here with a
message naming it, rather than being silently computed differently from the reference
implementation.

Layer kinds. Every family is a stack of pre-norm attention + MLP layers; what varies per layer
is its attention kind: ``"full_attention"`` (global, causal over every earlier token) or
``"sliding_attention"`` (local: a query at position t sees keys at positions > t - window).
Gemma-3 interleaves 5 local layers to 1 global, GPT-OSS alternates them, Mistral is all local.
A local layer's RoPE may have its own base (Gemma-3's `rope_local_base_freq`, no scaling).
`layer_windows` gives each layer's window (0 = global), the one fact attention needs.

How the KV cache and a budget profile treat the two kinds (`tangram_jax.kv_layout`): a local
layer keeps every token of its window uncompressed (budget 1: the window is already the
retention rule, and its mask is by slot, which equals the position only when nothing was
dropped), so calibration, budgets and the split map's load balance are about the global layers;
pages of a local layer that fall behind its window are never read again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "gpt_oss")

# HF `architectures` class names -> our family names.
_HF_CLASS_TO_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# HF `model_type` values that are not our family names.
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
LAYER_KINDS = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# How a mixture-of-experts layer picks its experts (`MoEConfig.routing`).
ROUTINGS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (every layer of the model has one).

    routing: ``"softmax_topk"`` (Qwen3-MoE: softmax over all experts' logits, then the top k,
    renormalised to sum 1 when `norm_topk_prob`) or ``"topk_softmax"`` (GPT-OSS: the top k
    logits, then a softmax over those k). router_bias / expert_bias: biases on the router and
    on the experts' projections (GPT-OSS). activation: ``"silu"`` (SwiGLU, silu(gate) * up) or
    ``"clamped_swiglu"`` (GPT-OSS: gate clamped above at `limit`, up to [-limit, limit],
    ``(up + 1) * gate * sigmoid(alpha * gate)``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= num_experts "
                             f"({self.num_experts})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {EXPERT_ACTIVATIONS}, got "
                             f"{self.activation!r}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": "llama3" | "linear" | "yarn", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when set)
    qk_norm: bool  # Qwen3, Gemma-3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Bias on o_proj: HF Llama/Qwen3 put it there when `attention_bias` is set; Qwen2 never does.
    o_proj_bias: bool = False
    # The attention window of local layers, in tokens; None = every layer is global.
    sliding_window: int | None = None
    # Per-layer kind (`LAYER_KINDS`); None: every layer local if `sliding_window` is set
    # (Mistral), else every layer global.
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the local layers (Gemma-3's `rope_local_base_freq`; they take no scaling);
    # None: the global layers' RoPE everywhere.
    local_rope_theta: float | None = None
    hidden_act: str = "silu"  # the MLP's gate activation (`ACTIVATIONS`)
    # Gemma-3's RMSNorm: scale by (1 + w), computed in float32 before the cast back.
    norm_unit_offset: bool = False
    # Gemma-3's extra norms on the attention and MLP outputs, before each residual add.
    sandwich_norms: bool = False
    # Gemma-3: embeddings times sqrt(hidden_size), that factor rounded to the model's dtype.
    scale_embeddings: bool = False
    # Attention logits are q.k / sqrt(query_pre_attn_scalar) (Gemma-3); None: / sqrt(head_dim).
    query_pre_attn_scalar: float | None = None
    # Final logits are cap * tanh(logits / cap) (Gemma-3 when configured); None: none.
    final_logit_softcapping: float | None = None
    # GPT-OSS: a learned logit per query head in every softmax's denominator (a "sink" key
    # whose value is zero).
    attention_sinks: bool = False
    moe: MoEConfig | None = None  # every layer's MLP is a mixture of experts

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
        if self.layer_types is not None:
            kinds = tuple(str(k) for k in self.layer_types)
            if len(kinds) != self.num_layers or any(k not in LAYER_KINDS for k in kinds):
                raise ValueError(f"layer_types must give one of {LAYER_KINDS} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_types)}")
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window "
                                 "is None")
            object.__setattr__(self, "layer_types", kinds)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        for name in ("local_rope_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        # A frozen dataclass holding a dict is not hashable; store the eos ids as a tuple of ints.
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    def __hash__(self):
        items = dataclasses.astuple(self)
        return hash(tuple(tuple(sorted(x.items())) if isinstance(x, dict) else x for x in items))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (`LAYER_KINDS`)."""
        if self.layer_types is not None:
            return self.layer_types
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_layers

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens (a query at t sees keys > t - window);
        0 for a global layer."""
        return tuple(int(self.sliding_window) if kind == "sliding_attention" else 0
                     for kind in self.layer_kinds)

    @property
    def local_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window (local) layers."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w)

    @property
    def attention_scale(self) -> float:
        """The factor on q.k of the softmax's logits."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        num_layers = int(need("num_hidden_layers"))

        default_act = "gelu_pytorch_tanh" if architecture == "gemma3" else "silu"
        act = d.get("hidden_activation") or d.get("hidden_act") or default_act
        if architecture == "gpt_oss":
            act = "silu"   # unused: its experts' activation is the clamped SwiGLU
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (no supported family uses MLP biases)")
        if d.get("attn_logit_softcapping") is not None:
            raise ValueError(f"attn_logit_softcapping={d['attn_logit_softcapping']} is not "
                             f"supported (Gemma-2's attention softcapping; Gemma-3 has none)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported (a causal "
                             "decoder only)")

        rope_theta, rope_scaling, local_theta = _rope_of(d, architecture)

        if architecture == "qwen2":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = bool(d.get("attention_bias", architecture == "gpt_oss"))
            o_proj_bias = attention_bias

        sliding_window, layer_types = _layer_kinds_of(d, architecture, num_layers)

        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(t) for t in eos)
        else:
            eos_ids = (int(eos),)

        gemma = architecture == "gemma3"
        return cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3"),
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_types=layer_types,
            local_rope_theta=local_theta,
            hidden_act=act,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=(float(d.get("query_pre_attn_scalar") or 256) if gemma
                                   else None),
            final_logit_softcapping=(float(d["final_logit_softcapping"])
                                     if gemma and d.get("final_logit_softcapping") else None),
            attention_sinks=architecture == "gpt_oss",
            moe=_moe_of(d, architecture, num_layers),
        )


def _architecture_of(d: dict) -> str:
    names = []
    model_type = d.get("model_type")
    if model_type is not None:
        model_type = _HF_MODEL_TYPES.get(model_type, model_type)
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


def _layer_kinds_of(d: dict, architecture: str, num_layers: int):
    """(sliding_window, layer_types or None) of a config.json."""
    window = d.get("sliding_window")
    if architecture == "mistral":
        return window, None
    if architecture in ("gemma3", "gpt_oss"):
        kinds = d.get("layer_types")
        if kinds is None:
            # Older configs give the period instead: every `pattern`-th layer is global
            # (Gemma-3: 6; GPT-OSS alternates, sliding first).
            default = 6 if architecture == "gemma3" else 2
            pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                          or default)
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)]
        if window is None or "sliding_attention" not in kinds:
            return None, None
        return window, tuple(kinds)
    if d.get("use_sliding_window"):
        raise ValueError(
            f"{architecture} with use_sliding_window=True (per-layer sliding windows) is not supported"
        )
    return None, None


def _moe_of(d: dict, architecture: str, num_layers: int) -> MoEConfig | None:
    if architecture == "qwen3_moe":
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or ())
        sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        if len(sparse) != num_layers:
            raise ValueError(f"qwen3_moe with dense MLP layers (mlp_only_layers={sorted(dense)}, "
                             f"decoder_sparse_step={step}) is not supported: every layer must "
                             f"be a mixture of experts")
        return MoEConfig(num_experts=int(d.get("num_experts") or d.get("num_local_experts")),
                         top_k=int(d["num_experts_per_tok"]),
                         intermediate_size=int(d["moe_intermediate_size"]),
                         routing="softmax_topk", norm_topk_prob=bool(d.get("norm_topk_prob")))
    if architecture == "gpt_oss":
        return MoEConfig(num_experts=int(d.get("num_local_experts") or d.get("num_experts")),
                         top_k=int(d["num_experts_per_tok"]),
                         intermediate_size=int(d["intermediate_size"]),
                         routing="topk_softmax", router_bias=True, expert_bias=True,
                         activation="clamped_swiglu",
                         swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(d.get("swiglu_limit", 7.0)))
    return None


def _rope_of(d: dict, architecture: str) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling, local layers' rope_theta or None) from either config layout;
    rope_scaling None means plain RoPE."""
    params: dict[str, Any] = dict(d.get("rope_scaling") or {})
    given = d.get("rope_parameters") or {}
    local_theta = None
    if architecture == "gemma3":
        if "full_attention" in given or "sliding_attention" in given:
            # transformers 5.x: one RoPE per layer kind.
            params.update(given.get("full_attention") or {})
            local = given.get("sliding_attention") or {}
            local_type = local.get("rope_type", local.get("type", "default"))
            if local_type != "default":
                raise ValueError(f"gemma3 local layers with RoPE type {local_type!r} are not "
                                 f"supported (default only)")
            local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        else:
            params.update(given)
            local_theta = float(d.get("rope_local_base_freq", 10000.0))
        default_theta = 1_000_000.0
    else:
        params.update(given)
        default_theta = 150000.0 if architecture == "gpt_oss" else 10000.0
    theta = params.pop("rope_theta", d.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None, local_theta
    scaling = {k: v for k, v in params.items() if k != "type"}
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return float(theta), scaling, local_theta


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
    if rope_type in ("linear", "yarn"):
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"{rope_type} rope_scaling needs a positive 'factor', got {factor!r}")
    if rope_type == "yarn":
        value = scaling.get("original_max_position_embeddings")
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"yarn rope_scaling needs a positive "
                             f"'original_max_position_embeddings', got {value!r}")
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = scaling.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"llama3 rope_scaling needs a positive {key!r}, got {value!r}")
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
