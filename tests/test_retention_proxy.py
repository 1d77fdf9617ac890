"""The retention-rule proxy (`benchmarks/retention_proxy.py`): its masked decoding against the
dense decoder, and the keep counts of its selection rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.kv_layout import chunk_keep_count
from tangram_jax.models.decoder import DenseKVCache
from tangram_jax.models.registry import load_model
from tiny_engine import build_tiny_model

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "retention_proxy.py"


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("retention_proxy", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["retention_proxy"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, rp):
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny_proxy"))
    reference = load_model(str(folder), use_cache=False)
    return rp.ProxyModel(load_model(str(folder), use_cache=False)), reference


def _dense_logits(loaded, tokens, positions):
    """Last-position logits [V] of the dense decoder over `tokens` at `positions`."""
    cache = DenseKVCache.create(loaded.config, 1, len(tokens), jnp.float32)
    logits, _ = loaded.model(jnp.asarray([tokens], jnp.int32),
                             jnp.asarray([positions], jnp.int32), cache)
    return np.asarray(logits[0, -1])


def _turn1(rp, pm, ids):
    n = len(ids)
    arr = np.zeros(rp._pad_to(n, rp.BUCKET), np.int32)
    arr[:n] = ids
    k, v, own, turn, q_win = pm.dense_pass(pm.state, pm.layer_states, jnp.asarray(arr),
                                           jnp.int32(n))
    return rp.Turn1(n, n - rp.TAIL, *(np.asarray(x) for x in (k, v, own, turn, q_win)))


def _extend(rp, pm, t1, keep, new, lengths, tokens):
    """One `extend` of B = keep.shape[0] rows, every row fed `tokens`."""
    batch = keep.shape[0]
    ctx = rp._pad_to(t1.u, rp.BUCKET)
    kp = np.zeros((keep.shape[1], batch, keep.shape[2], ctx), bool)
    kp[..., :t1.u] = np.moveaxis(keep, 0, 1)
    pad = ((0, 0), (0, ctx - t1.u), (0, 0), (0, 0))
    ck, cv = (jnp.pad(jnp.asarray(x[:, :t1.u]), pad) for x in (t1.k, t1.v))
    arr = jnp.asarray(np.tile(tokens, (batch, 1)), jnp.int32)
    logits, new_k, new_v = pm.extend(pm.state, pm.layer_states, ck, cv, jnp.asarray(kp), *new,
                                     jnp.asarray(lengths, jnp.int32), arr,
                                     jnp.full(batch, len(tokens), jnp.int32), jnp.int32(t1.u))
    return np.asarray(logits), (new_k, new_v)


def test_masked_extend_matches_the_dense_decoder(rp, tiny):
    """Every context token kept: the tail's prefill and a decode step give the dense decoder's
    logits. Only a prefix kept in every head: the logits of the decoder run on that prefix and
    the tail at their original positions (a prefix's K/V do not depend on what follows it)."""
    pm, reference = tiny
    cfg = pm.config
    ids = list(np.random.default_rng(0).integers(0, 256, 300))
    t1 = _turn1(rp, pm, ids)
    u, n = t1.u, t1.n
    # The observation windows: chunk 0's queries see only chunk 0 (rows sum to 1 over it);
    # the last chunk's window is the turn's (its 44 tokens hold the 32 queries).
    np.testing.assert_allclose(t1.chunk_obs[:, 0].sum(-1), 1.0, atol=1e-5)
    last = (n - 1) // rp.CHUNK
    np.testing.assert_allclose(t1.chunk_obs[:, last],
                               t1.turn_obs[..., last * rp.CHUNK:(last + 1) * rp.CHUNK],
                               atol=1e-6)
    shape = (cfg.num_layers, 2, rp.NEW_SLOTS, cfg.num_kv_heads, cfg.head_dim)
    new = (jnp.zeros(shape), jnp.zeros(shape))
    keep = np.zeros((2, cfg.num_layers, cfg.num_kv_heads, u), bool)
    keep[0] = True
    prefix = 57
    keep[1, ..., :prefix] = True
    logits, new = _extend(rp, pm, t1, keep, new, [0, 0], ids[u:])
    full = _dense_logits(reference, ids, list(range(n)))
    cut = _dense_logits(reference, ids[:prefix] + ids[u:],
                        list(range(prefix)) + list(range(u, n)))
    assert np.abs(full - cut).max() > 1e-2   # the prefix case tests something else
    np.testing.assert_allclose(logits[0], full, atol=2e-4)
    np.testing.assert_allclose(logits[1], cut, atol=2e-4)
    step = int(np.argmax(full))
    logits, _ = _extend(rp, pm, t1, keep, new, [rp.TAIL, rp.TAIL], [step])
    np.testing.assert_allclose(logits[0], _dense_logits(reference, ids + [step],
                                                        list(range(n + 1))), atol=2e-4)


def _per_head_masked_logits(loaded, ids, u, keep):
    """Reference: one dense pass over all of `ids` where, in layer l, a query after the first u
    tokens sees context token j through KV head g only if keep[l, g, j] (and every earlier
    query causally). Returns the last position's logits [V]."""
    model, cfg = loaded.model, loaded.config
    n = len(ids)
    qpk = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((n, n), bool))
    h = model.embed(jnp.asarray([ids], jnp.int32))
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    for layer, kept in zip(model.layers, keep):
        mask = np.broadcast_to(causal, (cfg.num_kv_heads, n, n)).copy()
        mask[:, u:, :u] = kept[:, None, :]
        q, k, v = layer.qkv(h, positions)
        qg = q[0].reshape(n, cfg.num_kv_heads, qpk, -1)
        logits = jnp.einsum("tgqd,sgd->gqts", qg, k[0]) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -1e30), axis=-1)
        out = jnp.einsum("gqts,sgd->tgqd", probs, v[0]).reshape(1, n, cfg.num_heads, -1)
        h = layer.finish(h, out)
    return np.asarray(model.logits(h)[0, -1])


def test_masks_apply_per_layer_and_kv_head(rp, tiny):
    """Random keep masks that differ between layers and KV heads: the proxy's logits are those
    of a dense pass masked the same way per head (and change when the heads' masks swap)."""
    pm, reference = tiny
    cfg = pm.config
    ids = list(np.random.default_rng(3).integers(0, 256, 290))
    t1 = _turn1(rp, pm, ids)
    keep = np.random.default_rng(4).random((1, cfg.num_layers, cfg.num_kv_heads, t1.u)) < 0.3
    keep = np.concatenate([keep, keep[:, :, ::-1]])      # row 1: the heads' masks swapped
    shape = (cfg.num_layers, 2, rp.NEW_SLOTS, cfg.num_kv_heads, cfg.head_dim)
    logits, _ = _extend(rp, pm, t1, keep, (jnp.zeros(shape), jnp.zeros(shape)), [0, 0],
                        ids[t1.u:])
    for row in range(2):
        np.testing.assert_allclose(logits[row],
                                   _per_head_masked_logits(reference, ids, t1.u, keep[row]),
                                   atol=2e-4)
    assert np.abs(logits[0] - logits[1]).max() > 1e-2


def _random_turn(rp, n, seed=0, layers=2, heads=2, dim=8):
    rng = np.random.default_rng(seed)
    big = rp._pad_to(n, rp.BUCKET)
    c = big // rp.CHUNK
    k = rng.standard_normal((layers, big, heads, dim)).astype(np.float32)
    obs = rng.random((layers, c, 2 * heads, rp.TAIL, rp.CHUNK)).astype(np.float32)
    turn = rng.random((layers, 2 * heads, rp.TAIL, big)).astype(np.float32)
    q = rng.standard_normal((layers, rp.TAIL, 2 * heads, dim)).astype(np.float32)
    return rp.Turn1(n, n - rp.TAIL, k, k.copy(), obs, turn, q)


@pytest.mark.parametrize("n", [300, 400, 270])   # last chunk: partly, fully, barely protected
def test_keep_counts_follow_each_rule_kind(rp, n):
    t1 = _random_turn(rp, n)
    budget = np.array([[0.25, 0.5], [0.3, 1.0]])
    scored = rp.rule_scores(t1, ["B", "D", "I2", "I6"], None, jnp.ones(4), q_per_kv=2)
    chunk = rp.keep_mask(*scored["B"], t1, budget)
    free = t1.chunk_lens - t1.chunk_protected
    want = sum(chunk_keep_count(budget, int(f)) for f in free if f > 0)
    np.testing.assert_array_equal(chunk.sum(-1), want)
    for c, f in enumerate(free):     # each chunk keeps its own count
        if f > 0:
            part = chunk[..., c * rp.CHUNK:c * rp.CHUNK + f]
            np.testing.assert_array_equal(part.sum(-1), chunk_keep_count(budget, int(f)))
    for rule in ("D", "I2", "I6"):
        kept = rp.keep_mask(*scored[rule], t1, budget)
        assert kept.shape == (2, 2, t1.u)
        np.testing.assert_array_equal(kept.sum(-1), chunk_keep_count(budget, t1.u))
    # I6: what it keeps before the last chunk survived I2's ranking there.
    last = rp.CHUNK * ((t1.u - 1) // rp.CHUNK)
    flow = rp.keep_mask(*scored["I6"], t1, budget)
    survivor = scored["I6"][1][0][..., :last]
    count = chunk_keep_count(budget, t1.u)[..., None]
    order = np.argsort(-survivor, axis=-1, kind="stable")
    ranks = np.argsort(order, axis=-1, kind="stable")
    assert not (flow[..., :last] & (ranks >= count)).any()


def test_running_keydiff_starts_as_the_first_chunks(rp):
    """I2's anchor (keys up to the chunk's end) is, on chunk 0, the chunk's own anchor (I1)
    and the first 128 keys' (I3); later chunks differ."""
    t1 = _random_turn(rp, 400, seed=1)
    s = rp.rule_scores(t1, ["I1", "I2", "I3"], None, jnp.ones(4), q_per_kv=2)
    first = slice(0, rp.CHUNK)
    np.testing.assert_allclose(s["I2"][1][..., first], s["I1"][1][..., first], atol=1e-6)
    np.testing.assert_allclose(s["I2"][1][..., first], s["I3"][1][..., first], atol=1e-6)
    later = slice(2 * rp.CHUNK, 3 * rp.CHUNK)
    assert np.abs(s["I2"][1][..., later] - s["I3"][1][..., later]).max() > 1e-3
