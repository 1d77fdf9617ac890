"""Scores and keep counts of one prefill chunk, as the serving engine compresses it.

The engine compresses a turn chunk by chunk as it is written (`tangram_jax.kv_layout`): every
chunk's tokens are scored, and each head keeps its group's count of them. These functions do that
for ONE sequence's (padded) chunk, so a runner can call them per row whatever its batching:

- `chunk_scores`: the scores of a chunk's tokens, by the method the budget profile was calibrated
  with, with the chunk's protected tokens (the end of the turn, `KVLayout.chunk_protected`)
  lifted above every other score so any count >= their number keeps them;
- `dynamic_keep_count`: the per-input (Ada-SnapKV) count of ``dynamic`` mode on monolithic pages,
  the protected tokens kept on top of it.

Shapes: a chunk is padded to the static T; ``chunk_len`` valid tokens (traced scalar), the last
``num_protected`` of them protected (traced scalar).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tangram_jax.compression.scorers import snapkv_from_probs
from tangram_jax.compression.selection import dynamic_select

# Above every scorer's score (SnapKV's are at most the window length); protected tokens get it.
PROTECTED_SCORE = 1e9


def snapkv_chunk_scores(obs_probs: jax.Array, chunk_len: jax.Array, q_per_kv: int) -> jax.Array:
    """SnapKV scores [num_kv_heads, T] of a padded chunk from its observation window's attention.

    obs_probs: float32 [num_q_heads, W, T], rows = queries chunk_len - W .. chunk_len - 1 (what
    the prefill attention returns). Every valid token competes on its pooled attention; the
    window's own tokens are not lifted (a turn's end is protected by the tail rule instead, and a
    chunk in the middle of a turn has no reason to keep its own last tokens).
    `snapkv_from_probs` pools over keys, so valid keys are rotated to the end first (padding keys
    have probability 0) and the scores rotated back.
    """
    t = obs_probs.shape[-1]
    shift = t - chunk_len
    scores = snapkv_from_probs(jnp.roll(obs_probs, shift, axis=-1), q_per_kv,
                               protect_window=False)
    return jnp.roll(scores, -shift, axis=-1)


def protect_tail(scores: jax.Array, chunk_len: jax.Array, num_protected: jax.Array) -> jax.Array:
    """scores [heads, T] with the chunk's last `num_protected` valid tokens at PROTECTED_SCORE."""
    position = jnp.arange(scores.shape[-1])[None, :]
    tail = (position >= chunk_len - num_protected) & (position < chunk_len)
    return jnp.where(tail, jnp.float32(PROTECTED_SCORE), scores.astype(jnp.float32))


def chunk_scores(obs_probs: jax.Array, chunk_len: jax.Array, num_protected: jax.Array, *,
                 q_per_kv: int) -> jax.Array:
    """Scores [num_kv_heads, T] that the chunk compression ranks by (higher = kept first):
    SnapKV on the chunk's observation window, the protected tail above everything."""
    return protect_tail(snapkv_chunk_scores(obs_probs, chunk_len, q_per_kv), chunk_len,
                        num_protected)


def dynamic_keep_count(scores: jax.Array, chunk_len: jax.Array, num_protected: jax.Array,
                       ratio: float, safeguard: float) -> jax.Array:
    """Tokens a monolithic layer keeps from a padded chunk in ``dynamic`` mode: the per-input
    Ada-SnapKV selection (`dynamic_select`) over the unprotected tokens (the chunk's first
    ``chunk_len - num_protected``), the largest head's count for every head (monolithic pages),
    at least one token of a non-empty unprotected part, plus every protected token.

    scores: [num_kv_heads, T] (positions >= chunk_len are padding). Returns an int32 scalar.
    """
    free = chunk_len - num_protected
    counts = dynamic_select(scores, ratio, safeguard=safeguard, num_valid=free).counts
    return (jnp.maximum(jnp.max(counts), jnp.minimum(free, 1)) + num_protected).astype(jnp.int32)
