"""The retention-rule proxy (`benchmarks/retention_proxy.py`, its rules in
`benchmarks/_retention_rules.py`): its masked decoding against the dense decoder, the
question-only pass, and the keep counts and claims of its selection rules."""

from __future__ import annotations

import importlib
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

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "retention_proxy.py"
_BUDGET = np.array([[0.25, 0.5], [0.3, 1.0]])   # [layers, kv heads] of `_random_turn`


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("retention_proxy", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["retention_proxy"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rules(rp):
    """The rules' module (`benchmarks/_retention_rules.py`, on the path once `rp` is loaded)."""
    return importlib.import_module("_retention_rules")


@pytest.fixture(scope="module")
def tiny(tiny_folder, rp):
    reference = load_model(str(tiny_folder), use_cache=False)
    return rp.ProxyModel(load_model(str(tiny_folder), use_cache=False)), reference


def _dense_logits(loaded, tokens, positions):
    """Last-position logits [V] of the dense decoder over `tokens` at `positions`."""
    cache = DenseKVCache.create(loaded.config, 1, len(tokens), jnp.float32)
    logits, _ = loaded.model(jnp.asarray([tokens], jnp.int32),
                             jnp.asarray([positions], jnp.int32), cache)
    return np.asarray(logits[0, -1])


def _extend(rp, pm, t1, keep, new, lengths, tokens, score=False):
    """One `extend` of B = keep.shape[0] rows, every row fed `tokens`; with `score` the
    follow-up scoring pass's [L, B, Hkv, u] scores instead."""
    batch = keep.shape[0]
    ctx = rp._pad_to(t1.u, rp.BUCKET)
    kp = np.zeros((keep.shape[1], batch, keep.shape[2], ctx), bool)
    kp[..., :t1.u] = np.moveaxis(keep, 0, 1)
    pad = ((0, 0), (0, ctx - t1.u), (0, 0), (0, 0))
    ck, cv = (jnp.pad(jnp.asarray(x[:, :t1.u]), pad) for x in (t1.k, t1.v))
    arr = jnp.asarray(np.tile(tokens, (batch, 1)), jnp.int32)
    logits, new_k, new_v, *scores = pm.extend(
        pm.state, pm.layer_states, ck, cv, jnp.asarray(kp), *new,
        jnp.asarray(lengths, jnp.int32), arr, jnp.full(batch, len(tokens), jnp.int32),
        jnp.int32(t1.u), score=score)
    if score:
        return np.asarray(scores[0])[..., :t1.u]
    return np.asarray(logits), (new_k, new_v)


def test_masked_extend_matches_the_dense_decoder(rp, tiny):
    """Every context token kept: the tail's prefill and a decode step give the dense decoder's
    logits. Only a prefix kept in every head: the logits of the decoder run on that prefix and
    the tail at their original positions (a prefix's K/V do not depend on what follows it)."""
    pm, reference = tiny
    cfg = pm.config
    ids = list(np.random.default_rng(0).integers(0, 256, 300))
    t1 = rp.turn1_pass(pm, ids)
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
    t1 = rp.turn1_pass(pm, ids)
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
    """A Turn1 of random arrays (2 query heads a KV head), with a random question-only pass."""
    rng = np.random.default_rng(seed)
    big = rp._pad_to(n, rp.BUCKET)
    c = big // rp.CHUNK
    k = rng.standard_normal((layers, big, heads, dim)).astype(np.float32)
    obs = rng.random((layers, c, 2 * heads, rp.TAIL, rp.CHUNK)).astype(np.float32)
    turn = rng.random((layers, 2 * heads, rp.TAIL, big)).astype(np.float32)
    q = rng.standard_normal((layers, rp.TAIL, 2 * heads, dim)).astype(np.float32)
    question = rp.QuestionPass(*(x.astype(np.float32) for x in (
        rng.standard_normal(q.shape), rng.standard_normal((layers, 2 * heads, rp.TAIL)) + 3.0,
        rng.standard_normal((layers, rp.TAIL, heads, dim)))))
    return rp.Turn1(n, n - rp.TAIL, k, k.copy(), obs, turn, q, question=question)


def _ranks(scores):
    """Rank (0 = best, earlier first on ties) along the last axis."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return np.argsort(order, axis=-1, kind="stable")


LANES = ("QoH1", "QoE1", "QoHt", "QoHq", "DHg")


@pytest.mark.parametrize("n", [300, 400, 270])   # last chunk: partly, fully, barely protected
def test_keep_counts_follow_each_rule_kind(rp, n):
    t1 = _random_turn(rp, n)
    budget = _BUDGET
    scored = rp.rule_scores(t1, ["B", "D", "I2", "I6", "Qo", *LANES], None, jnp.ones(4),
                            q_per_kv=2)
    chunk = rp.keep_mask(*scored["B"], t1, budget)
    free = t1.chunk_lens - t1.chunk_protected
    want = sum(chunk_keep_count(budget, int(f)) for f in free if f > 0)
    np.testing.assert_array_equal(chunk.sum(-1), want)
    for c, f in enumerate(free):     # each chunk keeps its own count
        if f > 0:
            part = chunk[..., c * rp.CHUNK:c * rp.CHUNK + f]
            np.testing.assert_array_equal(part.sum(-1), chunk_keep_count(budget, int(f)))
    for rule in ("D", "I2", "I6", "Qo", *LANES):
        kept = rp.keep_mask(*scored[rule], t1, budget)
        assert kept.shape == (2, 2, t1.u)
        np.testing.assert_array_equal(kept.sum(-1), chunk_keep_count(budget, t1.u))
    # I6: what it keeps before the last chunk survived I2's ranking there.
    last = rp.CHUNK * ((t1.u - 1) // rp.CHUNK)
    flow = rp.keep_mask(*scored["I6"], t1, budget)
    survivor = scored["I6"][1][0][..., :last]
    count = chunk_keep_count(budget, t1.u)[..., None]
    assert not (flow[..., :last] & (_ranks(survivor) >= count)).any()


@pytest.mark.parametrize("rule", LANES)
def test_two_lanes_keep_the_first_lanes_top_share_then_the_seconds_best(rp, rules, rule):
    """The first lane's top ceil(share * count) are kept; the rest of the count are the second
    score's best among the others (so a token both lanes rank high is counted once)."""
    t1 = _random_turn(rp, 400, seed=2)
    kind, (first, second, share) = rp.rule_scores(t1, [rule], None, jnp.ones(4),
                                                  q_per_kv=2)[rule]
    assert kind == "lanes" and share == rules.TWO_LANES[rule][2]
    kept = rp.keep_mask(kind, (first, second, share), t1, _BUDGET)
    count = chunk_keep_count(_BUDGET, t1.u)[..., None]
    top_first = _ranks(first[..., :t1.u]) < np.ceil(share * count)
    assert (kept >= top_first).all()
    rest = np.where(top_first, -np.inf, second[..., :t1.u])
    np.testing.assert_array_equal(kept & ~top_first,
                                  _ranks(rest) < count - top_first.sum(-1, keepdims=True))
    assert (kept & ~top_first).any()


def test_question_only_scores_are_fixed_once_their_chunk_is_seen(rp):
    """Qo scores a key by the question's queries and that key alone (SnapKV's pooling adds
    3 neighbours a side) and QoH1's second lane anchors on the first 128 keys: changing the
    keys from chunk 2 on leaves both as they were before it. The whole turn's KeyDiff
    (QoHt's second lane) moves."""
    t1 = _random_turn(rp, 400, seed=3)
    rules = ["Qo", "QoH1", "QoHt"]
    before = rp.rule_scores(t1, rules, None, jnp.ones(4), q_per_kv=2)
    t1.k[:, 2 * rp.CHUNK:] = np.random.default_rng(9).standard_normal(
        t1.k[:, 2 * rp.CHUNK:].shape)
    after = rp.rule_scores(t1, rules, None, jnp.ones(4), q_per_kv=2)
    seen = slice(0, 2 * rp.CHUNK - 3)
    np.testing.assert_allclose(after["Qo"][1][..., seen], before["Qo"][1][..., seen],
                               rtol=1e-6)
    np.testing.assert_allclose(after["QoH1"][1][1][..., :2 * rp.CHUNK],
                               before["QoH1"][1][1][..., :2 * rp.CHUNK], atol=1e-6)
    changed = slice(2 * rp.CHUNK, t1.u)
    assert np.abs(after["Qo"][1][..., changed] - before["Qo"][1][..., changed]).max() > 1e-3
    assert np.abs(after["QoHt"][1][1][..., seen] - before["QoHt"][1][1][..., seen]).max() > 1e-3


def test_question_pass_is_the_question_alone_normalised_by_itself(rp, rules, tiny):
    """The question-only pass equals the decoder run on the turn's last TAIL tokens alone at
    their positions; its window (rule Qo) is exp(logit - the question's own log-sum-exp):
    over the question pass's own keys each row sums to 1, and in layer 0 (where a key depends
    on its token and position only) so does each row's mass on turn 1's tail, the context's
    keys adding to it."""
    pm, reference = tiny
    ids = list(np.random.default_rng(5).integers(0, 256, 300))
    t1 = rp.turn1_pass(pm, ids, question=True)
    qp, n, u = t1.question, t1.n, t1.u
    cache = DenseKVCache.create(reference.config, 1, rp.TAIL, jnp.float32)
    _, cache = reference.model(jnp.asarray([ids[u:]], jnp.int32),
                               jnp.arange(u, n, dtype=jnp.int32)[None], cache)
    np.testing.assert_allclose(qp.k, np.asarray(cache.k[:, 0]), atol=2e-5)
    assert np.abs(qp.k[1:] - t1.k[1:, u:n]).max() > 1e-2   # deeper layers saw no context
    np.testing.assert_allclose(qp.k[0], t1.k[0, u:n], atol=1e-5)
    own = np.asarray(rules._question_window(qp.q, qp.lse, qp.k, rp.TAIL))     # [L, Hq, W, W]
    np.testing.assert_allclose(own.sum(-1), 1.0, atol=1e-5)
    assert (np.triu(own[..., :, :], 1) == 0).all()          # causal within the question
    window = np.asarray(rules._question_window(qp.q, qp.lse, t1.k, n))        # [L, Hq, W, N]
    np.testing.assert_allclose(window[0, ..., u:n].sum(-1), 1.0, atol=1e-5)
    assert (window[0, ..., :u].sum(-1) > 0).all() and (window[..., n:] == 0).all()


def test_question_rules_need_the_question_pass(rp):
    t1 = _random_turn(rp, 300)
    t1.question = None
    with pytest.raises(ValueError, match="question-only pass"):
        rp.rule_scores(t1, ["QoH1"], None, jnp.ones(4), q_per_kv=2)
    assert set(rp.rule_scores(t1, ["DHg"], None, jnp.ones(4), q_per_kv=2)) == {"DHg"}


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


def test_probe_rules_rank_the_context_by_the_probe_pass(rp):
    """P ranks the turn's context by the probe pass's scores (the protected tail and padding
    never); DPg is D's quarter, then P; both need the probe pass."""
    t1 = _random_turn(rp, 300, seed=3)
    with pytest.raises(ValueError, match="probe pass"):
        rp.rule_scores(t1, ["DPg"], None, jnp.ones(4), q_per_kv=2)
    probe = np.random.default_rng(0).random((2, 2, 300 + 20)).astype(np.float32)
    scored = rp.rule_scores(t1, ["P", "DPg"], None, jnp.ones(4), q_per_kv=2, probe=probe)
    kind, p = scored["P"]
    assert kind == "turn" and np.array_equal(p[..., :t1.u], probe[..., :t1.u])
    assert np.isneginf(p[..., t1.u:]).all()
    kept = rp.keep_mask(kind, p, t1, _BUDGET)
    np.testing.assert_array_equal(kept, _ranks(probe[..., :t1.u]) < chunk_keep_count(
        _BUDGET, t1.u)[..., None])
    kind, (first, second, share) = scored["DPg"]
    assert kind == "lanes" and share == 0.25 and second is p


def test_recall_scores_are_the_attention_the_follow_up_pays_every_context_key(rp, tiny):
    """The scoring pass before a follow-up: per layer and KV head, the attention the
    follow-up's tokens pay each of turn 1's context keys were all visible, summed over the
    tokens and averaged over the head's query heads, with their queries computed over the
    kept history. Every key kept: a dense pass's attention. A partial mask: the same at the
    first layer (its queries do not depend on the history), different after it."""
    pm, reference = tiny
    cfg, model = pm.config, reference.model
    ids = list(np.random.default_rng(1).integers(0, 256, 300))
    follow = list(np.random.default_rng(2).integers(0, 256, 6))
    t1 = rp.turn1_pass(pm, ids)
    u, n = t1.u, t1.n
    keep = np.ones((2, cfg.num_layers, cfg.num_kv_heads, u), bool)
    keep[1, ..., ::3] = False
    shape = (cfg.num_layers, 2, rp.NEW_SLOTS, cfg.num_kv_heads, cfg.head_dim)
    _, new = _extend(rp, pm, t1, keep, (jnp.zeros(shape), jnp.zeros(shape)), [0, 0], ids[u:])
    scores = _extend(rp, pm, t1, keep, new, [rp.TAIL, rp.TAIL], follow, score=True)
    # Reference: the dense decoder over turn 1 + the follow-up, every key visible.
    seq = ids + follow
    qpk = cfg.num_heads // cfg.num_kv_heads
    h = model.embed(jnp.asarray([seq], jnp.int32))
    positions = jnp.arange(len(seq), dtype=jnp.int32)[None]
    causal = np.tril(np.ones((len(seq), len(seq)), bool))
    for layer_index, layer in enumerate(model.layers):
        q, k, v = layer.qkv(h, positions)
        qg = q[0].reshape(len(seq), cfg.num_kv_heads, qpk, -1)
        logits = jnp.einsum("tgqd,sgd->gqts", qg, k[0]) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        want = np.asarray(probs[:, :, n:, :u].sum(axis=2).mean(axis=1))   # [Hkv, u]
        np.testing.assert_allclose(scores[layer_index, 0], want, atol=1e-5)
        if layer_index == 0:
            np.testing.assert_allclose(scores[0, 1], want, atol=1e-5)
        out = jnp.einsum("gqts,sgd->tgqd", probs, v[0]).reshape(1, len(seq), cfg.num_heads, -1)
        h = layer.finish(h, out)
    assert np.abs(scores[1:, 1] - scores[1:, 0]).max() > 1e-4


def test_recall_keeps_the_count_and_chooses_its_share_again(rp, rules):
    """X+R chooses the head's whole count by the follow-up's pooled scores, X+R.5 half of it
    (the rest: the held tokens it scores highest), X+Rall every token; names parse."""
    assert rules.split_recall("DHg+R.5") == ("DHg", 0.5)
    assert rules.split_recall("D+Rall") == ("D", 0.0) and rules.split_recall("D") == ("D", None)
    assert rules.split_recall("D+R2") == ("D", 1.0) and rules.recall_rounds("D+R2") == 2
    assert not rules.is_rule("A+R") and not rules.is_rule("Z+R") and rules.is_rule("E+R")
    rng = np.random.default_rng(0)
    u = 200
    scores = rng.random((2, 2, u)).astype(np.float32)
    count = chunk_keep_count(_BUDGET, u)
    held = _ranks(rng.random((2, 2, u))) < count[..., None]
    from tangram_jax.compression.scorers import pool1d
    pooled = np.asarray(pool1d(jnp.asarray(scores), rules.SNAPKV_KERNEL, "max"))
    again = rules.recall_keep(scores, held, count, 1.0)
    np.testing.assert_array_equal(again, _ranks(pooled) < count[..., None])
    half = rules.recall_keep(scores, held, count, 0.5)
    assert (half.sum(-1) == count).all() and (again.sum(-1) == count).all()
    stay = np.floor(0.5 * count + 1e-6).astype(int)[..., None]
    kept = _ranks(np.where(held, pooled, -np.inf)) < stay   # the held ones it scores highest
    assert (half & kept).sum() == kept.sum()
    assert rules.recall_keep(scores, held, count, 0.0).all()


def test_a_recall_that_keeps_the_mask_changes_no_answer(rp, tiny):
    """Sessions with a recall rule run the scoring pass before each follow-up and then the
    turn as before: a recall returning the held mask unchanged answers as no recall; it is
    called once a follow-up turn with that row's [L, Hkv, u] scores and mask."""
    from tangram_jax.evaluation.tasks import TaskSizes, generate
    pm, _ = tiny
    sample = generate("long_kv", 0, 0, TaskSizes(long_chars=1500))   # two turns
    ids = rp.first_turn_token_ids(pm.tokenizer, sample)
    t1 = rp.turn1_pass(pm, ids)
    keep = np.zeros((pm.config.num_layers, pm.config.num_kv_heads, t1.u), bool)
    keep[..., ::2] = True
    calls = []

    def unchanged(scores, held):
        calls.append((scores.shape, held.copy()))
        return held

    twice = []

    def unchanged_twice(scores, held):
        twice.append(scores)
        return held

    unchanged_twice.rounds = 2   # X+R2: two scoring passes a follow-up
    answers = rp.run_sessions(pm, sample, ids, t1, np.stack([keep, keep, keep]),
                              [None, unchanged, unchanged_twice])
    assert answers[0] == answers[1] == answers[2]
    assert len(calls) == len(sample.turns) - 1 and len(twice) == 2 * len(calls)
    assert all(shape == keep.shape and np.array_equal(h, keep) for shape, h in calls)
    np.testing.assert_allclose(twice[0], twice[1], atol=1e-6)   # nothing recalled between
