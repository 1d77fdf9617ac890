"""The Flax NNX decoder of every supported family (Llama-3.x, Mistral, Qwen2/2.5, Qwen3,
Gemma-3, Qwen3-MoE, GPT-OSS).

One module, configured by `ModelConfig`. Each layer is exposed in two halves so that engines with
their own KV storage (the paged engine, calibration) can run attention themselves:

    q, k, v = layer.qkv(h, positions)      # input norm, projections, (bias), (qk-norm), RoPE
    attn    = <any attention over k, v>    # [B, T, num_heads, head_dim]
    h       = layer.finish(h, attn)        # o_proj, residual, norms, MLP (dense or experts)

What the attention between them must honour is the layer's `attention_window()` (a local layer:
a query at slot t sees key slots > t - window; 0 = global) and `attention_sinks()` (GPT-OSS: a
learned logit per query head in the softmax's denominator, or None). The softmax's scale is
1/sqrt(head_dim) for every family: a model with another scale (Gemma-3's
query_pre_attn_scalar) has q scaled to match in `qkv`, so no attention code needs to know.

Layers of different kinds share one structure (one graphdef): what differs between a local and a
global layer (RoPE table and factor, window) is per-layer state (`LayerConstant`), not a static
attribute, so the engine's loops over layers and calibration compile one layer body for all.

`Decoder.__call__` is the dense reference path: the same halves around `dense_attention` over a
contiguous `DenseKVCache`.

GQA convention: query head i reads KV head i // q_per_kv, i.e. the q_per_kv query heads of KV head
j are the contiguous block j * q_per_kv ... (j + 1) * q_per_kv - 1.

Weights are stored as `x @ W` kernels, `[in_features, out_features]` (the transpose of HF's
`nn.Linear.weight`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.moe import SparseMoE
from tangram_jax.models.rope import apply_rope, layer_rope, rope_cos_sin

_MASKED = -1e30  # finite "minus infinity": a fully masked row gives a uniform softmax, not NaN


class LayerConstant(nnx.Variable):
    """A per-layer constant that is not a weight (RoPE frequencies and factor, attention window):
    layer state, so layers of different kinds keep one structure (see the module docstring)."""


class DenseKVCache(NamedTuple):
    """Contiguous per-sequence KV cache of the dense reference path.

    k, v: `[layers, batch, max_len, num_kv_heads, head_dim]`, RoPE already applied to k.
    lengths: `[batch]` int32, the number of filled slots of each sequence.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "DenseKVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def causal_mask(query_slots: jax.Array, key_slots: jax.Array, window=0) -> jax.Array:
    """query_slots `[B, T]`, key_slots `[S]` -> `[B, T, S]` bool: key slot s is visible from query
    slot t when s <= t and, for a window > 0 (an int or a traced scalar), s > t - window."""
    q = query_slots[:, :, None]
    k = key_slots[None, None, :]
    return (k <= q) & ((window <= 0) | (k > q - window))


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Plain grouped-query attention, softmax in float32.

    q: `[B, T, num_heads, head_dim]`; k, v: `[B, S, num_kv_heads, head_dim]`;
    mask: `[B, T, S]` bool, True where query t may attend key s; sinks: `[num_heads]` logits of
    a zero-valued extra key each query head sees (GPT-OSS), or None. Returns
    `[B, T, num_heads, head_dim]` in v's dtype.
    """
    batch, t_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q_per_kv = num_heads // num_kv_heads
    q = q.reshape(batch, t_len, num_kv_heads, q_per_kv, head_dim)
    scores = jnp.einsum("btgqd,bsgd->bgqts", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * (head_dim**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, q_per_kv, 1, 1),
                                (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    probs = probs.astype(v.dtype)
    out = jnp.einsum("bgqts,bsgd->btgqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, t_len, num_heads, head_dim).astype(v.dtype)


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32; then either cast back and scale by w (Llama, in that
    order), or scale in float32 and cast back (`float32_scale`: GPT-OSS; Gemma also scales by
    1 + w, `unit_offset`)."""

    def __init__(self, dim: int, eps: float, dtype, unit_offset: bool = False,
                 float32_scale: bool = False):
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_scale = float32_scale or unit_offset
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if unit_offset else jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.float32_scale:
            scale = self.weight[...].astype(jnp.float32) + (1.0 if self.unit_offset else 0.0)
            return (xf * scale).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


def _norm(config: ModelConfig, dim: int, dtype) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, dtype, unit_offset=config.norm_unit_offset,
                   float32_scale=config.architecture == "gpt_oss")


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)`, kernel `[in_features, out_features]`."""

    def __init__(self, in_features: int, out_features: int, use_bias: bool, dtype, rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(
            (jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32) * std).astype(dtype)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def activation(name: str):
    """The MLP gate's activation by its HF name (`config.ACTIVATIONS`)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, dtype, rngs: nnx.Rngs):
        d, dh = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dh
        # q is scaled so that attention's 1/sqrt(head_dim) gives the model's own scale.
        self.q_scale = config.attention_scale * math.sqrt(dh)
        self.act = config.hidden_act
        inv_freq, factor = layer_rope(config, index)
        self.rope_inv_freq = LayerConstant(jnp.asarray(inv_freq, jnp.float32))
        self.rope_factor = LayerConstant(jnp.asarray(factor, jnp.float32))
        self.window = LayerConstant(jnp.asarray(config.layer_windows[index], jnp.int32))
        self.input_norm = _norm(config, d, dtype)
        self.q_proj = Linear(d, config.num_heads * dh, config.attention_bias, dtype, rngs)
        self.k_proj = Linear(d, config.num_kv_heads * dh, config.attention_bias, dtype, rngs)
        self.v_proj = Linear(d, config.num_kv_heads * dh, config.attention_bias, dtype, rngs)
        self.o_proj = Linear(config.num_heads * dh, d, config.o_proj_bias, dtype, rngs)
        if config.qk_norm:
            self.q_norm = _norm(config, dh, dtype)
            self.k_norm = _norm(config, dh, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nnx.Param(jnp.zeros((config.num_heads,), dtype)) if config.attention_sinks \
            else None
        # The norm in front of the MLP (HF: post_attention_layernorm of Llama, GPT-OSS, Qwen;
        # pre_feedforward_layernorm of Gemma-3); Gemma-3 also norms each branch's output.
        self.post_attention_norm = _norm(config, d, dtype)
        if config.sandwich_norms:
            self.attn_output_norm = _norm(config, d, dtype)
            self.mlp_output_norm = _norm(config, d, dtype)
        else:
            self.attn_output_norm = self.mlp_output_norm = None
        if config.moe is not None:
            self.moe = SparseMoE(d, config.moe, dtype, rngs)
            self.gate_proj = self.up_proj = self.down_proj = None
        else:
            self.moe = None
            self.gate_proj = Linear(d, config.intermediate_size, False, dtype, rngs)
            self.up_proj = Linear(d, config.intermediate_size, False, dtype, rngs)
            self.down_proj = Linear(config.intermediate_size, d, False, dtype, rngs)

    def set_constants(self, config: ModelConfig, index: int) -> None:
        """(Re)fill the per-layer constants of layer `index` (a loader's abstract model has none)."""
        inv_freq, factor = layer_rope(config, index)
        self.rope_inv_freq.set_value(jnp.asarray(inv_freq, jnp.float32))
        self.rope_factor.set_value(jnp.asarray(factor, jnp.float32))
        self.window.set_value(jnp.asarray(config.layer_windows[index], jnp.int32))

    def attention_window(self) -> jax.Array:
        """int32 scalar: the layer's attention window in tokens (0: global)."""
        return self.window[...]

    def attention_sinks(self) -> jax.Array | None:
        """`[num_heads]` float32 sink logits (GPT-OSS), or None."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def qkv(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """h `[B, T, D]`, positions `[B, T]` int32 -> q `[B, T, Hq, Dh]`, k and v `[B, T, Hkv, Dh]`."""
        batch, t_len, _ = h.shape
        x = self.input_norm(h)
        q = self.q_proj(x).reshape(batch, t_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, t_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, t_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(self.rope_inv_freq[...], positions, self.rope_factor[...])
        q = apply_rope(q, cos, sin)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        return q, apply_rope(k, cos, sin), v

    def finish(self, h: jax.Array, attn: jax.Array) -> jax.Array:
        """h `[B, T, D]` (the layer's input), attn `[B, T, Hq, Dh]` -> the layer's output `[B, T, D]`."""
        batch, t_len, _ = h.shape
        out = self.o_proj(attn.reshape(batch, t_len, self.num_heads * self.head_dim).astype(h.dtype))
        if self.attn_output_norm is not None:
            out = self.attn_output_norm(out)
        h = h + out
        x = self.post_attention_norm(h)
        if self.moe is not None:
            out = self.moe(x)
        else:
            out = self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return h + out


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        if self.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"Decoder dtype must be float32 or bfloat16, got {self.dtype}")
        self.embed_tokens = nnx.Param(
            (jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size)) * 0.02).astype(dtype)
        )
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_layers)])
        self.norm = _norm(config, config.hidden_size, dtype)
        # Tied models read the embedding matrix; no separate head exists then.
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype, rngs
        )

    @classmethod
    def abstract(cls, config: ModelConfig, dtype=jnp.float32) -> "Decoder":
        """The decoder's module tree with `jax.ShapeDtypeStruct`s for weights (`nnx.eval_shape`:
        no memory, no random draws), for a loader to fill or steps to be compiled for."""
        return nnx.eval_shape(lambda: cls(config, dtype, rngs=nnx.Rngs(0)))

    def set_constants(self) -> None:
        """(Re)fill every layer's constants from the config (after `nnx.eval_shape`)."""
        for i, layer in enumerate(self.layers):
            layer.set_constants(self.config, i)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens `[B, T]` int32 -> h `[B, T, D]` (Gemma-3: times sqrt(hidden) in the model's
        dtype)."""
        h = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if self.config.scale_embeddings:
            h = h * jnp.asarray(math.sqrt(self.config.hidden_size), jnp.float32).astype(h.dtype)
        return h

    def logits(self, h: jax.Array) -> jax.Array:
        """h `[B, T, D]` -> float32 logits `[B, T, V]` (final norm, the head, the softcap if
        configured)."""
        x = self.norm(h)
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def hidden(self, tokens: jax.Array, positions: jax.Array, cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
        """The dense path up to the last hidden state `[B, T, D]` (before the final norm).

        Row b's tokens go into cache slots lengths[b] ... lengths[b] + T - 1. A token with a negative
        position is padding: it must come after the row's real tokens, is not counted in the new
        length, and its slot is overwritten by the row's next real token. Causality is by slot:
        query slot i sees key slots <= i (and, in a local layer, > i - window). Writes past
        max_len are dropped, so callers must size the cache for prompt + generated tokens.
        """
        batch, t_len = tokens.shape
        valid = positions >= 0
        slots = cache.lengths[:, None] + jnp.arange(t_len, dtype=jnp.int32)[None, :]  # [B, T]
        key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        masks = {w: causal_mask(slots, key_slots, w) for w in set(self.config.layer_windows)}
        rope_positions = jnp.maximum(positions, 0)
        batch_index = jnp.arange(batch)[:, None]

        h = self.embed(tokens)
        cache_k, cache_v = cache.k, cache.v
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, rope_positions)
            cache_k = cache_k.at[i, batch_index, slots].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[i, batch_index, slots].set(v.astype(cache_v.dtype), mode="drop")
            mask = masks[self.config.layer_windows[i]]
            h = layer.finish(h, dense_attention(q, cache_k[i], cache_v[i], mask,
                                                layer.attention_sinks()))
        lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        return h, DenseKVCache(cache_k, cache_v, lengths)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
        """tokens, positions `[B, T]` -> (logits `[B, T, V]` float32, updated cache); see `hidden`."""
        h, cache = self.hidden(tokens, positions, cache)
        return self.logits(h), cache
