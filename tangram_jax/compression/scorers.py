"""Token-importance scorers: one score per (KV head, token) for one layer.

Every scorer has the same signature and is a pure, jittable `jax.numpy` function::

    score(queries [num_q_heads, Tq, D], keys [num_kv_heads, Tk, D], values [num_kv_heads, Tk, D],
          *, q_per_kv: int, **options) -> scores [num_kv_heads, Tk] float32

The queries are the last Tq positions of the same sequence as the keys: query i sits at key
position ``Tk - Tq + i`` and attends causally (keys ``j <= Tk - Tq + i``). Keys carry RoPE already.
GQA: query head i belongs to KV head ``i // q_per_kv``; attention-based scorers average their
per-query-head scores over each KV head's query heads (kvpress and Ada-KV's GQA rule), so a KV
head keeps a token if its query heads together attend to it. Higher score = more worth keeping.
Options (window sizes, sinks) are keywords with defaults and must be static under `jax.jit`.
Every scorer also takes `num_valid` (may be traced): only the first `num_valid` positions exist,
the rest pad the sequence to a shape already compiled (Tq == Tk then).

The engine calls these on one prefill chunk's q/k/v; calibration calls them on a whole prompt.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

Scorer = Callable[..., jax.Array]

# SnapKV's and Ada-KV's defaults: a 32-query observation window, pooling kernel 7.
DEFAULT_WINDOW = 32
DEFAULT_KERNEL = 7


def _check_shapes(queries, keys, values, q_per_kv):
    if queries.ndim != 3 or keys.ndim != 3 or values.ndim != 3:
        raise ValueError("scorers take queries [num_q_heads, Tq, D], keys and values "
                         f"[num_kv_heads, Tk, D]; got ranks {queries.ndim}, {keys.ndim}, {values.ndim}")
    num_q, t_q, dim = queries.shape
    num_kv, t_k, _ = keys.shape
    if keys.shape[2] != dim or values.shape[:2] != keys.shape[:2]:
        raise ValueError(f"shape mismatch: queries {queries.shape}, keys {keys.shape}, "
                         f"values {values.shape}")
    if q_per_kv <= 0 or num_q != num_kv * q_per_kv:
        raise ValueError(f"num_q_heads ({num_q}) must equal num_kv_heads ({num_kv}) * q_per_kv "
                         f"({q_per_kv})")
    if t_q > t_k or t_q == 0:
        raise ValueError(f"need 0 < Tq <= Tk (queries are the last Tq of the keys' positions); "
                         f"got Tq={t_q}, Tk={t_k}")


def causal_attention_probs(queries: jax.Array, keys: jax.Array, q_per_kv: int,
                           q_positions=None) -> jax.Array:
    """Softmax attention of the queries over the keys, causal, float32.

    queries [num_q_heads, Tq, D] at key positions `q_positions` [Tq] (default Tk-Tq .. Tk-1;
    may be traced), keys [num_kv_heads, Tk, D] -> probs [num_q_heads, Tq, Tk] (zero on masked keys).
    """
    num_q, t_q, dim = queries.shape
    t_k = keys.shape[1]
    k = jnp.repeat(keys, q_per_kv, axis=0)  # query head i reads KV head i // q_per_kv
    logits = jnp.einsum("hqd,hkd->hqk", queries.astype(jnp.float32), k.astype(jnp.float32))
    logits = logits * (dim ** -0.5)
    q_pos = t_k - t_q + jnp.arange(t_q) if q_positions is None else q_positions
    visible = jnp.arange(t_k)[None, :] <= q_pos[:, None]
    logits = jnp.where(visible[None], logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def _check_same_positions(queries, keys) -> None:
    if queries.shape[1] != keys.shape[1]:
        raise ValueError(f"with num_valid the queries are the keys' positions (Tq == Tk); got "
                         f"Tq={queries.shape[1]}, Tk={keys.shape[1]}")


def _padded_queries(queries, keys, num_valid, count: int):
    """The last `count` of the first `num_valid` (traced) queries of a padded sequence (Tq == Tk)
    -> (queries [num_q_heads, count, D], their positions [count], real [count] bool): fewer than
    `count` valid queries leave the window's start at 0 and mark the padding queries unreal."""
    _check_same_positions(queries, keys)
    start = jnp.maximum(jnp.asarray(num_valid, jnp.int32) - count, 0)
    positions = start + jnp.arange(count)
    return (jax.lax.dynamic_slice_in_dim(queries, start, count, axis=1), positions,
            positions < num_valid)


def _mask_padding(scores: jax.Array, num_valid) -> jax.Array:
    """scores [heads, Tk] with keys at or past `num_valid` (None: none) at -inf."""
    if num_valid is None:
        return scores
    return jnp.where(jnp.arange(scores.shape[-1]) < num_valid, scores, -jnp.inf)


def _mean_over_query_heads(per_q_head: jax.Array, q_per_kv: int) -> jax.Array:
    """[num_q_heads, Tk] -> [num_kv_heads, Tk]."""
    num_q, t_k = per_q_head.shape
    return per_q_head.reshape(num_q // q_per_kv, q_per_kv, t_k).mean(axis=1)


def pool1d(x: jax.Array, kernel: int, pool: str) -> jax.Array:
    """Stride-1 'same' pooling along the last axis with zero padding of kernel // 2 on each side.

    Average pooling divides by `kernel` at the edges too (PyTorch's count_include_pad, as SnapKV).
    Max pooling over non-negative scores is unchanged by zero padding.
    """
    if kernel <= 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    pad = kernel // 2
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    t = x.shape[-1]
    windows = jnp.stack([padded[..., i:i + t] for i in range(kernel)], axis=0)
    if pool == "max":
        return windows.max(axis=0)
    if pool == "avg":
        return windows.sum(axis=0) / kernel
    raise ValueError(f"unknown pool {pool!r}; expected 'max' or 'avg'")


def snapkv_from_probs(obs_probs: jax.Array, q_per_kv: int, pool: str = "max",
                      *, kernel: int = DEFAULT_KERNEL, protect_window: bool = True,
                      window_start=None, num_valid=None) -> jax.Array:
    """SnapKV scores from the observation window's attention probabilities.

    obs_probs: [num_q_heads, w, Tk] float, the causal softmax of the last w queries over all Tk keys
    (what a prefill kernel has already computed). Returns [num_kv_heads, Tk] float32.
    window_start / num_valid (may be traced): the window's queries are positions window_start ..
    of which those before num_valid exist, keys from num_valid on are padding (score -inf);
    defaults Tk - w and Tk.

    Each key's score is the attention the window paid it (summed over the window, averaged over the
    KV head's query heads), pooled over neighbouring keys so that a kept token brings its context.
    As in SnapKV/kvpress the pooling runs over the keys before the window only, and with
    `protect_window` the window's own keys score above every other key, so any budget at least as
    large as the window keeps them.
    """
    num_q, w, t_k = obs_probs.shape
    summed = _mean_over_query_heads(obs_probs.astype(jnp.float32).sum(axis=1), q_per_kv)
    if not protect_window:
        return _mask_padding(pool1d(summed, kernel, pool), num_valid)
    start = t_k - w if window_start is None else window_start
    in_prefix = jnp.arange(t_k) < start
    pooled = pool1d(jnp.where(in_prefix, summed, 0.0), kernel, pool)
    # Scores of the prefix are at most the window's length (each query's probabilities sum to
    # 1), so one more is above all.
    real_window = w if num_valid is None else jnp.minimum(num_valid - start, w)
    protected = jnp.asarray(real_window + 1, jnp.float32)
    return _mask_padding(jnp.where(in_prefix, pooled, protected), num_valid)


def snapkv(queries, keys, values, *, q_per_kv: int, window: int = DEFAULT_WINDOW,
           kernel: int = DEFAULT_KERNEL, pool: str = "max", protect_window: bool = True,
           num_valid=None):
    """SnapKV: pooled attention of the last `window` queries (observation window).
    num_valid: only the first `num_valid` positions exist (a padded sequence, Tq == Tk; may be
    traced); the window is the last `window` of those."""
    _check_shapes(queries, keys, values, q_per_kv)
    w = min(window, queries.shape[1])
    if num_valid is None:
        probs = causal_attention_probs(queries[:, -w:], keys, q_per_kv)
        return snapkv_from_probs(probs, q_per_kv, pool, kernel=kernel,
                                 protect_window=protect_window)
    q, positions, real = _padded_queries(queries, keys, num_valid, w)
    probs = causal_attention_probs(q, keys, q_per_kv, positions) * real[None, :, None]
    return snapkv_from_probs(probs, q_per_kv, pool, kernel=kernel, protect_window=protect_window,
                             window_start=positions[0], num_valid=num_valid)


def tova(queries, keys, values, *, q_per_kv: int, num_valid=None):
    """TOVA: the last query's attention (averaged over the KV head's query heads).
    num_valid: as `snapkv`'s (the last query is the last valid one)."""
    _check_shapes(queries, keys, values, q_per_kv)
    if num_valid is None:
        probs = causal_attention_probs(queries[:, -1:], keys, q_per_kv)[:, 0]
    else:
        q, positions, _ = _padded_queries(queries, keys, num_valid, 1)
        probs = causal_attention_probs(q, keys, q_per_kv, positions)[:, 0]
    return _mask_padding(_mean_over_query_heads(probs, q_per_kv), num_valid)


def h2o(queries, keys, values, *, q_per_kv: int, num_valid=None):
    """H2O heavy hitters: attention accumulated over all queries (causal).
    num_valid: as `snapkv`'s (padding queries add nothing)."""
    _check_shapes(queries, keys, values, q_per_kv)
    probs = causal_attention_probs(queries, keys, q_per_kv)
    if num_valid is not None:
        _check_same_positions(queries, keys)
        probs = probs * (jnp.arange(queries.shape[1]) < num_valid)[None, :, None]
    return _mask_padding(_mean_over_query_heads(probs.sum(axis=1), q_per_kv), num_valid)


def keydiff(queries, keys, values, *, q_per_kv: int, num_valid=None):
    """KeyDiff: keys least aligned with the head's mean key direction are the distinctive ones.

    score = -cos(k_j, a) with anchor a = mean_j(k_j / |k_j|) (kvpress KeyDiffPress). Query-free.
    num_valid: only the first `num_valid` keys exist (a padded chunk; may be traced); the anchor
    is their mean.
    """
    _check_shapes(queries, keys, values, q_per_kv)
    k = keys.astype(jnp.float32)
    unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    t_k = k.shape[1]
    valid = jnp.arange(t_k) < (t_k if num_valid is None else num_valid)
    anchor = (unit * valid[None, :, None]).sum(axis=1, keepdims=True)
    anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
    return -(unit * anchor).sum(axis=-1)


def streaming_llm(queries, keys, values, *, q_per_kv: int, n_sink: int = 4, window: int = 64,
                  first_position=0, num_valid=None):
    """StreamingLLM: attention sinks + recent window, the same for every head.

    Sinks score 2 (kept first), the last `window` keys 1 + recency, the rest recency/2 in [0, 0.5):
    a budget of sinks + window keeps exactly those, a smaller one the sinks and the most recent
    keys, a larger one extends the window backwards.
    first_position / num_valid: the keys are positions first_position .. of a longer sequence,
    of which the first `num_valid` exist (a padded prefill chunk; both may be traced): the sinks
    are the sequence's first `n_sink` positions, recency counts from the last valid key.
    """
    _check_shapes(queries, keys, values, q_per_kv)
    num_kv, t_k, _ = keys.shape
    pos = jnp.arange(t_k)
    last = t_k if num_valid is None else num_valid
    recency = pos / t_k
    score = jnp.where(first_position + pos < n_sink, 2.0,
                      jnp.where(pos >= last - window, 1.0 + recency, 0.5 * recency))
    score = score.astype(jnp.float32)
    return jnp.broadcast_to(score, (num_kv, t_k))


def average_rope_rotation(inv_freq: jax.Array, start: int | jax.Array, count: int) -> jax.Array:
    """[D, D] mean of the rotate-half RoPE matrices R(p) for p in [start, start + count).

    R(p) x = x * cos(p f) + rotate_half(x) * sin(p f), frequencies repeated over both halves.
    """
    half = inv_freq.shape[0]
    pos = start + jnp.arange(count, dtype=jnp.float32)
    angles = pos[:, None] * inv_freq[None, :].astype(jnp.float32)  # [count, D/2]
    cos = jnp.cos(angles).mean(axis=0)
    sin = jnp.sin(angles).mean(axis=0)
    cos_full = jnp.concatenate([cos, cos])
    sin_full = jnp.concatenate([sin, sin])
    eye = jnp.eye(half, dtype=jnp.float32)
    zeros = jnp.zeros((half, half), jnp.float32)
    # rotate_half(x) = [-x2, x1] = P x
    rot_half = jnp.block([[zeros, -eye], [eye, zeros]])
    return jnp.diag(cos_full) + sin_full[:, None] * rot_half


def expected_attention(queries, keys, values, *, q_per_kv: int, inv_freq=None,
                       n_future: int = 512, n_sink: int = 4, use_covariance: bool = True,
                       use_vnorm: bool = True, first_position=0, num_valid=None):
    """Expected Attention (kvpress): attention that *future* queries are expected to pay each key.

    Model: a future query of head h is Gaussian, q ~ N(mu_h, Sigma_h), with mu_h and Sigma_h the
    mean and covariance of the head's observed queries (those at positions >= n_sink). For a
    Gaussian q, E[exp(q.k / sqrt(D))] = exp(mu.k / sqrt(D) + k^T Sigma k / (2 D)), so the expected
    unnormalised weight of key k is that exponent; normalising over the keys gives

        s_h(k) = softmax_k( mu_h.k / sqrt(D) + k^T Sigma_h k / (2 D) )

    averaged over the KV head's query heads and multiplied by |v| (a key's contribution to the
    output scales with its value's norm). The first `n_sink` keys (attention sinks) are excluded
    from the softmax and given the maximum score.

    RoPE: queries arrive rotated for their own positions. With `inv_freq` ([D/2] RoPE frequencies
    of the model) they are first rotated back to position 0, the statistics are taken there, and
    mean and covariance are moved by the average rotation over the next `n_future` positions
    (kvpress's approximation: R_bar mu, R_bar Sigma R_bar^T). Without `inv_freq` the statistics of
    the rotated queries are used as they are (future queries assumed to look like recent ones).

    first_position / num_valid: the keys are positions first_position .. of a longer sequence and
    only the first `num_valid` of them (and of the queries, which are then the same positions:
    Tq == Tk) exist, as in a padded prefill chunk (both may be traced). Sinks are the sequence's
    first `n_sink` positions; padding is left out of the statistics and scores -inf.
    """
    _check_shapes(queries, keys, values, q_per_kv)
    num_q, t_q, dim = queries.shape
    num_kv, t_k, _ = keys.shape
    n_sink = min(n_sink, t_k - 1)  # keep at least one key in the softmax
    q = queries.astype(jnp.float32)
    k = keys.astype(jnp.float32)
    local = t_k - t_q + jnp.arange(t_q)
    q_pos = first_position + local
    valid_len = t_k if num_valid is None else num_valid
    key_valid = jnp.arange(t_k) < valid_len
    if inv_freq is not None:
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
        angles = q_pos[:, None].astype(jnp.float32) * inv_freq[None, :]
        cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)  # [Tq, D]
        sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
        half = dim // 2
        # R(-p) q = q cos(p f) - rotate_half(q) sin(p f)
        rotated = jnp.concatenate([-q[..., half:], q[..., :half]], axis=-1)
        q = q * cos - rotated * sin
    # Sinks are not typical queries; padding is no query at all.
    weight = ((q_pos >= n_sink) & (local < valid_len)).astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    mean = (q * weight[None, :, None]).sum(axis=1) / count  # [Hq, D]
    centered = (q - mean[:, None, :]) * weight[None, :, None]
    cov = jnp.einsum("hti,htj->hij", centered, centered) / count  # [Hq, D, D]
    if inv_freq is not None:
        r_bar = average_rope_rotation(inv_freq, first_position + valid_len, n_future)
        mean = mean @ r_bar.T
        cov = r_bar @ cov @ r_bar.T
    k_rep = jnp.repeat(k, q_per_kv, axis=0)  # [Hq, Tk, D]
    logits = jnp.einsum("hd,htd->ht", mean, k_rep) / jnp.sqrt(jnp.float32(dim))
    if use_covariance:
        logits = logits + jnp.einsum("hti,hij,htj->ht", k_rep, cov, k_rep) / (2.0 * dim)
    is_sink = (first_position + jnp.arange(t_k) < n_sink) & key_valid
    logits = jnp.where(is_sink[None] | ~key_valid[None], -jnp.inf, logits)
    # (A chunk of sinks only has no key left in the softmax: all -inf, scores then 0.)
    probs = jnp.nan_to_num(jax.nn.softmax(logits, axis=-1))
    scores = _mean_over_query_heads(probs, q_per_kv)
    if use_vnorm:
        scores = scores * jnp.linalg.norm(values.astype(jnp.float32), axis=-1)
    top = jnp.max(jnp.where(is_sink[None] | ~key_valid[None], -jnp.inf, scores))
    scores = jnp.where(is_sink[None], jnp.maximum(top, 0.0), scores)
    return jnp.where(key_valid[None], scores, -jnp.inf).astype(jnp.float32)


SCORERS: dict[str, Scorer] = {
    "snapkv": snapkv,
    "expected_attention": expected_attention,
    "keydiff": keydiff,
    "tova": tova,
    "h2o": h2o,
    "streaming_llm": streaming_llm,
}


def get_scorer(name: str, **options) -> Scorer:
    """The scorer registered as `name`, with keyword `options` bound (e.g. window=16)."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; available: {', '.join(sorted(SCORERS))}")
    fn = SCORERS[name]
    return functools.partial(fn, **options) if options else fn
