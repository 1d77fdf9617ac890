"""Where a result came from: the code revision and the device, recorded with profiles and
benchmark results."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str | None:
    """`GIT_REV` from the environment (a copied tree on a remote machine may have no .git, or
    a stale one), else the checkout's HEAD, with ``+modified`` when tracked files differ from
    it (a result then did not come from that revision alone), else None."""
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    rev = _git("rev-parse", "HEAD")
    if not rev:
        return None
    return f"{rev}+modified" if _git("status", "--porcelain", "--untracked-files=no") else rev


def _git(*args: str) -> str | None:
    """Stripped stdout of ``git args`` in the checkout, or None when git fails."""
    try:
        out = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_description() -> str:
    """The default JAX device: GPU kind, or the CPU model and visible cores."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        return f"{dev.platform}: {dev.device_kind}"
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU: {cpu} ({os.cpu_count()} logical cores visible)"
