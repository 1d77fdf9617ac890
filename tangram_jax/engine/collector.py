"""Python's cyclic garbage collector while an engine is built.

Tracing and lowering the engine's programs leave millions of live Python objects (JAX keeps each
program's jaxpr for the calls that meet it later: 4.1M objects after the CPU warm-up of SmolLM2).
A collection of the oldest generation walks all of them holding Python's lock, and as the heap
grows by a quarter each time, each walk is longer than the last: 0.7, 0.8, 1.3, 1.5, 2.1, 2.9 s
on the 2-core CPU (23 s of collections in a 139 s warm-up), while the lowering (one thread,
under the lock) stood still; an H200 host's faster cores walked the 8B build's heap in 0.02-0.25
s. `paused_collector` turns automatic
collection off for the build; the engine collects once (`collect_once`) when the programs are
lowered and compile outside the lock, so the walk overlaps the compiles instead of the lowering,
and the collector is back on when the build ends (or fails). What survives that collection moves
to the oldest generation, which the next automatic collection of it walks only after a quarter
as many new long-lived objects again.
"""

from __future__ import annotations

import contextlib
import gc
import time


class CollectorPause:
    """The build's pause: `collect_once()` runs the one full collection (later calls do
    nothing); `seconds` is how long it took (None if it did not run)."""

    def __init__(self):
        self.seconds: float | None = None

    def collect_once(self) -> None:
        if self.seconds is None:
            started = time.perf_counter()
            gc.collect()
            self.seconds = time.perf_counter() - started


@contextlib.contextmanager
def paused_collector():
    """Automatic garbage collection off inside the block (if it was on: an embedding program
    that turned it off keeps it off; builds on several threads leave it on once the first that
    paused it ends). Yields the `CollectorPause`."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield CollectorPause()
    finally:
        if was_enabled:
            gc.enable()
