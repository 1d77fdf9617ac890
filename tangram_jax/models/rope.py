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
    """`[head_dim // 2]` float32 angular frequencies of the global layers, with their scaling
    (Llama-3, linear or YaRN) applied when configured."""
    return rope_frequencies(config.rope_theta, config.rope_scaling, config.head_dim)[0]


def layer_rope(config: ModelConfig, layer: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies `[head_dim // 2]` float32, attention factor) of layer `layer`: a
    local layer of a model with its own local RoPE base (Gemma-3) takes that base, unscaled."""
    if config.local_rope_theta is not None and config.layer_windows[layer]:
        return rope_frequencies(config.local_rope_theta, None, config.head_dim)
    return rope_frequencies(config.rope_theta, config.rope_scaling, config.head_dim)


def rope_frequencies(theta: float, scaling: dict | None, dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies `[dim // 2]` float32, attention factor): the factor multiplies cos
    and sin (YaRN's attention scaling; 1 otherwise). As transformers' rope init functions."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).astype(np.float32), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, theta, scaling, dim)
    # Only "llama3" gets here: ModelConfig rejects every other type.
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
    return np.where(is_medium, smoothed, scaled).astype(np.float32), 1.0


def _yarn(inv_freq: np.ndarray, theta: float, scaling: dict, dim: int) -> tuple[np.ndarray, float]:
    """YaRN (transformers' _compute_yarn_parameters): frequencies whose wavelength fits the
    original context many times are kept, those that do not are divided by `factor`, with a
    linear ramp between; cos and sin are scaled by the attention factor."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(inv_freq: jnp.ndarray, positions: jnp.ndarray,
                 attention_factor=1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin `[B, T, head_dim]` float32 for integer positions `[B, T]` (times the attention
    factor: YaRN's, 1 otherwise)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x [B, T, heads, head_dim]` by cos/sin `[B, T, head_dim]`; computed in x's dtype like HF."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
