"""Subcommands of the `tangram-jax` CLI (see tangram_jax/cli.py), and what they share:

- `UsageError`, `check_output_path`, `is_git_tracked` (from `tangram_jax.output_paths`): a user
  error, which `cli.main` prints as one line and exits 2; the output-path check below.
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

from tangram_jax.atomic_files import atomic_path, write_text_atomic
from tangram_jax.output_paths import UsageError, check_output_path, is_git_tracked

__all__ = ["UsageError", "atomic_path", "check_output_path", "is_git_tracked", "port", "positive_int",
           "write_text_atomic"]


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


def add_overwrite_flag(parser) -> None:
    """The --overwrite flag `check_output_path` reads."""
    parser.add_argument("--overwrite", action="store_true",
                        help="allow an output path that is a file git tracks (a committed "
                             "result or profile) to be replaced")
