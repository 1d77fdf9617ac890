"""Rotary position embedding in the rotate-half layout used by Hugging Face checkpoints.

The head dimension is split in halves (x1, x2); frequency i rotates the pair (x1[i], x2[i]).
GGUF llama checkpoints store Q/K rows for the interleaved layout; the GGUF loader un-permutes them
so this single layout serves every source.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from tangram_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """`[head_dim // 2]` float32 angular frequencies, with Llama-3 scaling applied when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    # Only "llama3" gets here: ModelConfig rejects every other type.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the band in
    # between interpolated smoothly (Llama 3.1's recipe, as in transformers' _compute_llama3_parameters).
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(inv_freq: jnp.ndarray, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin `[B, T, head_dim]` float32 for integer positions `[B, T]`."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x [B, T, heads, head_dim]` by cos/sin `[B, T, head_dim]`; computed in x's dtype like HF."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
