"""The README's "Using it" snippet prints what the README says it prints (run as a user runs it:
a fresh Python process on the CPU, the embedded model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_using_it_snippet_prints_what_the_readme_shows():
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Using it\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"prints[^\n]*:\n\n```text\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == shown
