"""The KV layout: how one model's KV cache is cut into head groups and pages.

This is the contract shared by the scheduler (host side, which reserves pages), the kernels
(device side, which read and write them), the calibration (which produces the budgets) and the
engine. Every mode of the engine is a `KVLayout`:

- ``full``     one group of all KV heads per layer, budget 1 (vLLM's PagedAttention);
- ``dynamic``  one group of all KV heads, the per-input selection decides the count, and the
               pages above it are reclaimed after compression;
- ``tangram``  groups of G heads clustered by calibrated budget, each with its own page table.

Page layout (one pool serves every layer and group because every page has the same shape)::

    k_pages, v_pages: [num_pages, G, page_size, head_dim]

A page holds `page_size` token slots of the G heads of ONE group of ONE layer. Block tables are
``[seq_slot, layer, group, max_pages]`` int32 and retained lengths ``[seq_slot, layer, group]``.
Within a group, head ``j`` of the page is the layer's KV head ``head_perm[layer, group*G + j]``
(weights are permuted at load time so that this is a contiguous slice of heads).

Chunked-compression rule (the single source of truth for how many tokens a group keeps; the
scheduler reserves exactly this and the prefill writes exactly this): a turn's new tokens are cut
into chunks of `chunk_size` (the last one may be shorter); from a chunk of n tokens a group of
budget r keeps ``min(n, ceil(r * n))`` tokens. Decode appends one token to every group per step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Guards ceil() against r * n landing a hair above an integer in floating point
# (0.1 * 30 = 3.0000000000000004 must keep 3, not 4).
_CEIL_EPS = 1e-6


def chunk_keep_count(group_budgets: np.ndarray, chunk_len: int | np.ndarray) -> np.ndarray:
    """Tokens each group keeps from one chunk of `chunk_len` tokens.

    group_budgets: float [..., groups] in (0, 1]; chunk_len: int or int array broadcastable.
    Returns int64 of the broadcast shape: ``min(n, ceil(r * n))``, and 0 for an empty chunk.
    """
    r = np.asarray(group_budgets, dtype=np.float64)
    n = np.asarray(chunk_len, dtype=np.int64)
    keep = np.ceil(r * n - _CEIL_EPS).astype(np.int64)
    return np.minimum(np.maximum(keep, np.minimum(n, 1)), n)


def chunk_lengths(num_tokens: int, chunk_size: int) -> list[int]:
    """The chunk lengths a turn of `num_tokens` new tokens is compressed in."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    full, rest = divmod(num_tokens, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def retained_counts(group_budgets: np.ndarray, num_tokens: int, chunk_size: int) -> np.ndarray:
    """Tokens each group retains after chunked compression of `num_tokens` new prompt tokens.

    group_budgets: [layers, groups] (or any [..., groups]). Returns int64 of the same shape.
    """
    budgets = np.asarray(group_budgets, dtype=np.float64)
    full, rest = divmod(int(num_tokens), chunk_size)
    counts = full * chunk_keep_count(budgets, chunk_size)
    if rest:
        counts = counts + chunk_keep_count(budgets, rest)
    return np.asarray(counts, dtype=np.int64)


def pages_for(num_tokens: np.ndarray | int, page_size: int) -> np.ndarray:
    """Pages needed to hold `num_tokens` slots (elementwise ceil division)."""
    n = np.asarray(num_tokens, dtype=np.int64)
    return (n + page_size - 1) // page_size


@dataclasses.dataclass(frozen=True, eq=False)
class KVLayout:
    """Static description of the paged, grouped KV cache of one model.

    Attributes:
      num_layers, num_kv_heads, head_dim: the model's KV shape.
      group_size: G, KV heads per group (divides num_kv_heads).
      page_size: token slots per page.
      chunk_size: prefill compression chunk (tokens).
      head_perm: int32 [layers, kv_heads]; group g of layer l holds heads
        ``head_perm[l, g*G:(g+1)*G]``.
      group_budgets: float64 [layers, groups] in (0, 1]; 1 means nothing dropped.
      name: a label for reports (``tangram``, ``full``, ``adjacent`` ...).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    page_size: int
    chunk_size: int
    head_perm: np.ndarray
    group_budgets: np.ndarray
    name: str = "tangram"

    def __post_init__(self):
        if self.group_size <= 0 or self.num_kv_heads % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} must divide num_kv_heads {self.num_kv_heads}")
        if self.page_size <= 0 or self.chunk_size <= 0:
            raise ValueError(f"page_size ({self.page_size}) and chunk_size ({self.chunk_size}) "
                             "must be positive")
        perm = np.asarray(self.head_perm, dtype=np.int32)
        if perm.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"head_perm has shape {perm.shape}, expected "
                             f"{(self.num_layers, self.num_kv_heads)} [layers, kv_heads]")
        if not (np.sort(perm, axis=1) == np.arange(self.num_kv_heads)).all():
            raise ValueError("head_perm must be a permutation of the KV heads in every layer")
        budgets = np.asarray(self.group_budgets, dtype=np.float64)
        if budgets.shape != (self.num_layers, self.num_groups):
            raise ValueError(f"group_budgets has shape {budgets.shape}, expected "
                             f"{(self.num_layers, self.num_groups)} [layers, groups]")
        if not np.all((budgets > 0) & (budgets <= 1)) or not np.isfinite(budgets).all():
            raise ValueError("group budgets must lie in (0, 1]")
        object.__setattr__(self, "head_perm", perm)
        object.__setattr__(self, "group_budgets", budgets)
        # The keep rule as a lookup, [chunk_size + 1, layers, groups]: the count of a chunk of
        # every length (the scheduler and the engine ask for it on their hot paths). Read-only:
        # `chunk_keep_counts` hands out its rows.
        keep_by_chunk_len = chunk_keep_count(budgets, np.arange(self.chunk_size + 1)[:, None, None])
        keep_by_chunk_len.flags.writeable = False
        object.__setattr__(self, "_keep_by_chunk_len", keep_by_chunk_len)

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_size

    @property
    def compresses(self) -> bool:
        return bool((self.group_budgets < 1).any())

    def retained_counts(self, num_tokens: int) -> np.ndarray:
        """int64 [layers, groups] tokens kept from a turn of `num_tokens` new prompt tokens
        (`retained_counts` of this layout, read from the per-chunk-length keep table)."""
        full, rest = divmod(int(num_tokens), self.chunk_size)
        if full < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        keep = self._keep_by_chunk_len
        return keep[-1] * full + keep[rest]

    def chunk_keep_counts(self, chunk_len: int) -> np.ndarray:
        """int64 [layers, groups] (read-only) tokens kept from one chunk of `chunk_len` tokens,
        0 <= chunk_len <= chunk_size."""
        if not 0 <= chunk_len <= self.chunk_size:
            raise ValueError(f"a chunk holds 0..{self.chunk_size} tokens, got {chunk_len}")
        return self._keep_by_chunk_len[chunk_len]

    @classmethod
    def monolithic(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                   chunk_size: int, name: str = "full") -> "KVLayout":
        """One group of all KV heads, nothing dropped: what vLLM's PagedAttention stores."""
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   group_size=num_kv_heads, page_size=page_size, chunk_size=chunk_size,
                   head_perm=np.tile(np.arange(num_kv_heads), (num_layers, 1)),
                   group_budgets=np.ones((num_layers, 1)), name=name)
