"""Subcommands of the `tangram-jax` CLI (see tangram_jax/cli.py), and what they share:

- `UsageError`: a user error; `cli.main` prints it as one line and exits 2.
- `check_output_path`: an output file's folder must exist and be writable *before* the work
  starts (a typo in `--json` must not cost the whole job), and a file git tracks is replaced
  only with `--overwrite` (`add_overwrite_flag`).
- `atomic_path` / `write_text_atomic` (from `tangram_jax.atomic_files`): outputs are written to
  a temporary file in the same folder and renamed into place, so an interrupted command leaves
  the old file or the new one, never half of one.
- `positive_int`: argparse type for counts that must be >= 1; `port`: for TCP ports (0-65535).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from tangram_jax.atomic_files import atomic_path, write_text_atomic

__all__ = ["UsageError", "atomic_path", "check_output_path", "positive_int", "write_text_atomic"]


class UsageError(ValueError):
    """A user error of a command (bad flag value, unusable file); exits 2 with one line."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


# TCP port numbers (0: the system picks a free port).
PORT_RANGE = (0, 65535)


def port(text: str) -> int:
    """argparse type of a TCP port: an integer in `PORT_RANGE` (the OS would otherwise take
    the number modulo 2**16 and listen somewhere else than the user asked)."""
    lo, hi = PORT_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in {lo}-{hi}, got "
                                         f"{text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"expected a port number in {lo}-{hi}, got {value}")
    return value


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


def add_overwrite_flag(parser) -> None:
    """The --overwrite flag `check_output_path` reads."""
    parser.add_argument("--overwrite", action="store_true",
                        help="allow an output path that is a file git tracks (a committed "
                             "result or profile) to be replaced")
