"""Outputs written atomically: to a temporary file in the same folder, then renamed into place,
so an interrupted writer leaves the old file or the new one, never half of one. Used by the CLI
commands and by the benchmarks' result writer."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temporary path beside `path` (same suffix, so writers that infer the format from it
    still work) to write the output to; on success it replaces `path`, on any error or
    interrupt it is removed (the old `path`, if any, stays as it was)."""
    p = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{p.stem}.", suffix=f".partial{p.suffix}",
                               dir=p.parent if str(p.parent) else ".")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
