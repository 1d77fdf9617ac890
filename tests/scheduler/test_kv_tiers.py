"""Precision tiers (`kv_layout.TieredLayout`): the tiered retained-count formula, and the
KV-cache manager reserving exactly it per (layer, group, tier)."""

import math

import numpy as np
import pytest

from tangram_jax.kv_layout import KVLayout, TieredLayout, chunk_keep_count, pages_for
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager


def _layout(tail_rule="window", tail_window=5, chunk=16):
    rng = np.random.default_rng(3)
    layers, heads, g = 3, 4, 2
    budgets = np.round(rng.uniform(0.1, 1.0, (layers, heads // g)), 3)
    budgets[0, 0] = 1.0
    base = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=8, group_size=g,
                    page_size=4, chunk_size=chunk,
                    head_perm=np.tile(np.arange(heads), (layers, 1)), group_budgets=budgets,
                    tail_rule=tail_rule, tail_window=tail_window)
    high = np.round(rng.uniform(0, 1, budgets.shape), 3)
    high[1, 0], high[2, 1] = 0.0, 1.0
    return TieredLayout(base, high)


def _by_chunks(tiered, n):
    """The tier rule chunk by chunk, as the prefill writes them (independent of the class's
    closed form): [layers, groups, 2] (high, low)."""
    base = tiered.base
    out = np.zeros((*base.group_budgets.shape, 2), np.int64)
    for start in range(0, n, base.chunk_size):
        length = min(base.chunk_size, n - start)
        p = base.chunk_protected(n, start, length)
        kept = chunk_keep_count(base.group_budgets, length - p)
        for idx in np.ndindex(kept.shape):
            k = int(kept[idx])
            high = min(k, max(0, math.ceil(tiered.high_share[idx] * k - 1e-6)))
            out[idx] += (high + p, k - high)
    return out


@pytest.mark.parametrize("tail", [("window", 5), ("final_chunk", 0), ("none", 0)])
def test_tier_counts_follow_the_chunk_rule_and_sum_to_the_budget(tail):
    tiered = _layout(*tail)
    for n in (0, 1, 5, 15, 16, 17, 40, 64, 100):
        counts = tiered.retained_counts(n)
        assert counts.shape == (3, 4)
        split = counts.reshape(3, 2, 2)
        np.testing.assert_array_equal(split, _by_chunks(tiered, n))
        np.testing.assert_array_equal(split.sum(-1), tiered.base.retained_counts(n))
    # Share 0: the low tier takes every compressed token, share 1: none.
    counts = tiered.retained_counts(100).reshape(3, 2, 2)
    tail_len = tiered.base.protected_tail(100)
    assert counts[1, 0, 0] == tail_len and counts[2, 1, 1] == 0


def test_tiered_layout_rejects_bad_shares():
    base = _layout().base
    with pytest.raises(ValueError, match="high_share has shape"):
        TieredLayout(base, np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"high_share must lie in \[0, 1\]"):
        TieredLayout(base, np.full((3, 2), 1.5))
    with pytest.raises(ValueError, match="precision must be one of"):
        TieredLayout(base, np.zeros((3, 2)), precision="k8v8-k2v2")


def test_manager_reserves_each_tier_exactly_and_decode_fills_the_high_tier():
    tiered = _layout()
    manager = KVCacheManager(tiered, num_pages=(200, 200), max_seqs=2, max_pages_per_group=40,
                             model_kv_shape=(3, 4, 8))
    assert manager.lengths.shape == (3, 3, 4)              # [rows, layers, groups * tiers]
    slot = manager.allocate_slot()
    turn = 70
    assert manager.reserve(slot, turn)
    want = _by_chunks(tiered, turn).reshape(3, 4)
    np.testing.assert_array_equal(manager.reserved_lengths[slot], want)
    np.testing.assert_array_equal(manager.table.num_pages[slot], pages_for(want, 4))
    # The prefill's pieces (chunk boundaries) commit exactly the reservation.
    for start in range(0, turn, 32):
        manager.commit_prefill(slot, min(32, turn - start), start=start, turn_len=turn)
    np.testing.assert_array_equal(manager.lengths[slot], want)
    # Decode tokens go to the high tier only.
    for _ in range(6):
        assert manager.grow_for_decode(np.array([slot])).all()
    grown = manager.lengths[slot] - want
    assert (grown[:, 0::2] == 6).all() and (grown[:, 1::2] == 0).all()
    np.testing.assert_array_equal(manager.table.num_pages[slot],
                                  pages_for(manager.lengths[slot], 4))
    # A second turn on top: the reservation grows by the formula of the new tokens.
    before = manager.lengths[slot].copy()
    assert manager.reserve(slot, 23)
    np.testing.assert_array_equal(manager.reserved_lengths[slot],
                                  before + _by_chunks(tiered, 23).reshape(3, 4))
    manager.free(slot)
    assert [p.num_used for p in manager.pools] == [0, 0]


# ----- calibration and profile --------------------------------------------------------------

def test_high_tier_share_ranks_within_the_retained_set():
    import jax.numpy as jnp
    from tangram_jax.compression.calibration import high_tier_share
    # Head 0 keeps its top 4 (10, 5, 1, 1): importance above the set's floor 1 is 9, 4, 0, 0;
    # 0.9 of 13 needs the top 2 -> 1/2. Its dropped tokens (0.5, 0) do not count.
    # Head 1: all retained scores equal -> 1. Head 2: keeps nothing -> 1. Head 3: one token
    # carries everything -> 1/3 (shift and scale of the scores do not matter).
    scores = jnp.array([[1, 10, 0.5, 5, 1, 0],
                        [2, 2, 2, 2, 2, 2],
                        [3, 1, 2, 0, 0, 0],
                        [-7, 93, -7, -7.5, -8, -8]], jnp.float32)
    counts = jnp.array([4, 3, 0, 3])
    shares = np.asarray(high_tier_share(scores, counts, 0.9))
    np.testing.assert_allclose(shares, [0.5, 1.0, 1.0, 1 / 3], rtol=1e-6)
    assert float(high_tier_share(scores, counts, 1.0)[0]) == 0.5     # the floor carries 0
    assert float(high_tier_share(scores, counts, 0.5)[0]) == 0.25


def _tiered_run():
    from tangram_jax.compression.calibration import CalibrationRun
    rng = np.random.default_rng(5)
    retention = np.clip(rng.uniform(0.1, 0.6, (1, 4, 3)) + rng.normal(0, 0.02, (10, 4, 3)),
                        0.01, 1)
    shares = np.clip(rng.uniform(0.1, 0.7, (1, 4, 3)) + rng.normal(0, 0.05, (10, 4, 3)), 0, 1)
    return CalibrationRun("snapkv", 0.2, {0.3: retention}, ("a",) * 10, (100,) * 10,
                          high_share={0.3: shares}, tier_mass=0.9)


def test_profile_carries_tier_budgets_versioned_and_validated(tmp_path):
    from tangram_jax.compression.calibration import CalibrationRun, profile_from_run
    from tangram_jax.compression.profile import BudgetProfile, ProfileError, TierBudgets
    fingerprint = dict(architecture="llama", num_layers=4, num_kv_heads=3, head_dim=8,
                       name="m")
    run = _tiered_run()
    run.save(tmp_path / "run.npz")
    again = CalibrationRun.load(tmp_path / "run.npz")
    np.testing.assert_array_equal(again.high_share[0.3], run.high_share[0.3])
    assert again.tier_mass == 0.9
    profile = profile_from_run(run, 0.3, model=fingerprint, group_size=3, tiers="k8v4-k4v2")
    shares = run.high_share[0.3]
    np.testing.assert_allclose(profile.tiers.high_share,
                               np.minimum(1, shares.mean(0) + 2 * shares.std(0)))
    path = tmp_path / "p.json"
    profile.save(path)
    import json
    assert json.loads(path.read_text())["format_version"] == 2
    loaded = BudgetProfile.load(path, expected_fingerprint=fingerprint)
    np.testing.assert_allclose(loaded.tiers.high_share, profile.tiers.high_share)
    # A group's share is its members' max; the tiered layout reserves with it.
    np.testing.assert_allclose(loaded.group_high_share(),
                               profile.tiers.high_share.max(axis=1, keepdims=True))
    tiered = loaded.to_tiered_layout(page_size=4, chunk_size=16)
    assert tiered.num_groups == 2 and tiered.tiers == ("k8v4", "k4v2")
    np.testing.assert_array_equal(tiered.retained_counts(50).reshape(4, 1, 2).sum(-1),
                                  tiered.base.retained_counts(50))
    # Regrouping keeps the per-head tiers.
    g1 = loaded.regroup(1)
    np.testing.assert_allclose(g1.group_high_share(),
                               np.take_along_axis(g1.tiers.high_share, g1.head_perm, 1))
    # Without tiers: version 1, as before; asking for tiers of a run without them fails.
    plain = profile_from_run(run, 0.3, model=fingerprint, group_size=3)
    plain.save(path)
    assert json.loads(path.read_text())["format_version"] == 1
    with pytest.raises(ProfileError, match="no precision tiers"):
        plain.group_high_share()
    untiered = CalibrationRun("snapkv", 0.2, run.retention, run.tasks, run.lengths)
    with pytest.raises(ValueError, match="tier_mass"):
        profile_from_run(untiered, 0.3, model=fingerprint, tiers="k8v4-k4v2")
    # Validation: version and section must agree, values in range, shapes right.
    d = loaded.to_dict()
    for change, message in (
            (lambda d: d.update(format_version=1), "has no a 'tiers'|format_version 1"),
            (lambda d: d.pop("tiers"), "needs a 'tiers'"),
            (lambda d: d["tiers"].update(precision="k8v8-k1v1"), "precision"),
            (lambda d: d["tiers"].update(mass=0), "mass"),
            (lambda d: d["tiers"]["high_share"][0].__setitem__(0, 1.5), r"high_share\[0, 0\]"),
            (lambda d: d["tiers"].update(std=[[0.1]]), "std has shape"),
            (lambda d: d.update(format_version=3), "unknown profile format_version 3")):
        bad = json.loads(json.dumps(d))
        change(bad)
        with pytest.raises(ProfileError, match=message):
            BudgetProfile.from_dict(bad)
    assert isinstance(loaded.tiers, TierBudgets)


@pytest.mark.slow
def test_calibration_measures_tier_shares_on_the_embedded_model(tmp_path):
    from tangram_jax.compression.calibration import chat_tokenizer, run_calibration
    from tangram_jax.compression.pilot_data import build_pilot_samples
    from tangram_jax.models.registry import load_model
    smollm2 = load_model(None)
    samples = build_pilot_samples(2, chat_tokenizer(smollm2.tokenizer), lengths=(256,),
                                  tasks=("passkey", "sharegpt"), seed=0)
    run = run_calibration(smollm2.model, smollm2.config, samples, [0.25], tier_mass=0.9)
    shares = run.high_share[0.25]
    assert shares.shape == (2, smollm2.config.num_layers, smollm2.config.num_kv_heads)
    assert (shares > 0).all() and (shares <= 1).all()
    # Attention is concentrated: most heads need well under all their retained tokens to hold
    # 90% of the retained importance, and heads differ.
    assert np.median(shares) < 0.9 and shares.std() > 0.01
    # The CLI makes a tiered profile from the saved run without running the model again.
    import json
    from tangram_jax.cli import main
    from tangram_jax.compression.profile import BudgetProfile
    run.save(tmp_path / "run.npz")
    out = tmp_path / "tiered.json"
    assert main(["calibrate", "--ratio", "0.25", "--from-run", str(tmp_path / "run.npz"),
                 "--tiers", "k8v4-k4v2", "--group-size", "3", "--out", str(out)]) == 0
    profile = BudgetProfile.load(out)
    assert json.loads(out.read_text())["format_version"] == 2
    np.testing.assert_allclose(profile.tiers.mean, shares.mean(0))
    assert profile.to_tiered_layout(16, 128).num_groups == 2
