"""The host tier's device side: pool pages copied to host memory and back (`HostKVTier`).

The scheduler decides (`scheduler/host_pool.py`); the KV-cache manager logs each move as a
`HostTransfer` of page ids (`swap_out`, `swap_in`, `discard_swapped`); the step plan carries
them (`StepPlan.host_transfers`) and `ModelRunner.execute` runs them first, in the order
logged, before anything of the step writes the pool (pages a swap-out frees may be reserved
for this very step):

- ``out``: gather the pages of each tier's pool, K and V, every array of the page format
  (quantised codes, scales and zeros as stored), into one device array per leaf, and start its
  copy to host memory (`jax.Array.copy_to_host_async`). The copy runs while the device
  computes the step; a later step keeps the host arrays (numpy) and lets the device ones go,
  once they are ready.
- ``in``: scatter the host copy into the freshly reserved pages (the host-to-device copy is
  queued ahead of the prefill that reads them) and forget it;
- ``drop``: forget it.

A session's pages move in chunks of at most `chunk_pages` (`CHUNK_BYTES` of pages, a power of
two): a swap of a 100k-token session holds a few chunks' device copies at once instead of one
gather of gigabytes, and the compiled copy sizes stop at the chunk's. Page ids are padded to a
power of two from 8 (few compiled sizes): gathers pad with the null page (those rows are cut
off on the host), scatters with an out-of-range id (dropped). Every array of a page format has
the page axis first and the head axis second, so one gather and one scatter serve every format
and, under tensor parallelism, the pool's sharding.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable

import jax
import numpy as np

from tangram_jax import kv_quant
from tangram_jax.host_memory import PINNED_LIMIT_ENV, pinned_pool_limit_bytes
from tangram_jax.pallas_kernels import backend


# The programs of `swap_lowerings`. Their outputs are a swapped session's own pages, not a
# step's working memory: pool sizing leaves them out of the step peak (a whole block table's
# gather would reserve gigabytes beside every pool).
SWAP_PROGRAMS = ("host_copy_out", "host_copy_in")


@jax.jit
def _gather(pool, ids):
    """Pages `ids` (int32 [n]) of every array of `pool` (a (k, v) pair of one tier)."""
    return jax.tree.map(lambda x: x[ids], pool)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(pool, ids, rows):
    """`pool` with pages `ids` (int32 [n]; out of range: dropped) overwritten by `rows`."""
    return jax.tree.map(lambda x, r: x.at[ids].set(r.astype(x.dtype), mode="drop"), pool, rows)


# The most bytes of pages one copy moves (per tier, K and V together).
CHUNK_BYTES = 256 << 20
# Page-locking ahead waits for the engine to be this long without a request, polling this often.
IDLE_SECONDS, IDLE_POLL_SECONDS = 0.2, 0.02


def _wait_until(idle: Callable[[], bool], stop: threading.Event) -> bool:
    """Return True once `idle()` has been true for `IDLE_SECONDS` without a break, False as
    soon as `stop` is set."""
    quiet = 0.0
    while quiet < IDLE_SECONDS:
        if stop.wait(IDLE_POLL_SECONDS):
            return False
        quiet = quiet + IDLE_POLL_SECONDS if idle() else 0.0
    return True


# Every pinning thread still running, with its stop event. A process that exits stops them
# between chunks and waits for the chunk in flight: a daemon thread left inside XLA's
# page-locking while the interpreter shuts down aborts the process ("FATAL: exception not
# rethrown", rc -6: an 8B engine that exited right after its first token, H200).
_PINNING: dict[threading.Thread, threading.Event] = {}
PIN_EXIT_WAIT_SECONDS = 30.0


def _stop_pinning() -> None:
    for thread, stop in list(_PINNING.items()):
        stop.set()
        thread.join(PIN_EXIT_WAIT_SECONDS)


# Runs before the interpreter's shutdown reaches daemon threads.
getattr(threading, "_register_atexit", lambda f: None)(_stop_pinning)


def _padded(n: int) -> int:
    return max(8, backend.next_power_of_2(n))


def chunk_pages(pool) -> int:
    """Pages of `pool` (a (k, v) pair of one tier) one copy moves: the largest power of two
    whose pages fit in `CHUNK_BYTES`, at least 8."""
    page_bytes = sum(int(np.prod(leaf.shape[1:])) * np.dtype(leaf.dtype).itemsize
                     for leaf in jax.tree.leaves(pool))   # arrays or their specs
    return max(8, 1 << max(0, (CHUNK_BYTES // max(page_bytes, 1)).bit_length() - 1))


class HostKVTier:
    """Host copies of swapped-out sessions' pages, by `HostTransfer.handle`.

    Each copy is a list over the tiers of lists of chunks ``(n, rows)``: `rows` a (k, v)
    pytree of the tier's page format whose arrays hold the chunk's n pages first (device
    arrays padded to a bucket while the copy to host memory is in flight, numpy arrays of
    exactly n pages after).

    Args:
      sharding: the pool's sharding (`Placement.pool`), which restored rows are put with.
    """

    def __init__(self, sharding):
        self.sharding = sharding
        # Page-locked host memory where the device offers it: copies out and back run at the
        # link's rate as asynchronous device_puts, with no host-side copy on the step's path
        # (a numpy copy of a 4 GiB session, and a put from pageable memory, stall the step
        # loop for seconds).
        self.host_sharding = pinned_host_sharding(sharding)
        self._copies: dict[int, list[tuple[int, object]]] = {}
        self._in_flight: set[int] = set()
        self._warned_pinned_full = False
        # Page-locked host memory grown ahead of the swaps (`pin_host_memory`), its time, and
        # the event that stops it (`stop_pinning`).
        self.pinned_bytes = 0
        self.pin_seconds = None
        self._pin_stop: threading.Event | None = None

    @property
    def num_copies(self) -> int:
        return len(self._copies)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies that have reached host memory."""
        return sum(int(leaf.nbytes) for handle, tiers in self._copies.items()
                   if handle not in self._in_flight
                   for chunks in tiers for _, rows in chunks for leaf in jax.tree.leaves(rows))

    def apply(self, k_pages, v_pages, transfers) -> tuple:
        """Run `transfers` (in order) against the pool; returns the new (k_pages, v_pages).
        Copies out of earlier steps that have reached host memory are kept as numpy first."""
        self._settle()
        if not transfers:
            return k_pages, v_pages
        pools = kv_quant.tier_pools(k_pages, v_pages)
        for t in transfers:
            if t.kind == "out":
                self._copies[t.handle] = [self._copy_out(pool, ids)
                                          for pool, ids in zip(pools, t.pages)]
                if any(not _pinned(rows) for tier in self._copies[t.handle]
                       for _, rows in tier):
                    self._in_flight.add(t.handle)   # to settle as numpy once it lands
            elif t.kind == "in":
                copy = self._take(t.handle)
                pools = [self._copy_in(pool, ids, chunks)
                         for pool, ids, chunks in zip(pools, t.pages, copy)]
            elif t.kind == "drop":
                self._take(t.handle)
            else:
                raise ValueError(f"unknown host transfer kind {t.kind!r}")
        return kv_quant.from_tier_pools(pools)

    def _take(self, handle: int) -> list:
        self._in_flight.discard(handle)
        try:
            return self._copies.pop(handle)
        except KeyError:
            raise KeyError(f"host tier: no copy {handle}") from None

    def _copy_out(self, pool, ids: np.ndarray) -> list[tuple[int, object]]:
        """Start the copy of pages `ids` of `pool` to host memory, a chunk at a time."""
        step = chunk_pages(pool)
        chunks = []
        for first in range(0, len(ids), step):
            part = ids[first:first + step]
            padded = np.zeros(_padded(len(part)), np.int32)   # padding reads the null page
            padded[:len(part)] = part
            rows = _gather(pool, padded)
            if self.host_sharding is not None:   # stays padded; no host copy to settle
                rows = self._put_pinned(rows)
            if not _pinned(rows):
                for leaf in jax.tree.leaves(rows):
                    leaf.copy_to_host_async()
            chunks.append((len(part), rows))
        return chunks

    def pin_host_memory(self, nbytes: int, *, platforms=("gpu",), wait: bool = False,
                        idle: Callable[[], bool] = lambda: True):
        """Grow XLA's page-locked host pool by about `nbytes` (a device's share each) in a
        background thread, so that swaps never wait for it: the pool grows on demand, and
        page-locking fresh host memory runs at ~2 GB/s inside the allocation, on the step loop
        (the first copy out of a 13 GB session held it 6.4 s on an H200). Freed memory stays in
        the pool. Only on devices of `platforms` (XLA page-locks the host memory of GPUs).
        Returns the thread, or None where nothing is to be pinned; `wait` joins it.
        The engine starts it once it is ready, and it pins a chunk only while `idle()` holds
        (the engine: no request in it), after `IDLE_SECONDS` of it wherever it was broken:
        the pool grows in regions that
        double (256 MiB ... 16 GiB), other CUDA calls wait while one is page-locked (8 GiB:
        ~4 s), and a thread waiting in a device_put holds Python's lock, so a build beside it
        stood still for 0.1 ... 4.8 s at a time (an 8B warm start: 21-23 s to the first token
        beside it, 12.7 s without), and a first request sent as the engine became ready waited
        4.0-4.7 s for its first token. What is not pinned ahead grows inside the copies that
        need it. A process that exits stops it after the chunk in flight."""
        devices = sorted(self.sharding.device_set, key=lambda d: d.id)
        if (self.host_sharding is None or nbytes <= 0
                or not all(d.platform in platforms for d in devices)):
            return None
        share = min(nbytes // len(devices), pinned_pool_limit_bytes() - (1 << 30))

        stop = self._pin_stop = threading.Event()

        def grow() -> None:
            t0 = time.perf_counter()
            try:
                for device in devices:
                    target = pinned_host_sharding(jax.sharding.SingleDeviceSharding(device))
                    # From host memory: a device buffer would take device memory while the
                    # pool is being sized.
                    block = np.zeros(min(CHUNK_BYTES, share), np.uint8)
                    held, quiet = [], False
                    try:
                        while len(held) * block.nbytes < share:
                            quiet = quiet and idle() or _wait_until(idle, stop)
                            if stop.is_set():
                                break
                            held.append(jax.block_until_ready(jax.device_put(block, target)))
                    except jax.errors.JaxRuntimeError:   # the pool's cap: as far as it goes
                        pass
                    self.pinned_bytes += len(held) * block.nbytes
                    del held   # back to the pool, which keeps the memory page-locked
                    if stop.is_set():
                        return
                self.pin_seconds = time.perf_counter() - t0
            finally:
                _PINNING.pop(threading.current_thread(), None)

        thread = threading.Thread(target=grow, name="pin-host-kv", daemon=True)
        _PINNING[thread] = stop
        thread.start()
        if wait:
            thread.join()
        return thread

    def stop_pinning(self) -> None:
        """Stop `pin_host_memory`'s thread after the chunk in flight (its engine was dropped)."""
        if self._pin_stop is not None:
            self._pin_stop.set()

    def _put_pinned(self, rows):
        """`rows` moved to page-locked host memory; `rows` themselves (a device array, to be
        copied to pageable memory) where XLA's pinned pool is full: nothing is lost, the copy
        costs a host-side copy when it settles and a put from pageable memory on its way back."""
        try:
            return jax.device_put(rows, self.host_sharding)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            if not self._warned_pinned_full:
                self._warned_pinned_full = True
                warnings.warn(
                    f"host KV tier: XLA's page-locked host pool is full ({e}); copies that do "
                    f"not fit are kept in pageable memory (slower swaps). Set "
                    f"{PINNED_LIMIT_ENV} (GiB a device) above host_kv_cache_bytes before JAX "
                    f"starts, or lower host_kv_cache_bytes.", RuntimeWarning, stacklevel=2)
            return rows

    def _copy_in(self, pool, ids: np.ndarray, chunks: list[tuple[int, object]]):
        """Scatter a copy's chunks into pages `ids` of `pool` (as many as it holds)."""
        held = sum(n for n, _ in chunks)
        if len(ids) != held:
            raise ValueError(f"host tier: {len(ids)} pages to restore {held} pages into")
        num_pages = jax.tree.leaves(pool)[0].shape[0]
        first = 0
        for n, rows in chunks:
            size = _padded(n)
            padded = np.full(size, num_pages, np.int32)   # out of range: dropped
            padded[:n] = ids[first:first + n]
            first += n
            pool = _scatter(pool, padded, jax.tree.map(lambda r, size=size: self._rows(r, size),
                                                       rows))
        return pool

    def _rows(self, rows, size: int):
        """A copy's rows as a device array of `size` pages (numpy ones padded and put)."""
        if isinstance(rows, jax.Array):   # pinned host or the padded device gather: size pages
            assert rows.shape[0] == size, (rows.shape, size)
            return jax.device_put(rows, self.sharding)   # the layout warm-up compiled for
        pad = np.zeros((size - rows.shape[0], *rows.shape[1:]), rows.dtype)
        return jax.device_put(np.concatenate([rows, pad]), self.sharding)

    def _settle(self) -> None:
        """Copies out whose transfer finished: keep the host arrays, let the device ones go."""
        for handle in list(self._in_flight):
            tiers = self._copies[handle]
            leaves = [leaf for chunks in tiers for _, rows in chunks
                      for leaf in jax.tree.leaves(rows)]
            if all(leaf.is_ready() for leaf in leaves):
                self._copies[handle] = [
                    [(n, jax.tree.map(lambda x, n=n: np.array(np.asarray(x)[:n]), rows))
                     for n, rows in chunks] for chunks in tiers]
                self._in_flight.discard(handle)

    def settle_all(self) -> None:
        """Wait for every copy out to reach host memory (tests, shutdown)."""
        for handle in self._in_flight:
            for chunks in self._copies[handle]:
                for _, rows in chunks:
                    jax.block_until_ready(rows)
        self._settle()


def swap_lowerings(k_pages, v_pages, sharding, max_pages: int) -> list[tuple]:
    """``(name, key, lower)`` of every gather and scatter a swap of up to `max_pages` pages of
    each tier's pool meets, chunks of at most `chunk_pages` (the warm-up compiles them:
    `StepCompilation.warmup_programs`)."""
    programs = []
    for tier, pool in enumerate(kv_quant.tier_pools(k_pages, v_pages)):
        top = _padded(min(max_pages, jax.tree.leaves(pool)[0].shape[0], chunk_pages(pool)))
        for size in (1 << b for b in range(3, top.bit_length())):
            ids = np.zeros(size, np.int32)
            rows = jax.tree.map(lambda x, size=size: jax.ShapeDtypeStruct(
                (size, *x.shape[1:]), x.dtype, sharding=sharding), pool)
            programs.append((SWAP_PROGRAMS[0], dict(tier=tier, pages=size),
                             functools.partial(_gather.lower, pool, ids)))
            programs.append((SWAP_PROGRAMS[1], dict(tier=tier, pages=size),
                             functools.partial(_scatter.lower, pool, ids, rows)))
    return programs


def _pinned(rows) -> bool:
    """Whether a chunk's rows are held in page-locked host memory."""
    return all(isinstance(leaf, jax.Array) and leaf.sharding.memory_kind == "pinned_host"
               for leaf in jax.tree.leaves(rows))


def pinned_host_sharding(sharding):
    """`sharding` in page-locked host memory, or None where its devices have none."""
    devices = sharding.device_set
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices):
        return sharding.with_memory_kind("pinned_host")
    return None


def time_host_copy(device, nbytes: int = 64 << 20) -> tuple[int, float]:
    """(bytes, seconds) of a host-to-device copy of about `nbytes` to `device` from the
    memory the host tier keeps its copies in (page-locked where there is some), the fastest
    of three (the copy back of a swapped session lies on its next turn's path)."""
    data = np.ones(max(1024, nbytes // 4), np.float32)
    target = jax.sharding.SingleDeviceSharding(device)
    pinned = pinned_host_sharding(target)
    if pinned is not None:
        data = jax.block_until_ready(jax.device_put(data, pinned))
    best = float("inf")
    for i in range(4):   # the first put warms the path up and is not counted
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(data, target))
        if i:
            best = min(best, time.perf_counter() - t0)
    return int(data.nbytes), max(best, 1e-9)
