"""`tangram-jax bench serve`'s pieces that need no model: the SCBench-shaped sessions, the
session loop every engine is driven by (with a fake engine), and its bad-input errors."""

import numpy as np
import pytest

from tangram_jax.benchmarking import session_loop
from tangram_jax.benchmarking.serve import summarize, variant_config
from tangram_jax.benchmarking.workload import (SessionSpec, context_class_of, make_sessions,
                                               sessions_to_json, skewed_head_budgets)


def test_sessions_have_the_asked_shape_and_arrivals():
    spec = SessionSpec(num_sessions=5, context_tokens=40, followups=2, question_tokens=7,
                       answer_tokens=3, arrival="poisson", session_rate=2.0, seed=1)
    sessions = make_sessions(spec, vocab_size=1000)
    assert [len(t) for t in sessions[0].turns] == [40, 7, 7]
    arrivals = [s.arrival for s in sessions]
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) > 0)
    assert all(100 <= t < 900 for s in sessions for turn in s.turns for t in turn)
    assert spec.num_turns == 15 and spec.session_tokens() == 40 + 14 + 9
    assert make_sessions(spec, 1000) == sessions                 # seeded
    assert context_class_of(8192) == "short" and context_class_of(32768) == "mid"
    assert context_class_of(102400) == "long"


@pytest.mark.parametrize("kwargs,match", [
    (dict(arrival="poisson"), "session_rate"), (dict(arrival="burst"), "arrival"),
    (dict(context_tokens=0), "context_tokens"), (dict(followups=-1), "followups"),
    (dict(think_time=-1.0), "think_time"), (dict(think_time=float("nan")), "think_time")])
def test_bad_session_specs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SessionSpec(**{"num_sessions": 2, "context_tokens": 10, **kwargs})


def test_skewed_budgets_average_rho_with_a_long_tail():
    b = skewed_head_budgets(32, 8, 0.25, np.random.default_rng(0))
    assert b.shape == (32, 8) and abs(b.mean() - 0.25) < 0.01
    assert b.min() >= 0.02 and b.max() <= 1 and b.max() > 3 * b.mean()


class FakeEngine(session_loop.Adapter):
    """Answers one token per step for every live request, as a stateful engine would; records
    what each turn was sent with."""

    def __init__(self, answer):
        self.answer, self.live, self.sent = answer, {}, []

    def submit(self, request_id, session_id, turn, history, new):
        self.sent.append((request_id, len(history), len(new)))
        self.live[request_id] = []

    def step(self):
        news = []
        for rid, toks in list(self.live.items()):
            toks.append(7)
            done = len(toks) == self.answer
            news.append((rid, list(toks), done, 0))
            if done:
                del self.live[rid]
        return news

    def has_work(self):
        return bool(self.live)


def test_session_loop_sends_follow_ups_with_their_history_and_times_turns():
    spec = SessionSpec(num_sessions=2, context_tokens=10, followups=2, question_tokens=3,
                       answer_tokens=4)
    engine = FakeEngine(4)
    ticks = iter(range(10_000))
    records, elapsed = session_loop.drive(sessions_to_json(make_sessions(spec, 500)), engine,
                                          clock=lambda: float(next(ticks)))
    assert len(records) == 6 and all(r.finished is not None for r in records)
    # Turn k of a session is sent with every earlier prompt and answer as history.
    assert sorted(engine.sent) == sorted([("s0-t0", 0, 10), ("s1-t0", 0, 10),
                                          ("s0-t1", 14, 3), ("s1-t1", 14, 3),
                                          ("s0-t2", 21, 3), ("s1-t2", 21, 3)])
    follow = [r for r in records if r.turn > 0]
    assert all(r.sent >= min(f.finished for f in records if f.turn == r.turn - 1)
               for r in follow)
    row = summarize(records, elapsed)
    assert row["turns"] == 6 and row["output_tokens"] == 24
    assert row["ttft_first_s"]["n"] == 2 and row["ttft_followup_s"]["n"] == 4
    assert all(r.tpot > 0 for r in records)


def test_think_times_delay_each_follow_up_after_its_answer():
    """Open loop with think times: each follow-up is sent its session's think time (seeded,
    exponential of the asked mean) after the answer before it ended; the tokens and arrivals
    of the seed are those without think times."""
    spec = SessionSpec(num_sessions=3, context_tokens=10, followups=2, question_tokens=3,
                       answer_tokens=2, arrival="poisson", session_rate=1.0, think_time=30.0)
    sessions = make_sessions(spec, 500)
    plain = make_sessions(SessionSpec(**{**spec.__dict__, "think_time": 0.0}), 500)
    assert [s.turns for s in sessions] == [s.turns for s in plain]
    assert [s.arrival for s in sessions] == [s.arrival for s in plain]
    think = np.array([s.think_times for s in sessions])
    assert think.shape == (3, 2) and (think > 0).all() and plain[0].think_times == ()
    assert make_sessions(spec, 500) == sessions                   # seeded
    ticks = iter(range(100_000))
    records, _ = session_loop.drive(sessions_to_json(sessions), FakeEngine(2),
                                    clock=lambda: float(next(ticks)))
    by = {(r.session_id, r.turn): r for r in records}
    for i, s in enumerate(sessions):
        for turn in (1, 2):
            prev, rec = by[(s.session_id, turn - 1)], by[(s.session_id, turn)]
            # Sent no earlier than the think time after the answer (the loop polls).
            assert rec.sent == pytest.approx(prev.finished + s.think_times[turn - 1])
    with pytest.raises(SystemExit):
        from tangram_jax.commands import bench_serve
        bench_serve.main(["--think-time", "x", "--kv-gib", "1"])


def test_ablation_configurations():
    from tangram_jax.benchmarking.models import random_model_config
    mc = random_model_config("random-tiny")
    assert variant_config("full", mc, 2, 0.25, 0) == {"mode": "full", "kv_precision": "bf16"}
    mono = variant_config("reserve-mono", mc, 2, 0.25, 0)
    assert mono["group_size"] == mc.num_kv_heads and mono["split_map"] == "aot"
    ragged = variant_config("ragged", mc, 2, 0.25, 0)
    assert ragged["group_size"] == 2 and ragged["split_map"] == "uniform"
    assert variant_config("tangram", mc, 2, 0.25, None) == {
        "mode": "tangram", "group_size": 2, "split_map": "aot", "kv_precision": "bf16"}
    with pytest.raises(ValueError, match="unknown configuration"):
        variant_config("fast", mc, 2, 0.25, 0)
    # A configuration names its precision after '+', else takes the command's; tiers serve
    # tangram-mode configurations with a profile carrying tier budgets.
    assert variant_config("full+k8v4", mc, 2, 0.25, 0, "bf16")["kv_precision"] == "k8v4"
    tiered = variant_config("tangram", mc, 2, 0.25, 0, "k8v4-k4v2")
    assert tiered["kv_precision"] == "k8v4-k4v2"
    assert tiered["profile"].tiers.precision == "k8v4-k4v2"
    assert variant_config("full+bf16", mc, 2, 0.25, 0, "k8v4-k4v2")["kv_precision"] == "bf16"
    with pytest.raises(ValueError, match="needs tangram mode"):
        variant_config("full", mc, 2, 0.25, 0, "k8v4-k4v2")
    with pytest.raises(ValueError, match="kv_precision must be one of"):
        variant_config("tangram+k3v1", mc, 2, 0.25, 0)
    # '/recompute': the same configuration without a host-memory tier.
    assert variant_config("full/recompute", mc, 2, 0.25, 0) == {
        "mode": "full", "kv_precision": "bf16", "host_kv_cache_bytes": 0}
    assert variant_config("tangram+k8v4/recompute", mc, 2, 0.25, None) == dict(
        variant_config("tangram+k8v4", mc, 2, 0.25, None), host_kv_cache_bytes=0)
    assert "host_kv_cache_bytes" not in variant_config("tangram", mc, 2, 0.25, None)
    for bad in ("tangram/recompute+k8v4", "tangram/swap", "tangram/recompute/recompute"):
        with pytest.raises(ValueError):
            variant_config(bad, mc, 2, 0.25, 0)


def test_bench_serve_refuses_bad_flags_before_loading_anything(capsys):
    from tangram_jax.commands import UsageError, bench_serve
    with pytest.raises(UsageError, match="--variants"):
        bench_serve.main(["--variants", "full,fast", "--kv-gib", "1"])
    with pytest.raises(SystemExit):
        bench_serve.main(["--rates", "0,1"])


def test_split_map_field_is_checked():
    from tangram_jax.engine.config import EngineConfig, EngineConfigError
    assert EngineConfig(split_map="uniform").split_map == "uniform"
    with pytest.raises(EngineConfigError, match="split_map"):
        EngineConfig(split_map="runtime")


def test_kv_gib_list_sweeps_the_pool_and_finds_where_eviction_stops(tmp_path, monkeypatch):
    """`--kv-gib 0.5,1,2`: every configuration runs at every pool size (the engine gets that
    many bytes), ratios compare configurations on the same pool, the report says from which
    pool each configuration stops evicting, and the plot is the sweep's. The engines are
    stand-ins here (turns/s and evictions as a function of the pool)."""
    import json

    from tangram_jax.benchmarking import serve
    from tangram_jax.commands import UsageError, bench_serve
    seen = []

    def fake_run_variant(variant, factory, model_config, fields, workloads, group_size, ratio,
                         profile_seed, limits):
        # One build a configuration, at the largest pool; each size served from it.
        assert fields["kv_cache_memory_bytes"] == max(limits)
        for limit in limits:
            gib = limit / 2**30
            seen.append((variant, gib))
            evictions = {"full": {0.5: 4, 1.0: 2, 2.0: 0}, "tangram": {0.5: 1, 1.0: 0, 2.0: 0}}
            rows = [{"workload": name, "turns_per_s": gib * (2 if variant == "tangram" else 1),
                     "output_tokens_per_s": 1.0, "seconds": 1.0,
                     "evictions": evictions[variant][gib],
                     "ttft_first_s": {"p50": 0.1, "p99": 0.2},
                     "ttft_followup_s": {"p50": 0.1 / gib, "p99": 0.3 / gib},
                     "tpot_followup_s": {"p50": 0.01}} for name, _ in workloads]
            yield {"variant": variant, "workloads": rows}

    monkeypatch.setattr(serve, "run_variant", fake_run_variant)
    out = tmp_path / "sweep.json"
    assert bench_serve.main(["--model", "random-tiny", "--variants", "full,tangram",
                             "--context-tokens", "600", "--sessions", "2", "--kv-gib", "1,0.5,2",
                             "--json", str(out)]) == 0
    assert seen == [(v, g) for v in ("full", "tangram") for g in (0.5, 1.0, 2.0)]
    report = json.loads(out.read_text())
    assert report["kv_cache_gib"] == [0.5, 1.0, 2.0] and len(report["kv_cache_tokens"]) == 3
    for r in report["results"]:
        if r["variant"] == "tangram":
            assert r["workloads"][0]["turns_per_s_vs_full"] == 2.0     # the same pool's full
    onset = report["eviction_onset"]
    workload = report["workloads"][0]["name"]
    assert onset["full"][workload]["last_evicting_gib"] == 1.0
    assert onset["full"][workload]["no_evictions_from_gib"] == 2.0
    assert onset["tangram"][workload]["no_evictions_from_gib"] == 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    for bad in ("1,1", "0,1", "x"):
        with pytest.raises(SystemExit):
            bench_serve.main(["--kv-gib", bad])
    with pytest.raises(UsageError, match="--vllm serves one pool"):
        bench_serve.main(["--kv-gib", "1,2", "--vllm", "--json", str(tmp_path / "v.json")])


def test_recompute_configurations_are_compared_with_offload(tmp_path, monkeypatch):
    """`--variants full,full/recompute,...` with think times: the '/recompute' configuration
    gets no host tier, and the report gives each configuration's turns/s and follow-up TTFT
    against itself with recompute, beside the table and a plot. Stand-in engines."""
    import json

    from tangram_jax.benchmarking import serve
    from tangram_jax.commands import bench_serve
    seen = {}

    def fake_run_variant(variant, factory, model_config, fields, workloads, group_size, ratio,
                         profile_seed, limits):
        assert limits == [None]                     # one pool: served whole
        config = serve.variant_config(variant, model_config, group_size, ratio, profile_seed)
        seen[variant] = dict(fields, **config).get("host_kv_cache_bytes")
        offload = not variant.endswith(serve.RECOMPUTE)
        rows = [{"workload": name, "turns_per_s": 2.0 if offload else 1.0,
                 "output_tokens_per_s": 1.0, "seconds": 1.0, "evictions": 3,
                 "swapped_out": 3 if offload else 0, "recompute_tokens": 0 if offload else 900,
                 "ttft_first_s": {"p50": 0.1, "p99": 0.2},
                 "ttft_followup_s": {"p50": 0.1 if offload else 0.4,
                                     "p99": 0.5 if offload else 4.0},
                 "tpot_followup_s": {"p50": 0.01}} for name, spec in workloads
                if spec.think_time == 30]
        yield {"variant": variant, "workloads": rows}

    monkeypatch.setattr(serve, "run_variant", fake_run_variant)
    out = tmp_path / "think.json"
    assert bench_serve.main(["--model", "random-tiny", "--variants",
                             "full,full/recompute,tangram,tangram/recompute", "--think-time", "30",
                             "--context-tokens", "600", "--sessions", "2", "--kv-gib", "1",
                             "--json", str(out)]) == 0
    assert seen["full/recompute"] == 0 == seen["tangram/recompute"]
    assert seen["full"] != 0 and seen["tangram"] != 0
    report = json.loads(out.read_text())
    assert report["workloads"][0]["think_time"] == 30
    by = {r["variant"]: r["workloads"][0] for r in report["results"]}
    assert by["tangram"]["turns_per_s_vs_recompute"] == 2.0
    assert by["full"]["ttft_followup_p99_vs_recompute"] == 0.125
    assert by["full"]["ttft_followup_p50_vs_recompute"] == 0.25
    assert "turns_per_s_vs_recompute" not in by["tangram/recompute"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_serving_is_measured_after_the_background_compiles(monkeypatch):
    """`serve.run_variant` waits for what warm-up left to compile in the background before
    the first workload (beside those compiles serving runs on covering programs and shares
    the host's cores), and reports the wait."""
    from types import SimpleNamespace

    import tangram_jax.llm
    from tangram_jax.benchmarking import serve
    events = []

    def wait_for_compiles(timeout=None):
        events.append("compiled")
        return True

    engine = SimpleNamespace(
        wait_for_compiles=wait_for_compiles,
        kv_pool=lambda: {"num_pages": 9, "bytes": 2**20, "slots": 64},
        layout=SimpleNamespace(name="full", group_size=1, chunk_size=16, group_budgets=[1.0]),
        config=SimpleNamespace(kv_precision="bf16", mode="full", split_map="aot",
                               tensor_parallel_size=1),
        runner=SimpleNamespace(ops=SimpleNamespace(name="reference"),
                               placement=SimpleNamespace(devices=[])),
        manager=SimpleNamespace(capacity=8), startup_seconds={}, startup_report=lambda: {})
    monkeypatch.setattr(tangram_jax.llm, "build_replicas", lambda config: [engine])
    monkeypatch.setattr(serve, "variant_config", lambda *args: {})
    monkeypatch.setattr(serve, "serve_workloads",
                        lambda engines, workloads, chunk: events.append("served") or [])
    (row,) = serve.run_variant("full", None, None, {}, [], 1, 0.25, None)
    assert events == ["compiled", "served"]
    assert row["background_compiles_ok"] and row["background_compile_wait_seconds"] >= 0


def test_a_baseline_package_runs_the_same_command_first(tmp_path, monkeypatch, capsys):
    """`--baseline DIR`: the same command (less our outputs) runs first from DIR's package in
    its own process, with DIR/REVISION as its revision; the report keeps its results and ours
    over its. The baseline here is a stand-in package whose `bench serve` writes a report."""
    import json
    import textwrap

    from tangram_jax.benchmarking import serve
    from tangram_jax.commands import UsageError, bench_serve
    base = tmp_path / "base"
    (base / "tangram_jax").mkdir(parents=True)
    (base / "tangram_jax" / "__init__.py").write_text("")
    (base / "tangram_jax" / "cli.py").write_text(textwrap.dedent("""
        import json, os, sys
        args = sys.argv[1:]
        out = args[args.index("--json") + 1]
        json.dump({"git_revision": os.environ["GIT_REV"], "command": args, "results": [
            {"variant": "tangram", "workloads": [{"workload": "mid", "turns_per_s": 2.0,
                                                  "ttft_followup_s": {"p50": 0.1}}]}]},
                  open(out, "w"))
    """))
    (base / "REVISION").write_text("abc1234\n")

    def fake_run_variant(variant, factory, model_config, fields, workloads, group_size, ratio,
                         profile_seed, limits):
        rows = [{"workload": "mid", "turns_per_s": 1.5, "output_tokens_per_s": 1.0,
                 "seconds": 1.0, "evictions": 0, "ttft_first_s": {"p50": 0.1, "p99": 0.2},
                 "ttft_followup_s": {"p50": 0.2, "p99": 0.3}, "tpot_followup_s": {"p50": 0.01}}]
        yield {"variant": variant, "workloads": rows}

    monkeypatch.setattr(serve, "run_variant", fake_run_variant)
    out = tmp_path / "ab.json"
    assert bench_serve.main(["--model", "random-tiny", "--variants", "tangram", "--classes",
                             "mid", "--sessions", "2", "--kv-cache-tokens", "5000",
                             "--baseline", str(base), "--json", str(out), "--overwrite"]) == 0
    report = json.loads(out.read_text())
    assert report["baseline"]["git_revision"] == "abc1234"
    assert report["baseline"]["command"][:2] == ["bench", "serve"]
    assert "--baseline" not in report["baseline"]["command"]
    assert report["baseline"]["command"][-2:] == ["--json", str(tmp_path / "ab.baseline.json")]
    assert "--overwrite" not in report["baseline"]["command"]
    (w,) = report["results"][0]["workloads"]
    assert w["turns_per_s_vs_baseline"] == 0.75 and w["ttft_followup_p50_vs_baseline"] == 2.0
    assert "0.750x the baseline's (abc1234)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab.json", "ab.png", "base"]
    (base / "tangram_jax" / "cli.py").write_text("raise SystemExit(3)")
    with pytest.raises(UsageError, match=r"--baseline: bench serve from .* failed \(exit "
                                         r"status 3\)"):
        bench_serve.main(["--model", "random-tiny", "--variants", "tangram", "--sessions", "2",
                          "--kv-cache-tokens", "5000", "--baseline", str(base), "--json",
                          str(tmp_path / "b.json")])
    with pytest.raises(UsageError, match="holds no tangram_jax package"):
        bench_serve.main(["--kv-cache-tokens", "5000", "--baseline", str(tmp_path),
                          "--json", str(tmp_path / "c.json")])

