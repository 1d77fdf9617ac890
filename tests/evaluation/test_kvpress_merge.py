"""`benchmarks/kvpress_accuracy.py --merge`: the parts of one kvpress run (presses and shards side
by side, some cut short) add up to the table one process would have written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_TASKS = _ROOT / "benchmarks" / "results" / "accuracy_tasks_long.jsonl"


@pytest.fixture(scope="module")
def kvp():
    spec = importlib.util.spec_from_file_location("kvpress_accuracy",
                                                  _ROOT / "benchmarks" / "kvpress_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvpress_accuracy"] = module
    spec.loader.exec_module(module)
    return module


def _part(kvp, samples, press, answers, complete=True):
    """A part as `write` leaves it: `answers[(label, sample id, turn)] = correct`."""
    specs = [kvp.PressSpec("full", 1.0), kvp.PressSpec(press, 0.5)]
    judged = {s.label: {} for s in specs}
    for (label, sid, turn), ok in answers.items():
        judged[label][(sid, turn)] = kvp._Judged(ok, None if label == "full" else 1.0)
    return {"device": "gpu: test", "git_revision": "abc", "command": f"--presses {press}",
            "seconds": 1.0, "complete": complete,
            "config": {"tasks_file": str(_TASKS), "max_tokens": 16, "no_kl": True},
            "specs": [{"label": s.label, "mode": s.mode, "ratio": s.ratio,
                       "question_aware": s.question_aware} for s in specs],
            "answers": [{"label": label, "sample": sid, "turn": turn,
                         **kvp.dataclasses.asdict(j)}
                        for label, rows in judged.items() for (sid, turn), j in rows.items()]}


def _all_turns(samples, label, ok):
    return {(label, s.id, t): ok(s, t) for s in samples for t in range(len(s.turns))}


def test_shards_add_up_and_a_cut_short_part_counts_what_it_served(kvp):
    samples = kvp.read_jsonl(_TASKS)
    facts = [s for s in samples if s.task == "long_facts"][:4]
    def full_ok(s, t):
        return t != 1
    shard0 = _part(kvp, facts[0::2], "snapkv",
                   {**_all_turns(facts[0::2], "full", full_ok),
                    **_all_turns(facts[0::2], "snapkv@0.5", lambda s, t: t == 0)})
    # Cut short: the second shard finished one of its two samples.
    shard1 = _part(kvp, facts[1::2], "snapkv",
                   {**_all_turns(facts[1:2], "full", full_ok),
                    **_all_turns(facts[1:2], "snapkv@0.5", lambda s, t: False)}, complete=False)
    merged = kvp.merge_parts([shard0, shard1])
    rows = {(r["mode"], r["task"]): r for r in merged["results"]}
    turns = len(facts[0].turns)
    assert rows["full", "long_facts"]["samples"] == 3
    assert rows["full", "long_facts"]["n"] == 3 * turns
    assert rows["full", "long_facts"]["correct"] == 3 * (turns - 1)
    assert rows["snapkv", "long_facts"]["correct"] == 2        # turn 1 of the first shard's two
    assert rows["snapkv", "long_facts"]["followup"]["correct"] == 0
    assert merged["complete"] is False and len(merged["parts"]) == 2
    # The merge is itself a part: merged again with nothing new, it counts the same.
    again = kvp.merge_parts([merged])
    assert [(r["mode"], r["task"], r["n"], r["correct"]) for r in again["results"]] == \
        [(r["mode"], r["task"], r["n"], r["correct"]) for r in merged["results"]]


def test_full_kv_answering_one_sample_two_ways_is_refused(kvp):
    facts = [s for s in kvp.read_jsonl(_TASKS) if s.task == "long_facts"][:1]
    a = _part(kvp, facts, "snapkv", _all_turns(facts, "full", lambda s, t: True))
    b = _part(kvp, facts, "kvzip", _all_turns(facts, "full", lambda s, t: t > 0))
    with pytest.raises(ValueError, match="parts disagree on full"):
        kvp.merge_parts([a, b])
    b["git_revision"] = "def"
    with pytest.raises(ValueError, match="git_revision"):
        kvp.merge_parts([a, b])
