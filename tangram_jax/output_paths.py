"""Where commands and benchmarks may write: a path is checked before any work starts (its folder
exists and is writable, it is not a folder) and a file git tracks (a committed result, a shipped
profile) is replaced only when the caller says so. The CLI (`tangram_jax.commands`) and the
benchmarks' result writer (`tangram_jax.benchmarking.results`) both ask here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class UsageError(ValueError):
    """A user error of a command (bad flag value, unusable file); exits 2 with one line."""


def check_output_path(flag: str, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Raise UsageError unless `path` can be written: its folder exists and is writable, the
    path is not a folder, and it is not a file git tracks (a committed result, a shipped
    profile) unless `overwrite` (the command's --overwrite) says to replace it."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} is not writable")
    if not overwrite and is_git_tracked(p):
        raise UsageError(f"{flag} {str(path)!r} is a file git tracks (committed to the "
                         f"repository): give another path, or pass --overwrite to replace it")
    return p


def is_git_tracked(path: str | os.PathLike) -> bool:
    """Whether `path` is a file in the index of the git checkout holding it (False where git
    or a checkout is missing)."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        return False
    try:
        found = subprocess.run(["git", "-C", str(p.parent), "ls-files", "--error-unmatch", "--",
                                p.name], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return found.returncode == 0
