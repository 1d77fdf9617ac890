"""Scoring rules of the chunk compression (`chunk_scoring.SCORING_RULES`): the window alone, or
its union with queries spread over the chunk (issue 12's follow-up turns)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.compression import chunk_scoring
from tangram_jax.compression.chunk_scoring import (chunk_scores, context_query_probs,
                                                   union_by_rank)
from tangram_jax.compression.scorers import causal_attention_probs
from tangram_jax.pallas_kernels.chunk_compress import kept_token_sources


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_union_by_rank_keeps_the_top_of_each_ranking_in_its_share(share):
    rng = np.random.default_rng(0)
    first, second = rng.random((3, 40)), rng.random((3, 40))
    scores = np.asarray(union_by_rank(jnp.asarray(first), jnp.asarray(second), 33, share))
    assert np.isneginf(scores[:, 33:]).all()          # unranked: protected tail and padding
    top = lambda x, j: set(np.argsort(-x[:33], kind="stable")[:j].tolist())  # noqa: E731
    for k in (1, 5, 12, 20, 33):
        for h in range(3):
            kept = set(np.argsort(-scores[h], kind="stable")[:k].tolist())
            assert len(kept) == k
            # kept = the tokens whose rank is below share * theta in the first ranking or below
            # (1 - share) * theta in the second, for some theta (ties at theta either way):
            # each ranking fills its share.
            r1 = np.argsort(np.argsort(-first[h, :33], kind="stable"), kind="stable")
            r2 = np.argsort(np.argsort(-second[h, :33], kind="stable"), kind="stable")
            scaled = np.minimum(r1 / share, r2 / (1 - share))
            theta = np.sort(scaled)[k - 1]
            assert set(np.nonzero(scaled < theta)[0]) <= kept <= set(
                np.nonzero(scaled <= theta)[0])
        kept_all = set(np.argsort(-scores[0], kind="stable")[:8].tolist())
        assert kept_all != top(first[0], 8) and kept_all != top(second[0], 8)


def test_context_queries_are_spread_causal_and_read_against_uniform():
    rng = np.random.default_rng(1)
    t, stride = 24, 4
    q = jnp.asarray(rng.normal(size=(t, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(t, 2, 8)), jnp.float32)
    probs = np.asarray(context_query_probs(q, k, jnp.int32(19), jnp.int32(5), stride=stride,
                                           q_per_kv=2))
    rows = np.arange(stride - 1, t, stride)                # 3, 7, 11, 15, 19, 23
    assert probs.shape == (4, len(rows), t)
    full = np.asarray(causal_attention_probs(jnp.moveaxis(q, 0, 1), jnp.moveaxis(k, 0, 1), 2))
    for i, row in enumerate(rows):
        if row < 19 - 5:                                   # before the protected tail
            np.testing.assert_allclose(probs[:, i], full[:, row] * (row + 1), rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(probs[:, i].sum(-1), row + 1, rtol=1e-5)
        else:
            assert (probs[:, i] == 0).all()


def _planted_chunk(t=64, d=16, asked=10, later=40):
    """One KV head, two query heads: the window's queries (the chunk's last 8) look at token
    `asked` and at the recent tokens; the queries spread over the text look at token `later` (a
    fact the question does not ask), which the window does not look at."""
    rng = np.random.default_rng(2)
    k = rng.normal(size=(t, 1, d)) * 0.1
    q = rng.normal(size=(t, 2, d)) * 0.1
    e_asked, e_later = np.eye(d)[0] * 4, np.eye(d)[1] * 4
    k[asked, 0] += e_asked
    k[later, 0] += e_later
    q[t - 8:] += e_asked[None, None]
    q[:t - 8] += e_later[None, None] * (np.arange(t - 8) > later)[:, None, None]
    q, k = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
    window = causal_attention_probs(jnp.moveaxis(q[t - 8:], 0, 1), jnp.moveaxis(k, 0, 1), 2)
    return q, k, window


@pytest.mark.parametrize("rule", ["window", "window+context"])
def test_a_later_asked_fact_survives_the_context_rule_only(rule):
    t, asked, later, tail = 64, 10, 40, 8
    q, k, window = _planted_chunk(t, asked=asked, later=later)
    scores = chunk_scores("snapkv", window, q, k, k, jnp.int32(t), jnp.int32(tail),
                          jnp.int32(0), q_per_kv=2, rule=rule)
    keep = jnp.asarray([tail + 8], jnp.int32)             # the tail plus 8 of 56 tokens
    sources, counts = kept_token_sources(scores, keep, jnp.int32(t), 1)
    kept = set(np.asarray(sources[0, :counts[0]]).tolist())
    assert set(range(t - tail, t)) <= kept                 # the question, protected
    assert asked in kept                                   # the asked fact, either way
    assert (later in kept) == (rule == "window+context")


def test_the_window_rule_is_the_method_alone():
    q, k, window = _planted_chunk()
    plain = chunk_scoring.protect_tail(chunk_scoring.snapkv_chunk_scores(window, 64, 2), 64, 8)
    got = chunk_scores("snapkv", window, q, k, k, jnp.int32(64), jnp.int32(8), jnp.int32(0),
                       q_per_kv=2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


def test_the_context_rule_scores_padded_chunks_like_unpadded_ones():
    """A chunk padded to T ranks its valid tokens as the same chunk of exactly its length (the
    engine pads every row to the chunk size)."""
    q, k, window = _planted_chunk()
    n = 50
    short = chunk_scores("snapkv", window[..., :n], q[:n], k[:n], k[:n],
                         jnp.int32(n), jnp.int32(6), jnp.int32(0), q_per_kv=2,
                         rule="window+context")
    padded = chunk_scores("snapkv", jnp.pad(window[..., :n], ((0, 0), (0, 0), (0, 64 - n))),
                          jnp.pad(q[:n], ((0, 64 - n), (0, 0), (0, 0))),
                          jnp.pad(k[:n], ((0, 64 - n), (0, 0), (0, 0))),
                          jnp.pad(k[:n], ((0, 64 - n), (0, 0), (0, 0))),
                          jnp.int32(n), jnp.int32(6), jnp.int32(0), q_per_kv=2,
                          rule="window+context")
    np.testing.assert_array_equal(np.asarray(padded)[:, :n], np.asarray(short))


def test_a_bad_scoring_rule_is_refused_with_its_name_value_and_choices():
    from tangram_jax.engine.config import EngineConfig, EngineConfigError
    from tangram_jax.engine.model_runner import RunnerConfig
    with pytest.raises(EngineConfigError,
                       match=r"scoring_rule must be one of 'auto', 'window', 'window\+context', "
                             r"'window\+keydiff', got 'question'"):
        EngineConfig(scoring_rule="question")
    with pytest.raises(EngineConfigError, match="dynamic mode"):
        EngineConfig(mode="dynamic", scoring_rule="window+context").check()
    with pytest.raises(ValueError, match=r"scoring_rule must be one of"):
        chunk_scores("snapkv", jnp.zeros((2, 4, 8)), jnp.zeros((8, 2, 4)), jnp.zeros((8, 1, 4)),
                     jnp.zeros((8, 1, 4)), jnp.int32(8), jnp.int32(0), jnp.int32(0),
                     q_per_kv=2, rule="spread")
    with pytest.raises(ValueError, match="dynamic mode"):
        RunnerConfig(mode="dynamic", scoring_rule="window+context")


def test_auto_picks_keydiff_for_chunks_of_profiles_keeping_under_half_and_the_window_otherwise():
    from tangram_jax.compression.chunk_scoring import resolve_scoring_rule
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.models.registry import load_model
    assert resolve_scoring_rule("auto", "tangram", 0.25) == "window+keydiff"
    assert resolve_scoring_rule("auto", "tangram", 0.5) == "window"
    # Whole turns take the wide-pooled window at every ratio.
    assert resolve_scoring_rule("auto", "tangram", 0.25, "turn") == "window"
    assert resolve_scoring_rule("window+keydiff", "tangram", 0.25, "turn") == "window+keydiff"
    assert resolve_scoring_rule("auto", "dynamic", 0.25) == "window"
    assert resolve_scoring_rule("auto", "full", None) == "window"
    assert resolve_scoring_rule("window+context", "tangram", 0.25) == "window+context"
    with pytest.raises(ValueError, match="scoring_rule must be one of"):
        resolve_scoring_rule("spread", "tangram", 0.25)
    # The engine's resolved settings carry the rule the runner serves, from the shipped profiles.
    mc = load_model(None).config
    resolved = {(mode, ratio, rule, retention): EngineConfig(
        mode=mode, ratio=ratio, scoring_rule=rule, retention=retention,
        chunk_size=128).resolve(mc, is_embedded=True).scoring_rule
        for mode, ratio, rule, retention in [
            ("tangram", 0.25, "auto", "chunk"), ("tangram", 0.5, "auto", "chunk"),
            ("dynamic", 0.25, "auto", "auto"), ("tangram", 0.25, "window", "chunk"),
            ("tangram", 0.25, "auto", "auto"), ("tangram", 0.5, "auto", "auto")]}
    assert list(resolved.values()) == ["window+keydiff", "window", "window", "window",
                                       "window", "window"]
    assert EngineConfig().scoring_rule == "auto"


def test_the_keydiff_rule_gives_each_ranking_its_half():
    """window+keydiff: a head's kept tokens hold the top of the window's SnapKV ranking and the
    top of KeyDiff's (query-free) ranking, about half of the count each."""
    from tangram_jax.compression.scorers import keydiff
    q, k, window = _planted_chunk()
    t, tail, count = 64, 8, 16
    scores = chunk_scores("snapkv", window, q, k, k, jnp.int32(t), jnp.int32(tail),
                          jnp.int32(0), q_per_kv=2, rule="window+keydiff")
    sources, counts = kept_token_sources(scores, jnp.asarray([tail + count], jnp.int32),
                                         jnp.int32(t), 1)
    kept = set(np.asarray(sources[0, :counts[0]]).tolist())
    snap = np.asarray(chunk_scoring.snapkv_chunk_scores(window, t, 2))[0, :t - tail]
    kd = np.asarray(keydiff(jnp.moveaxis(q, 0, 1), jnp.moveaxis(k, 0, 1), jnp.moveaxis(k, 0, 1),
                            q_per_kv=2))[0, :t - tail]
    half = count // 2
    assert set(np.argsort(-snap, kind="stable")[:half - 1].tolist()) <= kept
    assert set(np.argsort(-kd, kind="stable")[:half - 1].tolist()) <= kept
    assert not set(np.argsort(-kd, kind="stable")[:count].tolist()) <= kept


@pytest.mark.parametrize("rule", ["window+context", "window+keydiff"])
def test_the_runner_serves_the_scoring_rule(rule):
    """The runner's prefill keeps, per head, the top of `chunk_scores` under the configured rule
    (layer 0 of a first chunk: its window's attention is a plain causal softmax), the layout's
    count, and not what the window rule keeps."""
    from flax import nnx

    from tangram_jax.compression.scorers import causal_attention_probs
    from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
    from tangram_jax.kv_layout import KVLayout
    from tangram_jax.models.config import ModelConfig
    from tangram_jax.models.decoder import Decoder
    from tangram_jax.scheduler.kv_cache_manager import KVCacheManager

    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         attention_bias=False, qk_norm=False, bos_token_id=None,
                         eos_token_ids=(0,))
    t = 64
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, group_size=1, page_size=4,
                      chunk_size=t, head_perm=np.tile(np.arange(2), (2, 1)),
                      group_budgets=np.full((2, 2), 0.25))
    tokens = np.random.default_rng(5).integers(1, 97, t)

    def kept_rows(scoring_rule):
        manager = KVCacheManager(layout, 128, 2, 32, model_kv_shape=(2, 2, 8))
        runner = ModelRunner(Decoder(config, rngs=nnx.Rngs(0)), config, layout, 128,
                             manager.block_tables.shape,
                             runner_config=RunnerConfig(obs_window=4, scoring_rule=scoring_rule))
        slot = manager.allocate_slot()
        assert manager.reserve(slot, t)
        runner.update_block_tables(*manager.take_table_updates())
        _, kept = runner.prefill_chunk(tokens, 0, slot, manager.lengths[slot])
        np.testing.assert_array_equal(kept, layout.chunk_keep_counts(t, 0))
        pages = np.asarray(runner.k_pages)
        return [pages[manager.block_tables[slot, 0, h]][:, 0].reshape(-1, 8)[:int(kept[0, h])]
                for h in range(2)]

    model = Decoder(config, rngs=nnx.Rngs(0))
    q, k, v = model.layers[0].qkv(model.embed(jnp.asarray(tokens, jnp.int32)[None]),
                                  jnp.arange(t, dtype=jnp.int32)[None])
    q, k, v = q[0], k[0], v[0]
    window = causal_attention_probs(jnp.moveaxis(q[-4:], 0, 1), jnp.moveaxis(k, 0, 1), 2)
    scores = chunk_scores("snapkv", window, q, k, v, jnp.int32(t), jnp.int32(0), jnp.int32(0),
                          q_per_kv=2, rule=rule)
    got, plain = kept_rows(rule), kept_rows("window")
    for h in range(2):
        top = np.sort(np.argsort(-np.asarray(scores[h]), kind="stable")[:len(got[h])])
        np.testing.assert_allclose(got[h], np.asarray(k)[top, h], rtol=1e-4, atol=1e-5)
    assert any(a.shape != b.shape or not np.allclose(a, b) for a, b in zip(got, plain))


def test_a_whole_turn_keeps_the_sentence_around_what_its_question_attends_to():
    """Retention "turn" pools the question window's mass over `TURN_POOL_KERNEL` keys: the
    words a question matches bring the value a few tokens after them (a fact's digits), which a
    later turn may ask, and nothing else outranks that span."""
    from tangram_jax.compression.chunk_scoring import TURN_POOL_KERNEL, turn_scores
    s, peak, half = 96, 40, TURN_POOL_KERNEL // 2
    rng = np.random.default_rng(0)
    mass = jnp.asarray(rng.uniform(0, 1e-3, (2, s)).astype(np.float32)).at[:, peak].set(1.0)
    keys = jnp.asarray(rng.normal(size=(2, s, 8)).astype(np.float32))
    candidate = jnp.ones((2, s), bool)
    protected = jnp.zeros((2, s), bool).at[:, -4:].set(True)
    scores = np.asarray(turn_scores(mass, keys, candidate, protected, method="snapkv",
                                    rule="window"))
    assert half >= 7   # wider than the per-chunk rule's kernel of 7
    for head in scores:
        top = np.argsort(-head, kind="stable")[4:4 + TURN_POOL_KERNEL]   # after the tail
        assert sorted(top.tolist()) == list(range(peak - half, peak + half + 1))
