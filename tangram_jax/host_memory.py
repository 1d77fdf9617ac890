"""The machine's host memory, and the default budget of the host-memory KV tier.

A leaf module: the engine's config reads the default (`EngineConfig.host_kv_cache_bytes`) and
the scheduler's host tier (`scheduler/host_pool.py`) is sized by it, neither importing the other.
"""

from __future__ import annotations

import os

# The default host budget: this share of the machine's memory, at most this many bytes
# (vLLM's swap_space defaults to 4 GiB a GPU; host RAM of a GPU server is far larger).
DEFAULT_HOST_SHARE = 0.25
DEFAULT_HOST_CAP_BYTES = 16 << 30


def host_memory_bytes() -> int | None:
    """The machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def default_host_kv_cache_bytes() -> int:
    """A quarter of the machine's memory, at most 16 GiB (1 GiB where it is unknown)."""
    total = host_memory_bytes()
    if total is None:
        return 1 << 30
    return int(min(DEFAULT_HOST_CAP_BYTES, total * DEFAULT_HOST_SHARE))
