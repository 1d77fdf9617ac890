"""The Flax NNX decoder for the GQA families (Llama-3.x, Mistral, Qwen2/2.5, Qwen3).

One module, configured by `ModelConfig`. Each layer is exposed in two halves so that engines with
their own KV storage (the paged engine, calibration) can run attention themselves:

    q, k, v = layer.qkv(h, positions)      # input norm, projections, (bias), (qk-norm), RoPE
    attn    = <any attention over k, v>    # [B, T, num_heads, head_dim]
    h       = layer.finish(h, attn)        # o_proj, residual, post-attention norm, SwiGLU, residual

`Decoder.__call__` is the dense reference path: the same halves around `dense_attention` over a
contiguous `DenseKVCache`.

GQA convention: query head i reads KV head i // q_per_kv, i.e. the q_per_kv query heads of KV head
j are the contiguous block j * q_per_kv ... (j + 1) * q_per_kv - 1.

Weights are stored as `x @ W` kernels, `[in_features, out_features]` (the transpose of HF's
`nn.Linear.weight`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.rope import apply_rope, inverse_frequencies, rope_cos_sin

_MASKED = -1e30  # finite "minus infinity": a fully masked row gives a uniform softmax, not NaN


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


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Plain grouped-query attention, softmax in float32.

    q: `[B, T, num_heads, head_dim]`; k, v: `[B, S, num_kv_heads, head_dim]`;
    mask: `[B, T, S]` bool, True where query t may attend key s. Returns `[B, T, num_heads, head_dim]`
    in v's dtype.
    """
    batch, t_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q_per_kv = num_heads // num_kv_heads
    q = q.reshape(batch, t_len, num_kv_heads, q_per_kv, head_dim)
    scores = jnp.einsum("btgqd,bsgd->bgqts", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * (head_dim**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgqts,bsgd->btgqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, t_len, num_heads, head_dim).astype(v.dtype)


class RMSNorm(nnx.Module):
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale (in that order)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


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


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, inv_freq: np.ndarray, dtype, rngs: nnx.Rngs):
        d, dh = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dh
        self.inv_freq = tuple(float(f) for f in inv_freq)  # a compile-time constant, not state
        self.input_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.q_proj = Linear(d, config.num_heads * dh, config.attention_bias, dtype, rngs)
        self.k_proj = Linear(d, config.num_kv_heads * dh, config.attention_bias, dtype, rngs)
        self.v_proj = Linear(d, config.num_kv_heads * dh, config.attention_bias, dtype, rngs)
        self.o_proj = Linear(config.num_heads * dh, d, config.o_proj_bias, dtype, rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(dh, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(dh, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.post_attention_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.gate_proj = Linear(d, config.intermediate_size, False, dtype, rngs)
        self.up_proj = Linear(d, config.intermediate_size, False, dtype, rngs)
        self.down_proj = Linear(config.intermediate_size, d, False, dtype, rngs)

    def qkv(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """h `[B, T, D]`, positions `[B, T]` int32 -> q `[B, T, Hq, Dh]`, k and v `[B, T, Hkv, Dh]`."""
        batch, t_len, _ = h.shape
        x = self.input_norm(h)
        q = self.q_proj(x).reshape(batch, t_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, t_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, t_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(jnp.asarray(self.inv_freq, jnp.float32), positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, h: jax.Array, attn: jax.Array) -> jax.Array:
        """h `[B, T, D]` (the layer's input), attn `[B, T, Hq, Dh]` -> the layer's output `[B, T, D]`."""
        batch, t_len, _ = h.shape
        h = h + self.o_proj(attn.reshape(batch, t_len, self.num_heads * self.head_dim).astype(h.dtype))
        x = self.post_attention_norm(h)
        return h + self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        if self.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"Decoder dtype must be float32 or bfloat16, got {self.dtype}")
        inv_freq = inverse_frequencies(config)
        self.embed_tokens = nnx.Param(
            (jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size)) * 0.02).astype(dtype)
        )
        self.layers = nnx.List([DecoderLayer(config, inv_freq, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied models read the embedding matrix; no separate head exists then.
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype, rngs
        )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens `[B, T]` int32 -> h `[B, T, D]`."""
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def logits(self, h: jax.Array) -> jax.Array:
        """h `[B, T, D]` -> float32 logits `[B, T, V]` (final norm, then the head)."""
        x = self.norm(h)
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return jnp.dot(x, head, preferred_element_type=jnp.float32).astype(jnp.float32)

    def hidden(self, tokens: jax.Array, positions: jax.Array, cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
        """The dense path up to the last hidden state `[B, T, D]` (before the final norm).

        Row b's tokens go into cache slots lengths[b] ... lengths[b] + T - 1. A token with a negative
        position is padding: it must come after the row's real tokens, is not counted in the new
        length, and its slot is overwritten by the row's next real token. Causality is by slot:
        query slot i sees key slots <= i (and, for Mistral, > i - sliding_window). Writes past
        max_len are dropped, so callers must size the cache for prompt + generated tokens.
        """
        batch, t_len = tokens.shape
        valid = positions >= 0
        slots = cache.lengths[:, None] + jnp.arange(t_len, dtype=jnp.int32)[None, :]  # [B, T]
        key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        mask = key_slots[None, None, :] <= slots[:, :, None]  # [B, T, S]
        window = self.config.sliding_window
        if window is not None:
            mask &= key_slots[None, None, :] > slots[:, :, None] - window
        rope_positions = jnp.maximum(positions, 0)
        batch_index = jnp.arange(batch)[:, None]

        h = self.embed(tokens)
        cache_k, cache_v = cache.k, cache.v
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, rope_positions)
            cache_k = cache_k.at[i, batch_index, slots].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[i, batch_index, slots].set(v.astype(cache_v.dtype), mode="drop")
            h = layer.finish(h, dense_attention(q, cache_k[i], cache_v[i], mask))
        lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        return h, DenseKVCache(cache_k, cache_v, lengths)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
        """tokens, positions `[B, T]` -> (logits `[B, T, V]` float32, updated cache); see `hidden`."""
        h, cache = self.hidden(tokens, positions, cache)
        return self.logits(h), cache
