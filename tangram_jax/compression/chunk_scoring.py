"""Scores and keep counts of one prefill chunk, as the serving engine compresses it.

The engine compresses a turn chunk by chunk as it is written (`tangram_jax.kv_layout`): every
chunk's tokens are scored, and each head keeps its group's count of them. These functions do that
for ONE sequence's (padded) chunk, so a runner can call them per row whatever its batching:

- `chunk_scores`: the scores of a chunk's tokens, by the method the budget profile was calibrated
  with (`SERVED_METHODS`: the scorers of `tangram_jax.compression.scorers` that a chunk's
  inputs can feed), with the chunk's protected tokens (the end of the turn,
  `KVLayout.chunk_protected`) lifted above every other score so any count >= their number keeps
  them. The Pallas path and the XLA reference path of the runner both call it, after attention;
- `SCORING_RULES`: which queries' attention ranks a chunk's tokens beside the method (the
  observation window alone, or a union with queries spread over the chunk: `union_by_rank`);
- `dynamic_keep_count`: the per-input (Ada-SnapKV) count of ``dynamic`` mode on monolithic pages,
  the protected tokens kept on top of it.

Shapes: a chunk is padded to the static T; ``chunk_len`` valid tokens (traced scalar), the last
``num_protected`` of them protected (traced scalar).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from tangram_jax.compression.scorers import (expected_attention, keydiff,
                                             pool1d, snapkv_from_probs, streaming_llm)
from tangram_jax.compression.selection import dynamic_select

# Methods a profile may be calibrated with and served by. H2O needs every query's attention over
# the chunk (the prefill attention hands out only the observation window's), so it is refused.
SERVED_METHODS = ("snapkv", "expected_attention", "keydiff", "tova", "streaming_llm")


def check_served_method(method: str) -> str:
    """`method`, or a ValueError naming it and what can be served."""
    if method not in SERVED_METHODS:
        raise ValueError(f"a budget profile calibrated with {method!r} cannot be served: the "
                         f"chunk compression scores with one of {', '.join(SERVED_METHODS)} "
                         f"(calibrate the profile with one of them)")
    return method

# Scoring rules (`kv_layout`'s "which queries score a chunk"; EngineConfig.scoring_rule):
# - "window":          the method's scores alone (SnapKV: the chunk's last obs_window queries,
#                      which for a whole-turn chunk are the turn's question);
# - "window+context":  a union by rank (`union_by_rank`) of the method's ranking and a
#                      question-agnostic one, the SnapKV score of queries spread over the chunk
#                      (`context_query_probs`), each ranking filling its share of a head's count;
# - "window+keydiff":  the same union with KeyDiff's ranking (keys least like the head's mean
#                      key: query-free, no attention to compute).
# A later turn asks about what the current question does not: the question-agnostic half keeps
# tokens for it.
SCORING_RULES = ("window", "window+context", "window+keydiff")
# What `EngineConfig.scoring_rule` accepts: a rule, or "auto" (the default), which picks by the
# profile's keep ratio (`resolve_scoring_rule`).
SCORING_RULE_CHOICES = ("auto",) + SCORING_RULES
# "auto" takes window+keydiff below this keep ratio and the window alone at or above it. H100,
# SmolLM2, 100 samples a task on two sample sets (`benchmarks/results/accuracy.json`,
# `accuracy_solvable.json`): at 0.25 the union keeps
# variable tracking where the window alone loses it (39% vs 8% and 46% vs 6%; full KV 44 / 41%),
# ties multi-turn and passkey, and costs kv retrieval 5 / 1 points: the best mean over the four
# tasks on both sets (40 vs 33%, 65 vs 54%). At 0.5 the window alone keeps more (kv retrieval 36
# vs 20% on the first set; a tie on the second). Between 0.25 and 0.5 nothing was measured.
AUTO_KEYDIFF_BELOW_RATIO = 0.5
# The spread queries: every CONTEXT_STRIDE-th query of the chunk before its protected tail.
CONTEXT_STRIDE = 16
# The window's share of a head's count under the union rules (the rest: the agnostic part's).
WINDOW_SHARE = 0.5


def check_scoring_rule(rule: str) -> str:
    """`rule`, or a ValueError naming it and the rules there are."""
    if rule not in SCORING_RULES:
        raise ValueError(f"scoring_rule must be one of {', '.join(map(repr, SCORING_RULES))}, "
                         f"got {rule!r}")
    return rule


def resolve_scoring_rule(rule: str, mode: str, ratio: float | None,
                         retention: str = "chunk") -> str:
    """The rule a runner serves: `rule` itself, or for "auto" window+keydiff when a tangram
    profile keeps less than `AUTO_KEYDIFF_BELOW_RATIO` of each turn (its keep ratio `ratio`), and
    the window otherwise (full KV compresses nothing; dynamic counts with the window's scores).
    Whole turns (retention "turn", which serves `TURN_RULES`) take the window at every ratio:
    pooled over `TURN_POOL_KERNEL` keys, the question window alone beat the window beside a
    KeyDiff share of the count by 2-25 points a column at 0.25 on the long-session tasks (see
    `TURN_POOL_KERNEL`; with SnapKV's 7-key pool the union had been 11 points better)."""
    if rule != "auto":
        rule = check_scoring_rule(rule)
        if retention == "turn" and mode == "tangram" and rule not in TURN_RULES:
            raise ValueError(f"scoring_rule {rule!r} ranks within one chunk; retention 'turn' "
                             f"ranks whole turns by one of {TURN_RULES}")
        return rule
    if mode == "tangram" and retention != "turn" and ratio is not None and \
            ratio < AUTO_KEYDIFF_BELOW_RATIO:
        return "window+keydiff"
    return "window"


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


def method_scores(method: str, obs_probs: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                  chunk_len: jax.Array, first_position: jax.Array, *, q_per_kv: int,
                  inv_freq=None) -> jax.Array:
    """Scores [num_kv_heads, T] of a padded chunk's tokens by `method` (`SERVED_METHODS`; static).

    obs_probs: float32 [num_q_heads, W, T] (the prefill attention's observation window);
    q: [T, num_q_heads, D], k, v: [T, num_kv_heads, D] (RoPE applied); chunk_len, first_position
    (absolute position of token 0): int32 scalars. inv_freq: the model's RoPE frequencies
    (Expected Attention). Scores of padding positions are meaningless (masked by the caller).
    """
    check_served_method(method)
    if method == "snapkv":
        return snapkv_chunk_scores(obs_probs, chunk_len, q_per_kv)
    if method == "tova":   # the last query's attention: the window's last row
        last = obs_probs[:, -1, :].astype(jnp.float32)
        return last.reshape(-1, q_per_kv, last.shape[-1]).mean(axis=1)
    heads = lambda x: jnp.moveaxis(x, 0, 1)   # [T, H, D] -> [H, T, D]   # noqa: E731
    if method == "keydiff":
        return keydiff(heads(q), heads(k), heads(v), q_per_kv=q_per_kv, num_valid=chunk_len)
    if method == "streaming_llm":
        return streaming_llm(heads(q), heads(k), heads(v), q_per_kv=q_per_kv,
                             first_position=first_position, num_valid=chunk_len)
    return expected_attention(heads(q), heads(k), heads(v), q_per_kv=q_per_kv,
                              inv_freq=inv_freq, first_position=first_position,
                              num_valid=chunk_len)


def context_query_probs(q: jax.Array, k: jax.Array, chunk_len: jax.Array,
                        num_protected: jax.Array, *, stride: int, q_per_kv: int) -> jax.Array:
    """Attention of queries spread over a padded chunk, for a question-agnostic score.

    q [T, num_q_heads, D], k [T, num_kv_heads, D] (RoPE applied). The queries are the chunk's
    tokens stride - 1, 2 stride - 1, ... before its protected tail (S = T // stride rows, static;
    rows at or after ``chunk_len - num_protected`` are zero). Each row is the causal softmax over
    the chunk's own keys (not the history: every query casts the same vote over the chunk),
    times the number of keys it sees, so a probability reads against uniform attention (an early
    query's few keys would otherwise outweigh a late one's many).
    Returns float32 [num_q_heads, S, T].
    """
    t, _, dim = q.shape
    rows = jnp.arange(stride - 1, t, stride)                                  # [S]
    live = rows < chunk_len - num_protected
    keys = jnp.repeat(k.astype(jnp.float32), q_per_kv, axis=1)               # [T, Hq, D]
    logits = jnp.einsum("shd,thd->hst", q[rows].astype(jnp.float32), keys,
                        precision=lax.Precision.HIGHEST) / math.sqrt(dim)
    visible = (jnp.arange(t)[None, :] <= rows[:, None]) & live[:, None]      # [S, T]
    probs = jax.nn.softmax(jnp.where(visible[None], logits, -jnp.inf), axis=-1)
    weight = (rows + 1).astype(jnp.float32)[None, :, None]
    return jnp.where(visible[None], probs * weight, 0.0)


def union_by_rank(first: jax.Array, second: jax.Array, num_ranked: jax.Array | None,
                  first_share: float, *, ranked: jax.Array | None = None) -> jax.Array:
    """Scores [heads, T] whose top k is the union of `first`'s and `second`'s top tokens, in the
    proportion first_share : 1 - first_share (a token already in one list is not counted twice,
    so the other list reaches further down).

    first, second: [heads, T] (higher = better); only tokens t < num_ranked are ranked, or
    with `ranked` (bool [heads, T]) the tokens it marks (the others get -inf: the protected
    tail and padding, placed by the caller). A token's score is -min(rank_first / share,
    rank_second / (1 - share)): the top k then holds the tokens whose better scaled rank is
    among the k best."""
    valid = (jnp.arange(first.shape[-1])[None, :] < num_ranked) if ranked is None else ranked

    def rank(scores):   # one sort; the inverse permutation by a scatter
        masked = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
        order = jnp.argsort(-masked, axis=-1, stable=True)
        heads = jnp.arange(order.shape[0])[:, None]
        positions = jnp.broadcast_to(jnp.arange(order.shape[-1], dtype=jnp.float32), order.shape)
        return jnp.zeros(order.shape, jnp.float32).at[heads, order].set(positions)

    scaled = jnp.minimum(rank(first) / first_share, rank(second) / (1.0 - first_share))
    return jnp.where(valid, -scaled, -jnp.inf)


def chunk_scores(method: str, obs_probs: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                 chunk_len: jax.Array, num_protected: jax.Array, first_position: jax.Array, *,
                 q_per_kv: int, inv_freq=None, rule: str = "window") -> jax.Array:
    """Scores [num_kv_heads, T] that the chunk compression ranks by (higher = kept first):
    `method_scores`, under the scoring `rule` (`SCORING_RULES`; static), the protected tail
    above everything."""
    scores = method_scores(method, obs_probs, q, k, v, chunk_len, first_position,
                           q_per_kv=q_per_kv, inv_freq=inv_freq)
    rule = check_scoring_rule(rule)
    if rule != "window":
        if rule == "window+context":
            agnostic = snapkv_chunk_scores(
                context_query_probs(q, k, chunk_len, num_protected, stride=CONTEXT_STRIDE,
                                    q_per_kv=q_per_kv), chunk_len, q_per_kv)
        else:
            agnostic = method_scores("keydiff", obs_probs, q, k, v, chunk_len, first_position,
                                     q_per_kv=q_per_kv)
        scores = union_by_rank(scores, agnostic, chunk_len - num_protected, WINDOW_SHARE)
    return protect_tail(scores, chunk_len, num_protected)


# The whole turn's SnapKV pools its window mass over this many neighbouring keys (max pool; the
# published SnapKV and the per-chunk rule pool over `scorers.DEFAULT_KERNEL` = 7). The question's
# window attends to every sentence that matches it ("the door code of ...", "the value of the
# key ..."), and a fact's value sits a few tokens after the words it matches: 7 keys reach the
# asked fact's digits (the window attends to those too) but not the others', which later turns
# ask. Offline proxy, H200, 100 samples a task of the long-session tasks, shipped profiles
# (`benchmarks/results/retention_proxy_pool_gpu.json`; facts t1 / follow-ups, passkey, kv t1 /
# follow-ups): full KV 77 / 62 / 91 / 46 / 38; kernel 7 at 0.5 74 / 57 / 92 / 44 / 29, at 0.25
# 45 / 26 / 91 / 14 / 8 (in a union with KeyDiff, the 0.25 default until this change, 67 / 50
# / 92 / 17 / 11: `retention_proxy_gpu.json`, rule E); kernel 15 at 0.5 75 / 64 / 91 / 44 / 37,
# at 0.25 74 / 66 / 92 / 44 / 35 (KeyDiff taking three quarters of the count beside it: 68 /
# 44 / 89 / 42 / 10); kernel 31 at 0.5 76 / 61 / 91 / 45 / 37, at 0.25 72 / 60 / 91 / 41 / 37.
TURN_POOL_KERNEL = 15

# Methods and rules the whole-turn compression (`kv_layout` retention "turn") serves: it has
# the turn's question window (its last obs_window queries over every token of the turn) and
# every key, so SnapKV and KeyDiff, and their union; the spread queries of "window+context"
# exist only within one chunk.
TURN_METHODS = ("snapkv", "keydiff")
TURN_RULES = ("window", "window+keydiff")


def turn_scores(window_mass: jax.Array, keys: jax.Array, candidate: jax.Array,
                protected: jax.Array, *, method: str, rule: str) -> jax.Array:
    """Scores [heads, S] of a whole turn's tokens on one temporal axis S (the turn's held
    slots, then its last chunk; higher = kept first), for retention "turn".

    window_mass: float32 [heads, S], the attention the turn's observation window (its last
    obs_window queries, the question) pays each token, summed over the window and averaged
    over the head's query heads (SnapKV's score before pooling); keys: float32 [heads, S, d]
    (RoPE applied); candidate: bool [heads, S], the turn's tokens (the rest of the axis is
    history of earlier turns or padding: -inf); protected: bool [heads, S], its protected tail
    (above everything). `method` ranks by SnapKV (the window mass max-pooled over
    `TURN_POOL_KERNEL` neighbouring tokens, so a kept token brings its sentence) or KeyDiff
    (keys least like the turn's mean key); rule "window+keydiff" fills `WINDOW_SHARE` of each
    head's count by that ranking and the rest by KeyDiff (`union_by_rank`)."""
    if method not in TURN_METHODS:
        raise ValueError(f"retention 'turn' scores with one of {TURN_METHODS}, got {method!r}")
    if rule not in TURN_RULES:
        raise ValueError(f"retention 'turn' ranks by one of {TURN_RULES}, got {rule!r}")
    mass = jnp.where(candidate, window_mass.astype(jnp.float32), 0.0)
    k = keys.astype(jnp.float32)
    unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    anchor = (unit * candidate[..., None]).sum(axis=1, keepdims=True)
    anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
    key_diff = -(unit * anchor).sum(axis=-1)
    ranked = candidate & ~protected
    first = pool1d(mass, TURN_POOL_KERNEL, "max") if method == "snapkv" else key_diff
    if rule == "window+keydiff" and method != "keydiff":
        scores = union_by_rank(first, key_diff, None, WINDOW_SHARE, ranked=ranked)
    else:
        scores = jnp.where(ranked, first, -jnp.inf)
    scores = jnp.where(protected & candidate, jnp.float32(PROTECTED_SCORE), scores)
    return jnp.where(candidate, scores, -jnp.inf)


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
