"""`tangram-jax bench serve --resume`: an earlier report is kept only if it measured the same
thing on the same device."""

import json

import pytest

from tangram_jax.commands import UsageError
from tangram_jax.commands.bench_serve import _resumable
from tangram_jax.provenance import device_description


def _report(**over):
    report = {"model": "random-tiny", "model_shape": {"num_layers": 2}, "ratio": 0.25,
              "group_size": 2, "kv_cache_tokens": 4096, "engine_fields": {"page_size": 16},
              "workloads": [{"name": "short-128", "sessions": 2}], "results": []}
    report.update(over)
    return report


def test_resume_keeps_a_matching_report_and_refuses_another(tmp_path):
    path = tmp_path / "serve.json"
    earlier = _report(device=device_description(), results=[{"variant": "full"}])
    path.write_text(json.dumps(earlier))
    assert _resumable(path, _report())["results"] == [{"variant": "full"}]
    with pytest.raises(UsageError, match="kv_cache_tokens"):
        _resumable(path, _report(kv_cache_tokens=8192))
    path.write_text(json.dumps(dict(earlier, device="another GPU")))
    with pytest.raises(UsageError, match="device"):
        _resumable(path, _report())


def test_merge_joins_runs_made_side_by_side_and_compares_across_them(tmp_path, monkeypatch):
    """`--merge`: configurations run in separate processes (one a GPU) and workloads run apart
    become one report: each configuration one row with all its workloads, offload compared
    with its /recompute run from another file, the files' device and revision kept; runs that
    measured something else, or a workload twice, are refused."""
    from tangram_jax.benchmarking import serve
    from tangram_jax.commands import bench_serve

    def fake_run_variant(variant, factory, model_config, fields, workloads, group_size, ratio,
                         profile_seed, limits):
        offload = not variant.endswith(serve.RECOMPUTE)
        yield {"variant": variant, "build_and_warmup_seconds": 5.0, "workloads": [
            {"workload": name, "turns_per_s": 2.0 if offload else 1.0,
             "output_tokens_per_s": 1.0, "seconds": 1.0, "evictions": 1,
             "ttft_first_s": {"p50": 0.1, "p99": 0.2},
             "ttft_followup_s": {"p50": 0.1 if offload else 0.4, "p99": 0.5 if offload else 2.0},
             "tpot_followup_s": {"p50": 0.01}} for name, _ in workloads]}

    monkeypatch.setattr(serve, "run_variant", fake_run_variant)
    common = ["--model", "random-tiny", "--sessions", "2", "--kv-gib", "1", "--think-time", "3",
              "--max-model-len", "2048"]
    parts = {}
    for variant in ("full", "full/recompute"):
        for tokens in ("600", "900"):
            path = tmp_path / f"{variant.replace('/', '-')}-{tokens}.json"
            assert bench_serve.main([*common, "--variants", variant, "--context-tokens", tokens,
                                     "--json", str(path)]) == 0
            parts[variant, tokens] = path
    out = tmp_path / "merged.json"
    assert bench_serve.main(["--merge", *map(str, parts.values()), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [r["variant"] for r in merged["results"]] == ["full", "full/recompute"]
    full = {w["workload"]: w for w in merged["results"][0]["workloads"]}
    assert len(full) == 2 == len(merged["workloads"]) and len(merged["merged_from"]) == 4
    assert all(w["turns_per_s_vs_recompute"] == 2.0 for w in full.values())
    assert all(w["ttft_followup_p99_vs_recompute"] == 0.25 for w in full.values())
    assert all(w["build_and_warmup_seconds"] == 5.0 for w in full.values())
    assert merged["device"] == device_description() and out.with_suffix(".png").exists()
    assert "--merge" in merged["command"]

    # Something else measured, or the same workload twice: refused, naming why.
    other = json.loads(parts["full", "600"].read_text())
    (tmp_path / "other.json").write_text(json.dumps(dict(other, device="another GPU")))
    with pytest.raises(UsageError, match="device"):
        bench_serve.main(["--merge", str(parts["full", "600"]), str(tmp_path / "other.json"),
                          "--json", str(tmp_path / "x.json")])
    with pytest.raises(UsageError, match="'full' at pool .* more than one report"):
        bench_serve.main(["--merge", str(parts["full", "600"]), str(parts["full", "600"]),
                          "--json", str(tmp_path / "y.json")])
    with pytest.raises(UsageError, match="--merge needs --json"):
        bench_serve.main(["--merge", str(parts["full", "600"])])
    with pytest.raises(UsageError, match="cannot read"):
        bench_serve.main(["--merge", str(tmp_path / "missing.json"), "--json",
                          str(tmp_path / "z.json")])


def test_merge_names_runs_over_several_devices_and_compares_them_with_one():
    """Runs that differ only in their parallel sizes merge: each row says on how many devices
    it ran ("tangram@dp2"), compared with itself on one device and with full KV on as many."""
    from tangram_jax.benchmarking.serve import merge_reports

    def run(dp, tp, rows):
        fields = {"page_size": 16, "data_parallel_size": dp, "tensor_parallel_size": tp}
        return _report(device="2 GPUs", git_revision="abc", engine_fields=fields, results=[
            {"variant": v, "workloads": [{"workload": "short-128", "turns_per_s": t,
                                          "ttft_followup_s": {"p50": 1.0, "p99": 2.0}}]}
            for v, t in rows])

    merged = merge_reports([run(1, 1, [("full", 1.0), ("tangram", 2.0)]),
                            run(2, 1, [("full", 1.5), ("tangram", 3.8)]),
                            run(1, 2, [("tangram", 3.0)])])
    rows = {r["variant"]: r for r in merged["results"]}
    assert list(rows) == ["full", "tangram", "full@dp2", "tangram@dp2", "tangram@tp2"]
    dp2 = rows["tangram@dp2"]["workloads"][0]
    assert dp2["turns_per_s_vs_one_device"] == 1.9
    assert dp2["turns_per_s_vs_full"] == 3.8 / 1.5                  # full on two devices too
    assert rows["tangram@tp2"]["workloads"][0]["turns_per_s_vs_one_device"] == 1.5
    assert "turns_per_s_vs_full" not in rows["tangram@tp2"]["workloads"][0]
    assert rows["tangram@tp2"]["tensor_parallel_size"] == 2
    assert "data_parallel_size" not in merged["engine_fields"]
    assert "turns_per_s_vs_one_device" not in rows["tangram"]["workloads"][0]
    with pytest.raises(ValueError, match="engine_fields"):
        other = run(2, 1, [("tangram", 1.0)])
        other["engine_fields"]["page_size"] = 32
        merge_reports([run(1, 1, [("tangram", 2.0)]), other])


def test_merge_joins_sweeps_of_other_workloads_with_their_own_model_length():
    """Sweeps of different workloads (each run sized `max_model_len` to its longest session,
    its own pool sizes) merge into one sweep: the union of the sizes, each workload row with
    its own `max_model_len`, the onset per workload; runs that share a workload must still
    agree on every setting."""
    from tangram_jax.benchmarking.serve import merge_reports

    def sweep(workload, length, pools):
        return _report(device="GPU", git_revision="abc", workloads=[{"name": workload}],
                       kv_cache_gib=[float(g) for g in pools],
                       kv_cache_tokens=[g * 100 for g in pools],
                       engine_fields={"page_size": 16, "max_model_len": length},
                       results=[{"variant": "tangram", "kv_cache_gib": float(g), "workloads": [
                           {"workload": workload, "turns_per_s": g / 10, "evictions": int(g < 20),
                            "ttft_followup_s": {"p50": 1.0, "p99": 2.0}}]} for g in pools])

    merged = merge_reports([sweep("mid", 33536, [12, 24]), sweep("long", 103168, [16, 24])])
    assert merged["kv_cache_gib"] == [12.0, 16.0, 24.0]
    assert merged["kv_cache_tokens"] == [1200, 1600, 2400]
    assert merged["engine_fields"]["max_model_len"] == {"mid": 33536, "long": 103168}
    rows = {r["kv_cache_gib"]: {w["workload"]: w for w in r["workloads"]}
            for r in merged["results"]}
    assert sorted(rows[24.0]) == ["long", "mid"] and list(rows[12.0]) == ["mid"]
    assert rows[24.0]["long"]["max_model_len"] == 103168
    assert merged["eviction_onset"]["tangram"]["long"]["no_evictions_from_gib"] == 24.0
    with pytest.raises(ValueError, match="engine_fields"):
        merge_reports([sweep("mid", 33536, [12]), sweep("mid", 103168, [16])])
    with pytest.raises(ValueError, match="another kv_cache_tokens"):
        merge_reports([sweep("mid", 33536, [12, 24]), sweep("mid", 33536, [16])])
    with pytest.raises(ValueError, match="another engine_fields"):   # not a length apart
        merge_reports([sweep("mid", 33536, [12]), dict(sweep("long", 103168, [16]),
                                                       engine_fields={"page_size": 32})])
