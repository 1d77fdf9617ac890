"""benchmarks/tp_outputs_gpu.py's comparison: where a tensor-parallel row first leaves the
one-device row, and the one-device margin there (a near-tie or not); bad arguments are one
error naming the flag."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("tp_outputs_gpu",
                                                  ROOT / "benchmarks" / "tp_outputs_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(tokens, chosen, margin):
    return dict(tokens=tokens, chosen=chosen, margin=margin)


def test_compare_finds_the_first_divergence_and_its_margin():
    compare = _module().compare
    one = [_row([1, 2, 3], [-0.1, -0.2, -0.3], [0.5, 0.01, 2.0]),
           _row([4, 5, 6], [-0.1, -0.1, -0.1], [1.0, 1.0, 1.0])]
    many = [_row([1, 7, 3], [-0.12, -0.9, -0.3], [0.5, 0.0, 2.0]),
            _row([4, 5, 6], [-0.1, -0.15, -0.1], [1.0, 1.0, 1.0])]
    report = compare(one, many)
    assert (report["rows"], report["rows_equal"]) == (2, 1)
    assert report["diverged"] == [dict(row=0, step=1, margin_one_device=0.01)]
    # Log-probs are compared only before a row's divergence (after it the tokens differ).
    assert report["max_chosen_logprob_diff"] == pytest.approx(0.05)
    assert report["median_margin"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, words", [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--modes", "full,ragged"], "--modes: 'ragged' is not one of full, tangram, dynamic"),
])
def test_bad_arguments_are_one_error_naming_the_flag(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tp_outputs_gpu.py", *argv])
    with pytest.raises(SystemExit) as e:
        _module().main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
