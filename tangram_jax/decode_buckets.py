"""Decode buckets: the batch sizes a decode step is compiled for.

A decode batch of n sequences runs as the smallest bucket >= n, padded with the null slot, so
only the buckets' shapes are ever compiled. The default is a powers-of-two ladder up to 256
sequences; `EngineConfig.decode_buckets` sets it (sizes above `max_num_seqs` beyond the first
are dropped) and the scheduler pads each step's decode batch to it. A leaf module: the config
and the scheduler both read it, and neither imports the other for it.
"""

from __future__ import annotations

DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of the increasing `buckets` that holds `n` sequences (0 for none).
    StopIteration if none does (callers check that the largest bucket holds every slot)."""
    return next(b for b in buckets if b >= n) if n else 0
