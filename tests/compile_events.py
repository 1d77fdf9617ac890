"""Counting XLA compiles in tests (JAX's monitoring events)."""

from __future__ import annotations

import threading

import jax


def compiles_on_this_thread() -> list:
    """A list that fills with one entry per XLA compile run on the calling thread from now on
    (a serving thread's, or a build's)."""
    compiles, me = [], threading.current_thread().name
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event)
        if "backend_compile" in event and threading.current_thread().name == me else None)
    return compiles
