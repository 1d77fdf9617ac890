"""Where a result came from: the code revision and the device, recorded with profiles and
benchmark results."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str | None:
    """`GIT_REV` from the environment (a copied tree on a remote machine has no .git), else
    the checkout's HEAD, else None."""
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


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
