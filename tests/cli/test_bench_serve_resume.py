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
