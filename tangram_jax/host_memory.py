"""The machine's host memory, the default budget of the host-memory KV tier, and the cap of
XLA's page-locked host pool that the tier's copies live in on GPUs.

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


# XLA's GPU client keeps page-locked host memory in one pool per device that grows on demand up
# to this many GiB (64 unless the environment says otherwise), read once when the backend
# starts. The host tier's copies live there: a budget above the cap would fail its copies.
PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_PINNED_LIMIT_GIB = 64


def pinned_pool_limit_bytes() -> int:
    """The cap of XLA's page-locked host pool a device (bytes), as the environment sets it."""
    try:
        return int(os.environ.get(PINNED_LIMIT_ENV, XLA_PINNED_LIMIT_GIB)) << 30
    except ValueError:
        return XLA_PINNED_LIMIT_GIB << 30


def let_pinned_pool_reach_host_memory() -> None:
    """Raise the pinned pool's cap to the machine's memory unless the environment sets one.

    The pool grows on demand, so the cap only bounds it; `EngineConfig` bounds the host budget
    by the machine's memory, so any valid budget then fits. It takes effect only when called
    before JAX starts its GPU backend (`import tangram_jax` calls it); the host tier keeps
    copies the pool cannot hold in pageable memory (`engine/host_offload.py`)."""
    total = host_memory_bytes()
    if total is not None and (total >> 30) > XLA_PINNED_LIMIT_GIB:
        os.environ.setdefault(PINNED_LIMIT_ENV, str(total >> 30))
