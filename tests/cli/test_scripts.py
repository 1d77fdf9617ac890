"""scripts/test.sh, the README's test command: it installs only what is missing
(scripts/installed.py), so a set-up machine runs the tests without pip's output, and pip never
lists the --no-deps packages' own requirements as a red resolver ERROR."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed():
    spec = importlib.util.spec_from_file_location("installed", ROOT / "scripts" / "installed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_names_what_is_missing(tmp_path):
    installed = _installed()
    assert installed.missing() == [], "this checkout is not the installed one (pip install -e .)"
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = project.replace('  "pytest>=8",', '  "pytest>=8",\n  "no-such-package-tangram>=1",'
                              '\n  "numpy<1",')
    (tmp_path / "pyproject.toml").write_text(project, encoding="utf-8")
    gaps = installed.missing(tmp_path)
    assert gaps[0] == f"tangram_jax installed from this checkout ({tmp_path})"
    assert "no-such-package-tangram>=1" in gaps
    assert any(g.startswith("numpy<1 (installed: ") for g in gaps), gaps
    assert len(gaps) == 3, gaps


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_set_up_machine_runs_the_tests_without_pip_output():
    """The second run of scripts/test.sh (everything installed): no pip, nothing before
    pytest's own lines (here pytest collects nothing: exit 5)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(["bash", "scripts/test.sh", "--ignore-glob=*"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 5, run.stdout + run.stderr
    text = run.stdout + run.stderr
    for noise in ("ERROR", "requires", "to install", "pip", "Requirement"):
        assert noise not in text, text
    assert "no tests ran" in text


def test_pip_runs_quietly_and_without_the_conflict_warning():
    """Where pip has to run, it is told not to list the --no-deps packages' requirements as
    conflicts (measured: installing another tqdm beside needlehaystack printed pip's red
    "dependency resolver" ERROR and 47 lines of its requirements without the flag)."""
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    installs = [line.strip() for line in script.splitlines()
                if line.strip().startswith("python3 -m pip install")]
    assert len(installs) == 2
    assert "--no-warn-conflicts" in installs[0] and "-q" in installs[0].split()
    assert "--no-deps" in installs[1] and "-q" in installs[1].split()
    assert "if ! python3 scripts/installed.py; then" in script
