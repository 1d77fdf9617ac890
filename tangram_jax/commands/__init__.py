"""Subcommands of the `tangram-jax` CLI (see tangram_jax/cli.py), and what they share:

- `UsageError`: a user error; `cli.main` prints it as one line and exits 2.
- `check_output_path`: an output file's folder must exist and be writable *before* the work
  starts (a typo in `--json` must not cost the whole job).
- `atomic_path` / `write_text_atomic` (from `tangram_jax.atomic_files`): outputs are written to
  a temporary file in the same folder and renamed into place, so an interrupted command leaves
  the old file or the new one, never half of one.
- `positive_int`: argparse type for counts that must be >= 1.
"""

from __future__ import annotations

import argparse
import os
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


def check_output_path(flag: str, path: str | os.PathLike) -> Path:
    """Raise UsageError unless `path` can be written: its folder exists and is writable, and
    the path is not a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} is not writable")
    return p
