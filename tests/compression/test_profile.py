"""Budget profiles: round trip, layout conversion, rejection of corrupt or mismatched files;
budget math; shipped profiles; the regularity report."""

import json

import numpy as np
import pytest

from tangram_jax.compression.calibration import (CalibrationRun, profile_from_run,
                                                 rescale_to_ratio, static_budgets)
from tangram_jax.compression.profile import (BudgetProfile, ProfileError, shipped_profile,
                                             shipped_profile_path)
from tangram_jax.compression.report import (leave_one_out_overflow_rate, overflow_rate, retention_boxplot,
                                            spearman_across_samples, spearman_across_tasks)
from tangram_jax.kv_layout import KVLayout

FINGERPRINT = dict(architecture="llama", num_layers=4, num_kv_heads=6, head_dim=16, name="tiny")
SMOLLM2 = dict(architecture="llama", num_layers=30, num_kv_heads=3, head_dim=64, num_heads=9,
               vocab_size=49152)


def _profile(group_size=2, grouping="budget", seed=0):
    rng = np.random.default_rng(seed)
    mean = rng.uniform(0.1, 0.6, size=(4, 6))
    std = rng.uniform(0.0, 0.1, size=(4, 6))
    return BudgetProfile.from_budgets(model=FINGERPRINT, method="snapkv", rho=0.3, lambda_=2.0,
                                      mean=mean, std=std, budget=static_budgets(mean, std, 2.0),
                                      group_size=group_size, grouping=grouping,
                                      metadata={"samples": 3})


def test_round_trip_and_layout(tmp_path):
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    q = BudgetProfile.load(path, expected_fingerprint=FINGERPRINT)
    for name in ("mean", "std", "budget", "head_perm", "group_budgets"):
        np.testing.assert_array_equal(getattr(p, name), getattr(q, name))
    assert (q.method, q.rho, q.lambda_, q.group_size, q.metadata) == ("snapkv", 0.3, 2.0, 2, {"samples": 3})
    layout = q.to_layout(page_size=16, chunk_size=64)
    assert isinstance(layout, KVLayout)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.group_size,
            layout.num_groups) == (4, 6, 16, 2, 3)
    np.testing.assert_array_equal(layout.head_perm, p.head_perm)
    members = np.take_along_axis(p.budget, p.head_perm.astype(int), axis=1).reshape(4, 3, 2)
    np.testing.assert_allclose(layout.group_budgets, members.max(axis=2))


def test_regroup():
    p = _profile(group_size=1)
    q = p.regroup(3, "adjacent")
    assert q.group_size == 3 and q.grouping == "adjacent"
    np.testing.assert_array_equal(q.head_perm, np.tile(np.arange(6), (4, 1)))
    np.testing.assert_allclose(q.group_budgets, p.budget.reshape(4, 2, 3).max(axis=2))
    assert p.regroup(3).group_budgets.sum() <= q.group_budgets.sum()
    with pytest.raises(ValueError, match="does not divide"):
        p.regroup(4)


def _corrupt(tmp_path, mutate):
    d = _profile().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(format_version=99), "unknown profile format_version 99"),
    (lambda d: d.pop("format_version"), "unknown profile format_version None"),
    (lambda d: d["heads"].update(budget=d["heads"]["budget"][:-1]), r"budget has shape \(3, 6\)"),
    (lambda d: d["heads"].update(mean=[r[:-1] for r in d["heads"]["mean"]]), r"mean has shape \(4, 5\)"),
    (lambda d: d["groups"].update(group_budgets=[r + [0.5] for r in d["groups"]["group_budgets"]]),
     "group_budgets has shape"),
    (lambda d: d["heads"]["budget"][1].__setitem__(2, 1.5), r"budget must lie in \(0, 1\]"),
    (lambda d: d["heads"]["budget"][0].__setitem__(0, 0.0), r"budget must lie in \(0, 1\]"),
    (lambda d: d["heads"]["std"][0].__setitem__(0, float("nan")), "NaN"),
    (lambda d: d.update(rho=0.0), r"rho must lie in \(0, 1\]"),
    (lambda d: d.update(group_size=4), "group_size 4 must be a positive divisor"),
    (lambda d: d["groups"]["head_perm"][0].__setitem__(0, d["groups"]["head_perm"][0][1]),
     "not a permutation"),
    (lambda d: d["groups"]["group_budgets"][0].__setitem__(0, 0.99), "not the max"),
    (lambda d: d.pop("heads"), "missing field 'heads'"),
    (lambda d: d["model"].pop("head_dim"), "fingerprint lacks"),
    (lambda d: d["heads"].update(mean="oops"), "mean"),
    (lambda d: d.update(grouping="random"), "grouping 'random'"),
])
def test_corrupt_profiles_are_rejected(tmp_path, mutate, message):
    with pytest.raises(ProfileError, match=message):
        BudgetProfile.load(_corrupt(tmp_path, mutate))


def test_malformed_json_and_missing_file(tmp_path):
    path = tmp_path / "trunc.json"
    path.write_text(json.dumps(_profile().to_dict())[:200])
    with pytest.raises(ValueError, match="not valid JSON"):
        BudgetProfile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        BudgetProfile.load(path)
    with pytest.raises(ValueError, match="cannot read profile"):
        BudgetProfile.load(tmp_path / "absent.json")


def test_mismatched_model_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    for key, value in (("num_layers", 5), ("num_kv_heads", 3), ("head_dim", 64),
                       ("architecture", "qwen2")):
        with pytest.raises(ProfileError, match=f"different model.*{key}"):
            BudgetProfile.load(path, expected_fingerprint=dict(FINGERPRINT, **{key: value}))


def test_budget_math():
    mean = np.array([[0.2, 0.5, 0.9]])
    std = np.array([[0.05, 0.1, 0.2]])
    np.testing.assert_allclose(static_budgets(mean, std, 2.0), [[0.3, 0.7, 1.0]])
    b = rescale_to_ratio(np.array([[0.3, 0.7, 1.0], [0.1, 0.1, 0.4]]), 0.5)
    np.testing.assert_allclose(b.mean(axis=1), [0.5, 0.5])
    assert (b > 0).all() and (b <= 1).all()
    clipped = rescale_to_ratio(np.array([[0.9, 0.1, 0.1]]), 0.8)  # water filling past the clip
    np.testing.assert_allclose(clipped.mean(), 0.8)
    assert clipped.max() <= 1.0
    with pytest.raises(ValueError, match="lambda"):
        static_budgets(mean, std, -1.0)


def _run(seed=0):
    rng = np.random.default_rng(seed)
    head_level = rng.uniform(0.1, 0.6, size=(1, 5, 3))
    retention = np.clip(head_level + rng.normal(0, 0.02, size=(12, 5, 3)), 0.01, 1)
    tasks = tuple(["a", "b", "c"] * 4)
    return CalibrationRun("snapkv", 0.2, {0.3: retention}, tasks, tuple([100] * 12))


def test_report_figures(tmp_path):
    run = _run()
    r = run.retention[0.3]
    stable = spearman_across_samples(r)
    assert stable["global_"] > 0.9 and stable["within_layer"] > 0.7
    shuffled = np.random.default_rng(1).permuted(r.reshape(12, -1), axis=1).reshape(r.shape)
    assert abs(spearman_across_samples(shuffled)["global_"]) < 0.3
    assert spearman_across_tasks(r, run.tasks)["tasks"] == ["a", "b", "c"]
    mean, std = run.stats(0.3)
    assert overflow_rate(r, mean) > 0.2  # half of the inputs exceed the mean
    assert overflow_rate(r, np.ones_like(mean)) == 0.0
    assert leave_one_out_overflow_rate(r, 100.0) == 0.0
    assert 0.3 < leave_one_out_overflow_rate(r, 0.0) < 0.7
    profile = profile_from_run(run, 0.3, model=dict(FINGERPRINT, num_layers=5, num_kv_heads=3),
                               group_size=3)
    assert profile.metadata["samples"] == 12 and profile.group_budgets.shape == (5, 1)
    assert profile.metadata["device"].startswith("CPU")   # where the calibration ran
    png = tmp_path / "box.png"
    retention_boxplot(r, profile.budget, 0.3, png, layers=[0, 4])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run.save(tmp_path / "run.npz")
    again = CalibrationRun.load(tmp_path / "run.npz")
    np.testing.assert_array_equal(again.retention[0.3], r)
    assert again.tasks == run.tasks


@pytest.mark.parametrize("rho", [0.5, 0.25])
@pytest.mark.parametrize("group_size", [1, 3])
def test_shipped_profiles(rho, group_size):
    p = shipped_profile(rho, group_size, expected_fingerprint=SMOLLM2)
    assert (p.rho, p.group_size, p.method, p.metadata["samples"]) == (rho, group_size, "snapkv", 50)
    assert p.group_budgets.shape == (30, 3 // group_size)
    # Calibrated at rho: the heads' mean retention averages rho (up to the ceil of the top-k size).
    assert abs(p.mean.mean() - rho) < 0.01
    assert (p.budget >= p.mean).all()
    layout = p.to_layout(page_size=16, chunk_size=256)
    assert layout.compresses
    assert shipped_profile_path(rho, group_size).exists()


def test_shipped_profile_lookup_errors():
    with pytest.raises(ValueError, match="no shipped profile for rho=0.1"):
        shipped_profile(0.1, 1)
    with pytest.raises(ProfileError, match="different model"):
        shipped_profile(0.5, 1, expected_fingerprint=dict(SMOLLM2, num_layers=24))
