"""benchmarks/serve_per_gpu.sh: configurations spread over a host's GPUs, NAME@tpN taking N of
them, each started as soon as enough are free, then one merged report. Run here with
stand-ins for `nvidia-smi` (the host's GPUs) and `python3` (each `bench serve` records what it
was given and when, and sleeps; the merge records its parts)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_per_gpu.sh"

STAND_IN = '''#!{python}
import json, os, sys, time
args = sys.argv[1:]
out = args[args.index("--json") + 1]
if "--merge" in args:
    parts = args[args.index("--merge") + 1:args.index("--json")]
    json.dump({{"merged": parts}}, open(out, "w"))
    sys.exit(0)
variant = args[args.index("--variants") + 1]
tp = int(args[args.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in args else 1
start = time.time()
time.sleep(float(os.environ.get("STAND_IN_SECONDS", "0.6")))
if variant == "broken":
    sys.exit(3)
json.dump({{"variant": variant, "tp": tp, "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
           "args": args, "start": start, "end": time.time()}}, open(out, "w"))
'''


def _run(tmp_path, gpus: int, configs: str, *flags: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("nvidia-smi", "#!/bin/sh\n" + "".join(
            f"echo 'GPU {g}: stand-in'\n" for g in range(gpus))),
            ("python3", STAND_IN.format(python=sys.executable))):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "report.json"
    done = subprocess.run(["bash", str(SCRIPT), str(out), configs, *flags], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, out


def _runs(out: Path) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in json.loads(out.read_text())["merged"]]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_configurations_take_their_gpus_and_start_when_enough_are_free(tmp_path):
    done, out = _run(tmp_path, 4, "full,tangram@tp2,dynamic,tangram@tp4",
                     "--classes", "mid", "--kv-gib", "16")
    assert done.returncode == 0, done.stderr
    runs = {r["variant"] + ("" if r["tp"] == 1 else f"@tp{r['tp']}"): r for r in _runs(out)}
    assert {k: v["gpus"] for k, v in runs.items()} == {
        "full": "0", "tangram@tp2": "1,2", "dynamic": "3", "tangram@tp4": "0,1,2,3"}
    assert all(r["args"][:9] == ["-u", "-m", "tangram_jax.cli", "bench", "serve", "--", "--classes",
                                 "mid", "--kv-gib"] for r in runs.values())
    assert "--tensor-parallel-size" not in runs["full"]["args"]
    # The first three ran side by side; the 4-GPU one waited for all of them.
    first = [runs[k] for k in ("full", "tangram@tp2", "dynamic")]
    assert max(r["start"] for r in first) < min(r["end"] for r in first)
    assert runs["tangram@tp4"]["start"] >= max(r["end"] for r in first)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_configuration_is_named_and_the_others_are_merged(tmp_path):
    done, out = _run(tmp_path, 2, "full,broken,tangram")
    assert done.returncode == 1
    assert "run1's run failed" in done.stderr and "run1.log" in done.stderr
    assert sorted(r["variant"] for r in _runs(out)) == ["full", "tangram"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("configs, flags, message", [
    ("tangram@tp4", (), "configuration 'tangram@tp4' needs 4 GPUs; this host has 2"),
    ("tangram@2", (), "configuration 'tangram@2': after @ give tpN"),
    ("tangram", ("--tensor-parallel-size", "2"), "give tensor parallelism per configuration"),
])
def test_bad_configurations_are_refused_before_anything_runs(tmp_path, configs, flags, message):
    done, out = _run(tmp_path, 2, configs, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not out.exists() and not (tmp_path / "report.parts").exists()
