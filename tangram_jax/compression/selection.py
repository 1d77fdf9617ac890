"""Which tokens each KV head keeps, given scores: the dynamic (per-input) and uniform selections.

- `dynamic_select`: Ada-SnapKV's rule. One top-k over all heads of a layer for ``ratio * H * T``
  tokens, after guaranteeing every head its own top ``floor(safeguard * ratio * T)`` tokens, so
  the heads that attend sharply give their budget to the ones that attend broadly. A head's
  implicit retention ratio is ``count / T``; calibration records it.
- `cross_layer_select`: the same over all layers and heads at once ``[layers, heads, T]``.
- `uniform_select`: every head keeps its own top ``ceil(ratio * T)`` (the uniform baseline).

All are jittable (`ratio` and `safeguard` may be traced) and tie-break by index, so the counts
always sum exactly to the budget; equal scores go to the lower token index, round-robin over heads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_EPS = 1e-6  # as kv_layout: r * n landing a hair above an integer must not round up


class Selection(NamedTuple):
    """keep: bool [..., heads, T]; counts: int32 [..., heads] (= keep.sum(-1))."""

    keep: jax.Array
    counts: jax.Array


def _rank_desc(scores: jax.Array) -> jax.Array:
    """Rank of every entry along the last axis, 0 = highest score; ties go to the lower index."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def _select_with_floor(scores: jax.Array, ratio, safeguard, num_valid=None) -> Selection:
    """scores [N, T]: keep ceil(ratio * N * V) entries overall, >= floor(safeguard*ratio*V) per
    row, among the first V = `num_valid` (default T; may be traced) positions of every row."""
    n, t = scores.shape
    valid_len = jnp.asarray(t if num_valid is None else num_valid, jnp.int32)
    v = valid_len.astype(jnp.float32)
    valid = jnp.arange(t) < valid_len
    ratio = jnp.asarray(ratio, jnp.float32)
    total = jnp.minimum(jnp.ceil(ratio * n * v - _EPS), n * valid_len).astype(jnp.int32)
    floor = jnp.floor(jnp.asarray(safeguard, jnp.float32) * ratio * v + _EPS).astype(jnp.int32)
    floor = jnp.minimum(floor, total // n)
    scores = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    guaranteed = (_rank_desc(scores) < floor) & valid
    # Guaranteed tokens rank above everything else in the global top-k; the rest compete by score.
    # Flattened token-major so that equal scores are shared round-robin across heads, not all
    # given to head 0 (heads with identical scores, e.g. StreamingLLM's, get equal counts).
    lifted = jnp.where(guaranteed, jnp.inf, scores).T.reshape(-1)
    keep = (_rank_desc(lifted) < total).reshape(t, n).T & valid
    return Selection(keep, keep.sum(axis=-1, dtype=jnp.int32))


def _check(scores, ndim, what, ratio, safeguard):
    if scores.ndim != ndim:
        raise ValueError(f"{what} expects scores of rank {ndim}, got shape {scores.shape}")
    for name, value in (("ratio", ratio), ("safeguard", safeguard)):
        if isinstance(value, (int, float)) and not 0 <= value <= 1:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")


def dynamic_select(scores: jax.Array, ratio, *, safeguard=0.2, num_valid=None) -> Selection:
    """Ada-SnapKV selection over one layer: scores [num_kv_heads, T] -> Selection.

    num_valid: only the first `num_valid` tokens exist (a padded prefill chunk); may be traced.
    """
    _check(scores, 2, "dynamic_select", ratio, safeguard)
    return _select_with_floor(scores, ratio, safeguard, num_valid)


def cross_layer_select(scores: jax.Array, ratio, *, safeguard=0.2) -> Selection:
    """One top-k over every layer and head: scores [layers, num_kv_heads, T] -> Selection.

    The per-head safeguard is still ``floor(safeguard * ratio * T)``.
    """
    _check(scores, 3, "cross_layer_select", ratio, safeguard)
    layers, heads, t = scores.shape
    sel = _select_with_floor(scores.reshape(layers * heads, t), ratio, safeguard)
    return Selection(sel.keep.reshape(layers, heads, t), sel.counts.reshape(layers, heads))


def uniform_select(scores: jax.Array, ratio) -> Selection:
    """Per-head top-k of ceil(ratio * T): scores [..., num_kv_heads, T] -> Selection."""
    _check(scores, scores.ndim, "uniform_select", ratio, 0.0)
    t = scores.shape[-1]
    count = jnp.minimum(jnp.ceil(jnp.asarray(ratio, jnp.float32) * t - _EPS), t).astype(jnp.int32)
    keep = _rank_desc(scores.astype(jnp.float32)) < count
    return Selection(keep, keep.sum(axis=-1, dtype=jnp.int32))


def implicit_retention(counts: jax.Array, num_tokens: int) -> jax.Array:
    """A head's implicit retention ratio under a selection: count / T."""
    return counts.astype(jnp.float32) / num_tokens
