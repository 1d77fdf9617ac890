"""The accuracy harness: task generation, answer judging, confidence intervals, KL under
top-k coarse-graining, the uniform profile, and one tiny end-to-end run on the real model."""

import json
import math

import numpy as np
import pytest

from tangram_jax.compression.profile import BudgetProfile, ProfileError
from tangram_jax.evaluation import tasks as T
from tangram_jax.evaluation.harness import ModeSpec, mode_specs, summarise, _Judged
from tangram_jax.evaluation.scoring import (TopKDistribution, is_correct, kl_from_reference,
                                            kl_full_vocabulary, normalise, token_agreement,
                                            wilson_interval)


# ----- tasks ---------------------------------------------------------------------------------

def test_tasks_are_deterministic_and_hold_their_answers(tmp_path):
    samples = T.generate_all(samples=3, seed=7)
    assert [s.task for s in samples] == [t for t in T.TASKS for _ in range(3)]
    again = T.generate_all(samples=3, seed=7)
    assert samples == again
    assert T.generate_all(samples=3, seed=8) != samples
    for s in samples:
        if s.task == "variable_tracking":
            # the asked chain starts from its value: "X = value"
            assert f"= {s.turns[0].answer}\n" in s.context + "\n"
        else:
            for turn in s.turns:
                assert turn.answer in s.context, (s.id, turn)
    multi = [s for s in samples if s.task == "multi_turn"]
    assert all(len(s.turns) == 3 and len({t.answer for t in s.turns}) == 3 for s in multi)
    path = tmp_path / "t.jsonl"
    T.write_jsonl(samples, path)
    assert T.read_jsonl(path) == samples
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"task", "id", "seed", "context", "turns"}
    assert set(first["turns"][0]) == {"question", "answer", "answer_prefix"}
    # files written before answer prefixes existed still read (with no prefix)
    del first["turns"][0]["answer_prefix"]
    assert T.Sample.from_json(first).turns[0].answer_prefix == ""
    # every question opens its answer with a prefix that names what is asked, never the answer
    for s in samples:
        for turn in s.turns:
            assert turn.answer_prefix and turn.answer not in turn.answer_prefix
            if s.task == "multi_turn":
                person = turn.question.split("does ")[1].split(" live")[0]
                assert turn.answer_prefix == f"{person} lives in room"
                assert f"{person} lives in room {turn.answer}." in s.context


def test_variable_tracking_chain_resolves_to_the_answer():
    for i in range(10):
        s = T.generate("variable_tracking", i)
        assign = {}
        for line in s.context.splitlines():
            if " = " in line and line.split(" = ")[0] in T._VARIABLES:
                name, value = line.split(" = ")
                assign[name] = assign.get(value, value)   # statements come in chain order
        asked = s.turns[0].question.split("value of ")[-1].split("?")[0]
        assert assign[asked] == s.turns[0].answer
        assert s.turns[0].answer_prefix == f"The value of {asked} is"


def test_task_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        T.generate("nope", 0)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        T.generate_all(samples=0)
    with pytest.raises(ValueError, match=r"kv pairs must lie in \[1, 64\], got 65"):
        T.generate("kv_retrieval", 0, sizes=T.TaskSizes(kv_pairs=65))
    # no two keys of a sample share a word
    keys = [line.split("the key ")[1].split(" is")[0] for line in
            T.generate("kv_retrieval", 0).context.splitlines()[2:]]
    words = [w for k in keys for w in k.split("-")]
    assert len(keys) == 64 and len(set(words)) == len(words)



def test_kv_pairs_in_essays_hold_every_pair_and_the_asked_value():
    import random
    import re
    sizes = T.TaskSizes(kv_pairs=8, kv_style="essay")
    for i in range(5):
        s = T.generate("kv_retrieval", i, sizes=sizes)
        pairs = dict(re.findall(r"The value of the key ([a-z]+-[a-z]+) is (\d+)\.", s.context))
        asked = s.turns[0].question.split("key ")[1].split("?")[0]
        assert len(pairs) == 8 and pairs[asked] == s.turns[0].answer
        assert len(s.context) > 4000 and s == T.generate("kv_retrieval", i, sizes=sizes)
    with pytest.raises(ValueError, match="kv style must be one of"):
        T.kv_retrieval(random.Random(0), 4, "table")
    with pytest.raises(ValueError, match="needs the essays"):
        T.kv_retrieval(random.Random(0), 4, "essay")

# ----- scoring -------------------------------------------------------------------------------

def test_answers_are_judged_by_normalised_containment_on_word_boundaries():
    assert normalise("  The Pass-Key is: 71432! ") == "the pass key is 71432"
    assert is_correct("71432", "The pass key is 71432.")
    assert is_correct("4821", "4821")
    assert not is_correct("482", "4821")
    assert not is_correct("4821", "48 21")
    with pytest.raises(ValueError, match="empty"):
        is_correct("!!", "x")


def test_wilson_interval_matches_the_formula_and_edges():
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_token_agreement():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3]) == 0.5
    assert token_agreement([], []) == 1.0


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_kl_top_k_is_exact_for_the_full_vocabulary_and_a_lower_bound_below_it():
    rng = np.random.default_rng(0)
    ref = _log_softmax(rng.normal(size=(5, 300)) * 3)
    mode = _log_softmax(np.log(np.exp(ref) + 0.01 * rng.random((5, 300))))
    exact = kl_full_vocabulary(ref, mode)
    # by hand for one row
    p = np.exp(ref[2])
    assert exact[2] == pytest.approx(float((p * (ref[2] - mode[2])).sum()), rel=1e-12)
    whole = kl_from_reference(TopKDistribution.from_logprobs(ref, 300), mode)
    np.testing.assert_allclose(whole, exact, rtol=1e-6, atol=1e-12)
    for k in (1, 10, 100):
        approx = kl_from_reference(TopKDistribution.from_logprobs(ref, k), mode)
        assert (approx <= exact + 1e-12).all()
    # a peaked reference (a small model answering greedily) is captured by a small k
    peaked = _log_softmax(rng.normal(size=(4, 300)) + np.eye(4, 300) * 30)
    peaked_mode = _log_softmax(np.log(np.exp(peaked) * (1 + 0.3 * rng.random((4, 300)))))
    dist = TopKDistribution.from_logprobs(peaked, 16)
    assert dist.uncovered_mass().max() < 1e-6
    np.testing.assert_allclose(kl_from_reference(dist, peaked_mode),
                               kl_full_vocabulary(peaked, peaked_mode), rtol=1e-3, atol=1e-9)
    assert (kl_from_reference(dist, peaked) < 1e-9).all()    # identical distributions: 0


def test_kl_rejects_mismatched_positions():
    dist = TopKDistribution.from_logprobs(_log_softmax(np.zeros((3, 8))), 4)
    with pytest.raises(ValueError, match="3 positions"):
        kl_from_reference(dist, np.zeros((2, 8)))


# ----- harness pieces ------------------------------------------------------------------------

def test_mode_specs_and_labels():
    specs = mode_specs(["full", "tangram", "dynamic", "uniform"], [1.0, 0.5, 0.25])
    assert [s.label for s in specs] == ["full", "tangram@0.25", "dynamic@0.25", "uniform@0.25",
                                        "tangram@0.5", "dynamic@0.5", "uniform@0.5",
                                        "uniform@1"]
    with pytest.raises(ValueError, match="unknown mode"):
        ModeSpec("bogus", 0.5)
    with pytest.raises(ValueError, match="its ratio is 1"):
        ModeSpec("full", 0.5)
    # A mode may name its KV precision; precision tiers need tangram mode, full stays bf16.
    specs = mode_specs(["full", "tangram+k8v4-k4v2", "dynamic+k8v4"], [0.5])
    assert [s.label for s in specs] == ["full", "tangram+k8v4-k4v2@0.5", "dynamic+k8v4@0.5"]
    assert [s.kv_precision for s in specs] == ["bf16", "k8v4-k4v2", "k8v4"]
    assert specs[1].mode_name == "tangram+k8v4-k4v2"
    with pytest.raises(ValueError, match="needs tangram mode"):
        ModeSpec.parse("uniform+k8v4-k4v2", 0.5)
    with pytest.raises(ValueError, match="bf16 reference"):
        mode_specs(["full+k8v4"], [0.5])
    with pytest.raises(ValueError, match="kv_precision must be one of"):
        ModeSpec.parse("tangram+k3v1", 0.5)


def test_summary_counts_follow_up_turns_and_flags_unsolvable_tasks():
    samples = [T.generate("multi_turn", i) for i in range(4)] + \
        [T.generate("kv_retrieval", i) for i in range(4)]
    specs = [ModeSpec("full", 1.0), ModeSpec("tangram", 0.5)]
    full = {(s.id, t): _Judged(correct=(s.task == "multi_turn")) for s in samples
            for t in range(len(s.turns))}
    comp = {(s.id, t): _Judged(correct=(t == 0), agreement=0.5, exact=False, kl_sum=0.2,
                               kl_positions=2) for s in samples for t in range(len(s.turns))}
    out = summarise(samples, specs, {"full": full, "tangram@0.5": comp})
    rows = {(r["task"], r["mode"]): r for r in out["results"]}
    multi = rows[("multi_turn", "tangram")]
    assert multi["n"] == 12 and multi["correct"] == 4
    assert multi["turn1"]["accuracy"] == 1.0 and multi["followup"]["accuracy"] == 0.0
    assert multi["followup"]["n"] == 8
    assert multi["kl"] == pytest.approx(0.1) and multi["agreement"] == 0.5
    assert "followup" not in rows[("kv_retrieval", "full")]
    checks = {c["task"]: c["solvable"] for c in out["checks"]}
    assert checks == {"multi_turn": True, "kv_retrieval": False}


def test_uniform_profile_keeps_the_same_share_in_every_head():
    model = dict(architecture="llama", num_layers=4, num_kv_heads=3, head_dim=64)
    prof = BudgetProfile.uniform(model, 0.25)
    assert prof.group_size == 1 and np.all(prof.budget == 0.25)
    assert np.all(prof.group_budgets == 0.25) and prof.method == "snapkv"
    layout = prof.to_layout(page_size=16, chunk_size=128)
    assert np.all(layout.group_budgets == 0.25)
    with pytest.raises(ProfileError, match="ratio must lie in"):
        BudgetProfile.uniform(model, 0.0)


# ----- end to end on the real model ----------------------------------------------------------

@pytest.mark.slow
def test_tiny_run_through_the_engine(tmp_path):
    """A short multi-turn sample through full and uniform@1: tangram mode keeping every token
    must answer exactly as full KV does, turn by turn, and its teacher-forced KL is ~0."""
    from tangram_jax.evaluation.harness import HarnessConfig, run_table

    sizes = T.TaskSizes(multi_turn_chars=500)
    samples = [T.generate("multi_turn", 0, sizes=sizes)]
    specs = [ModeSpec("full", 1.0), ModeSpec("uniform", 1.0)]
    cfg = HarnessConfig(max_tokens=6, max_active=2, kl=True,
                        engine_kwargs=dict(chunk_size=64, max_num_batched_tokens=128))
    table = run_table(samples, specs, cfg, log=lambda s: None)
    rows = {(r["task"], r["mode"], r["ratio"]): r for r in table["results"]}
    assert rows[("multi_turn", "full", 1.0)]["n"] == 3
    assert rows[("multi_turn", "full", 1.0)]["followup"]["n"] == 2
    same = rows[("multi_turn", "uniform", 1.0)]
    assert same["agreement"] == 1.0 and same["exact_match"] == 1.0
    assert same["correct"] == rows[("multi_turn", "full", 1.0)]["correct"]
    for label, info in table["engines"].items():
        assert info["preemptions"] == 0 and info["evictions"] == 0, label
    assert table["kl_status"] == "measured"
    assert same["kl_positions"] > 0 and same["kl"] < 1e-4


def test_follow_up_turn_is_the_template_difference_without_a_repeated_end_of_turn():
    from tangram_jax.evaluation.harness import followup_text, followup_token_ids

    def chatml(messages, add_generation_prompt):
        text = "".join(f"<s>{m['role']}\n{m['content']}<e>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")

    closing, opening = followup_text(chatml, "Next?")
    assert (closing, opening) == ("<e>\n", "<s>user\nNext?<e>\n<s>assistant\n")
    vocab = {}
    encode = lambda t: [vocab.setdefault(p, len(vocab)) for p in t.replace("<", " <").split()]  # noqa
    end = encode("<e>")[0]
    after_eos = followup_token_ids(encode, closing, opening, [5, 6, end])
    cut_off = followup_token_ids(encode, closing, opening, [5, 6])
    assert cut_off == [end] + after_eos       # a truncated answer gets its end-of-turn token


def test_answer_prefix_follows_the_generation_prompt_in_every_turn():
    from tangram_jax.evaluation.harness import _followup_token_ids, first_turn_token_ids

    class WordTokenizer:
        """Whitespace tokens; ChatML-like template."""

        def __init__(self):
            self.vocab = {}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

        def render_chat(self, messages, add_generation_prompt):
            text = "".join(f" <s> {m['role']} {m['content']} <e> " for m in messages)
            return text + (" <s> assistant " if add_generation_prompt else "")

        def apply_chat_template(self, messages, add_generation_prompt):
            return self.encode(self.render_chat(messages, add_generation_prompt))

    tok = WordTokenizer()
    sample = T.generate("multi_turn", 3)
    first = first_turn_token_ids(tok, sample)
    prefix = tok.encode(sample.turns[0].answer_prefix)
    assert first[-len(prefix) - 2:] == tok.encode("<s> assistant") + prefix
    later = _followup_token_ids(tok, sample, 2, [])
    assert later[-len(tok.encode(sample.turns[2].answer_prefix)) - 2:] == \
        tok.encode("<s> assistant " + sample.turns[2].answer_prefix)
    bare = T.Sample.from_json({**sample.to_json(), "turns": [
        {"question": t.question, "answer": t.answer} for t in sample.turns]})
    assert first_turn_token_ids(tok, bare) == first[:-len(prefix)]


def _part(rule, rows, rev="abc"):
    return {"git_revision": rev, "device": "gpu: H100", "tasks_file": "t.jsonl",
            "config": {"scoring_rule": rule}, "command": f"accuracy.py --scoring-rule {rule}",
            "seconds": 10.0, "complete": True, "checks": [], "results": [
                {"task": "passkey", "mode": m, "ratio": r, "n": 10, "correct": c,
                 "accuracy": c / 10, "ci95": [0.0, 1.0], "agreement": None}
                for m, r, c in rows]}


def test_merged_parts_keep_full_kv_once_and_label_scoring_rules():
    from tangram_jax.evaluation.report import markdown_table, merge_reports
    a = _part(None, [("full", 1.0, 9), ("tangram", 0.25, 7)])
    b = _part("window+keydiff", [("full", 1.0, 9), ("tangram", 0.25, 8)])
    c = _part("window", [("full", 1.0, 9), ("dynamic", 0.25, 6)])
    merged = merge_reports(a, b, c)
    modes = [(r["mode"], r["correct"]) for r in merged["results"]]
    assert modes == [("full", 9), ("tangram", 7), ("tangram (window+keydiff)", 8), ("dynamic", 6)]
    assert [p["scoring_rule"] for p in merged["parts"]] == [None, "window+keydiff", "window"]
    assert merged["seconds"] == 30.0 and merged["complete"]
    assert "| tangram (window+keydiff) | 0.25 | 80 [0-100] |" in markdown_table(merged)
    # Since "auto", a part records the rule each engine served; rows are labelled by it.
    auto = _part("auto", [("full", 1.0, 9), ("tangram", 0.25, 8), ("tangram", 0.5, 9)])
    auto["engines"] = {"full": {"scoring_rule": "window"},
                       "tangram@0.25": {"scoring_rule": "window+keydiff"},
                       "tangram@0.5": {"scoring_rule": "window"}}
    assert [r["mode"] for r in merge_reports(auto)["results"]] == [
        "full", "tangram (window+keydiff)", "tangram"]


def test_merge_refuses_parts_that_do_not_belong_together():
    from tangram_jax.evaluation.report import merge_reports
    a = _part(None, [("full", 1.0, 9)])
    with pytest.raises(ValueError, match=r"parts disagree on \('tangram-jax', 'passkey', 'full'"):
        merge_reports(a, _part(None, [("full", 1.0, 8)]))
    with pytest.raises(ValueError, match="parts disagree on git_revision"):
        merge_reports(a, _part(None, [("full", 1.0, 9)], rev="def"))
    later = _part(None, [("full", 1.0, 9), ("dynamic", 0.5, 7)], rev="def")
    merged = merge_reports(a, later, mixed_revisions=True)
    assert merged["git_revision"] == "abc,def"
    assert [p["git_revision"] for p in merged["parts"]] == ["abc", "def"]
    with pytest.raises(ValueError, match=r"parts disagree on \('tangram-jax', 'passkey', 'full'"):
        merge_reports(a, _part(None, [("full", 1.0, 8)], rev="def"), mixed_revisions=True)
    with pytest.raises(ValueError, match="at least one report"):
        merge_reports()


def test_a_given_profile_is_served_at_its_ratio_and_labels_its_rows(tmp_path):
    """`--profile`: the tangram column at the profile's rho serves it (a KeyDiff-calibrated
    profile is then scored with KeyDiff by the engine), other ratios keep the shipped profile,
    and the table names the method."""
    import dataclasses as dc
    from tangram_jax.compression.profile import shipped_profile
    from tangram_jax.evaluation.harness import HarnessConfig, _engine_config
    from tangram_jax.evaluation.report import markdown_table
    shipped = shipped_profile(0.25, 1)
    path = tmp_path / "keydiff.json"
    dc.replace(shipped, method="keydiff").save(path)
    cfg = HarnessConfig(profiles=(str(path),))
    fingerprint = shipped.model
    at_quarter = _engine_config(ModeSpec("tangram", 0.25), cfg, 512, fingerprint).profile
    at_half = _engine_config(ModeSpec("tangram", 0.5), cfg, 512, fingerprint).profile
    assert (at_quarter.method, at_quarter.rho) == ("keydiff", 0.25)
    assert (at_half.method, at_half.rho) == ("snapkv", 0.5)
    with pytest.raises(ValueError, match=r"one file per ratio, got rho \[0.25, 0.25\]"):
        HarnessConfig(profiles=(str(path), str(path)))
    report = _part(None, [("full", 1.0, 9), ("tangram", 0.25, 6), ("tangram", 0.5, 8)])
    report["engines"] = {"tangram@0.25": {"method": "keydiff", "scoring_rule": "window+keydiff"},
                         "tangram@0.5": {"method": "snapkv", "scoring_rule": "window"}}
    table = markdown_table(report)
    assert "| tangram (keydiff profile, window+keydiff) | 0.25 |" in table
    assert "| tangram | 0.5 |" in table


def test_harness_pool_defaults_to_full_length_sessions_unless_sized_otherwise():
    """The harness fixes the pool at max_active full-length sessions (kv_cache_tokens) unless
    its engine kwargs size it another way (num_pages / kv_cache_memory_bytes), which it then
    passes on without a second size the engine would refuse."""
    from tangram_jax.evaluation.harness import HarnessConfig, ModeSpec, _engine_config
    fingerprint = {}
    default = _engine_config(ModeSpec("full", 1.0), HarnessConfig(max_active=4), 512, fingerprint)
    assert default.kv_cache_tokens == 4 * 512 and default.kv_cache_memory_bytes is None
    sized = _engine_config(ModeSpec("full", 1.0), HarnessConfig(
        max_active=4, engine_kwargs=dict(kv_cache_memory_bytes=2**24)), 512, fingerprint)
    assert sized.kv_cache_tokens is None and sized.kv_cache_memory_bytes == 2**24
    sized.check()


def test_per_task_sizes_keep_each_tasks_own_value_of_a_shared_field():
    """A pilot chooses sizes per task; the long tasks share `long_chars`, and each must be
    generated at its own (one merged TaskSizes gave every task the last task's value)."""
    sizes = {"long_facts": T.TaskSizes(long_chars=9000), "long_kv": T.TaskSizes(long_chars=4600)}
    samples = T.generate_all(("long_facts", "long_kv"), 1, 0, sizes)
    facts, kv = samples
    assert facts.context == T.generate("long_facts", 0, 0, sizes["long_facts"]).context
    assert kv.context == T.generate("long_kv", 0, 0, sizes["long_kv"]).context
    assert len(facts.context) > 8000 > 6000 > len(kv.context)
