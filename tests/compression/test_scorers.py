"""Every scorer against a direct loop-over-heads-and-tokens numpy reference on random inputs."""

import contextlib
import functools
import math

import jax
import numpy as np
import pytest

from tangram_jax.compression import scorers
from tangram_jax.compression.scorers import SCORERS, get_scorer

NUM_KV, Q_PER_KV, DIM = 2, 3, 8


def _inputs(seed, t_q, t_k, num_kv=NUM_KV, q_per_kv=Q_PER_KV, dim=DIM):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(num_kv * q_per_kv, t_q, dim)).astype(np.float32) * 1.5
    k = rng.normal(size=(num_kv, t_k, dim)).astype(np.float32) * 1.5
    v = rng.normal(size=(num_kv, t_k, dim)).astype(np.float32)
    return q, k, v


def ref_probs(q, k, q_per_kv):
    """[Hq, Tq, Tk] causal softmax, one query and one key at a time."""
    hq, t_q, d = q.shape
    t_k = k.shape[1]
    out = np.zeros((hq, t_q, t_k))
    for h in range(hq):
        for i in range(t_q):
            pos = t_k - t_q + i
            logits = [float(np.dot(q[h, i], k[h // q_per_kv, j])) / math.sqrt(d) for j in range(pos + 1)]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            for j in range(pos + 1):
                out[h, i, j] = e[j] / sum(e)
    return out


def ref_group_mean(per_q, q_per_kv):
    hq, t = per_q.shape
    out = np.zeros((hq // q_per_kv, t))
    for h in range(hq):
        out[h // q_per_kv] += per_q[h] / q_per_kv
    return out


def ref_snapkv(q, k, v, q_per_kv, window, kernel, pool, protect_window=True):
    t_k = k.shape[1]
    w = min(window, q.shape[1])
    probs = ref_probs(q[:, -w:], k, q_per_kv)
    summed = ref_group_mean(probs.sum(axis=1), q_per_kv)
    n_prefix = t_k - w if protect_window else t_k
    out = np.zeros_like(summed)
    for h in range(summed.shape[0]):
        for j in range(t_k):
            if j >= n_prefix:
                out[h, j] = w + 1
                continue
            vals = [summed[h, i] if 0 <= i < n_prefix else 0.0
                    for i in range(j - kernel // 2, j + kernel // 2 + 1)]
            out[h, j] = max(vals) if pool == "max" else sum(vals) / kernel
    return out


def ref_tova(q, k, v, q_per_kv):
    return ref_group_mean(ref_probs(q[:, -1:], k, q_per_kv)[:, 0], q_per_kv)


def ref_h2o(q, k, v, q_per_kv):
    return ref_group_mean(ref_probs(q, k, q_per_kv).sum(axis=1), q_per_kv)


def ref_keydiff(q, k, v, q_per_kv):
    hkv, t_k, _ = k.shape
    out = np.zeros((hkv, t_k))
    for h in range(hkv):
        units = [k[h, j] / np.linalg.norm(k[h, j]) for j in range(t_k)]
        anchor = sum(units) / t_k
        anchor = anchor / np.linalg.norm(anchor)
        for j in range(t_k):
            out[h, j] = -float(np.dot(units[j], anchor))
    return out


def ref_streaming(q, k, v, q_per_kv, n_sink, window):
    hkv, t_k, _ = k.shape
    out = np.zeros((hkv, t_k))
    for h in range(hkv):
        for j in range(t_k):
            if j < n_sink:
                out[h, j] = 2.0
            elif j >= t_k - window:
                out[h, j] = 1.0 + j / t_k
            else:
                out[h, j] = 0.5 * j / t_k
    return out


def rope_matrix(inv_freq, pos):
    """Explicit rotate-half RoPE matrix: pair (i, i + D/2) rotated by pos * inv_freq[i]."""
    half = len(inv_freq)
    r = np.zeros((2 * half, 2 * half))
    for i in range(half):
        c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def ref_expected_attention(q, k, v, q_per_kv, inv_freq, n_future, n_sink):
    hq, t_q, d = q.shape
    t_k = k.shape[1]
    queries = []  # per head: pre-RoPE queries of the non-sink positions
    for h in range(hq):
        rows = []
        for i in range(t_q):
            pos = t_k - t_q + i
            if pos < n_sink:
                continue
            x = q[h, i].astype(np.float64)
            rows.append(rope_matrix(inv_freq, pos).T @ x if inv_freq is not None else x)
        queries.append(np.array(rows))
    if inv_freq is not None:
        r_bar = sum(rope_matrix(inv_freq, p) for p in range(t_k, t_k + n_future)) / n_future
    scores = np.zeros((hq, t_k))
    for h in range(hq):
        mu = queries[h].mean(axis=0)
        cov = np.zeros((d, d))
        for x in queries[h]:
            cov += np.outer(x - mu, x - mu) / len(queries[h])
        if inv_freq is not None:
            mu, cov = r_bar @ mu, r_bar @ cov @ r_bar.T
        logits = {}
        for j in range(n_sink, t_k):
            kj = k[h // q_per_kv, j].astype(np.float64)
            logits[j] = mu @ kj / math.sqrt(d) + kj @ cov @ kj / (2 * d)
        m = max(logits.values())
        z = sum(math.exp(x - m) for x in logits.values())
        for j, x in logits.items():
            scores[h, j] = math.exp(x - m) / z
    out = ref_group_mean(scores, q_per_kv)
    for h in range(out.shape[0]):
        for j in range(t_k):
            out[h, j] *= np.linalg.norm(v[h, j])
    top = out[:, n_sink:].max()
    out[:, :n_sink] = top
    return out


@pytest.mark.parametrize("t_q,t_k", [(5, 5), (6, 19)])
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_snapkv_matches_reference(t_q, t_k, pool):
    q, k, v = _inputs(0, t_q, t_k)
    got = scorers.snapkv(q, k, v, q_per_kv=Q_PER_KV, window=4, kernel=5, pool=pool)
    want = ref_snapkv(q, k, v, Q_PER_KV, 4, 5, pool)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_snapkv_without_window_protection_pools_everything():
    q, k, v = _inputs(1, 6, 17)
    got = scorers.snapkv(q, k, v, q_per_kv=Q_PER_KV, window=3, kernel=7, pool="avg",
                         protect_window=False)
    want = ref_snapkv(q, k, v, Q_PER_KV, 3, 7, "avg", protect_window=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_snapkv_from_probs_is_snapkv():
    q, k, v = _inputs(2, 8, 30)
    probs = scorers.causal_attention_probs(q[:, -4:], k, Q_PER_KV)
    np.testing.assert_allclose(np.asarray(probs), ref_probs(q[:, -4:], k, Q_PER_KV), atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(scorers.snapkv_from_probs(probs, Q_PER_KV, "max")),
        np.asarray(scorers.snapkv(q, k, v, q_per_kv=Q_PER_KV, window=4)), rtol=1e-6)


@pytest.mark.parametrize("t_q,t_k", [(1, 9), (7, 7), (4, 13)])
def test_attention_scorers_match_reference(t_q, t_k):
    q, k, v = _inputs(3, t_q, t_k)
    np.testing.assert_allclose(np.asarray(scorers.tova(q, k, v, q_per_kv=Q_PER_KV)),
                               ref_tova(q, k, v, Q_PER_KV), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(scorers.h2o(q, k, v, q_per_kv=Q_PER_KV)),
                               ref_h2o(q, k, v, Q_PER_KV), rtol=1e-5, atol=1e-6)


def test_keydiff_and_streaming_match_reference():
    q, k, v = _inputs(4, 3, 21)
    np.testing.assert_allclose(np.asarray(scorers.keydiff(q, k, v, q_per_kv=Q_PER_KV)),
                               ref_keydiff(q, k, v, Q_PER_KV), rtol=1e-5, atol=1e-6)
    got = scorers.streaming_llm(q, k, v, q_per_kv=Q_PER_KV, n_sink=2, window=5)
    np.testing.assert_allclose(np.asarray(got), ref_streaming(q, k, v, Q_PER_KV, 2, 5), atol=1e-7)


@pytest.mark.parametrize("with_rope", [False, True])
def test_expected_attention_matches_reference(with_rope):
    q, k, v = _inputs(5, 10, 16)
    inv_freq = (1.0 / (100.0 ** (np.arange(0, DIM, 2) / DIM))).astype(np.float32) if with_rope else None
    got = scorers.expected_attention(q, k, v, q_per_kv=Q_PER_KV, inv_freq=inv_freq, n_future=6,
                                     n_sink=2)
    want = ref_expected_attention(q, k, v, Q_PER_KV, inv_freq, 6, 2)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=1e-6)


def test_expected_attention_rope_is_position_consistent():
    """The same pre-RoPE queries rotated to their positions give the same scores as
    feeding the statistics directly: de-rotation must undo the model's RoPE exactly."""
    rng = np.random.default_rng(6)
    inv_freq = (1.0 / (50.0 ** (np.arange(0, DIM, 2) / DIM))).astype(np.float32)
    t_k, t_q = 12, 6
    x = rng.normal(size=(NUM_KV * Q_PER_KV, t_q, DIM)).astype(np.float32)
    rotated = np.stack([[rope_matrix(inv_freq, t_k - t_q + i) @ x[h, i] for i in range(t_q)]
                        for h in range(x.shape[0])]).astype(np.float32)
    _, k, v = _inputs(7, t_q, t_k)
    a = scorers.expected_attention(rotated, k, v, q_per_kv=Q_PER_KV, inv_freq=inv_freq, n_sink=0)
    want = ref_expected_attention(rotated, k, v, Q_PER_KV, inv_freq, 512, 0)
    np.testing.assert_allclose(np.asarray(a), want, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_scorer_is_jittable_and_shaped(name):
    q, k, v = _inputs(8, 6, 40)
    fn = get_scorer(name)
    eager = fn(q, k, v, q_per_kv=Q_PER_KV)
    jitted = jax.jit(functools.partial(fn, q_per_kv=Q_PER_KV))(q, k, v)
    assert eager.shape == (NUM_KV, 40) and eager.dtype == np.float32
    assert np.isfinite(np.asarray(eager)).all()
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-6)


def test_registry_and_shape_errors():
    with pytest.raises(ValueError, match="unknown scorer 'nope'.*snapkv"):
        get_scorer("nope")
    q, k, v = _inputs(9, 4, 10)
    with pytest.raises(ValueError, match="q_per_kv"):
        scorers.snapkv(q, k, v, q_per_kv=2)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        scorers.h2o(np.zeros((6, 11, DIM), np.float32), k, v, q_per_kv=Q_PER_KV)
    assert get_scorer("snapkv", window=2)(q, k, v, q_per_kv=Q_PER_KV).shape == (NUM_KV, 10)


@pytest.mark.parametrize("name", sorted(SCORERS))
@pytest.mark.parametrize("valid", [5, 23])
def test_a_padded_sequence_scores_as_the_unpadded_one(name, valid):
    """num_valid: a sequence padded to a compiled length (queries = keys' positions) scores its
    valid keys as the sequence alone does (the same order for streaming_llm, whose recency is a
    share of the padded length); 5 valid positions are fewer than SnapKV's window."""
    q, k, v = _inputs(11, 30, 30)
    fn = functools.partial(get_scorer(name), q_per_kv=Q_PER_KV)
    alone = np.asarray(fn(q[:, :valid], k[:, :valid], v[:, :valid]))
    padded = np.asarray(jax.jit(fn)(q, k, v, num_valid=np.int32(valid)))[:, :valid]
    if name == "streaming_llm":
        np.testing.assert_array_equal(np.argsort(-padded, kind="stable"),
                                      np.argsort(-alone, kind="stable"))
    else:
        np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Tq == Tk") if name in ("snapkv", "tova", "h2o") \
            else contextlib.nullcontext():
        fn(q[:, -4:], k, v, num_valid=np.int32(valid))
