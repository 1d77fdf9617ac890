"""Ragged (varlen) prefill attention over the paged, compressed history plus each row's causal chunk.

A call takes the prefill chunks of several sequences as one ragged batch of rows, flattened along
the token axis (vLLM/FlashAttention's ``cu_seqlens`` layout)::

    q     [N, num_q_heads, head_dim]        row r's tokens are q[row_start[r] : row_start[r] + row_len[r]]
    k, v  [N, num_kv_heads, head_dim]       (RoPE applied, heads in the layout's permuted order)

Row r attends to its retained history (``hist_len[r, g]`` tokens of group g, in the pages of
``block_tables[r, g]``; all of it is in the past, so only the length masks it) and then to its own
keys up to the causal limit. Row starts are multiples of the key block (`row_alignment`), so no
block of queries or keys straddles two rows.

Work decomposition (GQA): one program per (head j of a group, work item); an item is one block of
``block_q`` tokens of one row for one group, and its program computes all ``q_per_kv`` query heads
of KV head ``group * G + j`` at once: the queries of those heads are stacked into the M dimension
of the dots (``block_q * q_per_kv`` rows; q is laid out ``[num_kv_heads, N * q_per_kv, d]``
outside the kernel so the stack is one contiguous tile). The item list is built on the host ahead
of the call (`prefill_work_items`) with the heaviest items first (work = the group's retained
history of that row plus the causal keys), so programs of long-history groups start first and the
short ones fill in behind them: the step does not follow its heaviest group.

Flash-attention online softmax in base 2 (logits scaled by ``log2(e) / sqrt(d)``), float32
accumulation; writes the output and every query's natural log-sum-exp. The scorers need the softmax
of the last `obs_window` valid queries of a row over the row's keys (normalised over history +
chunk): with the log-sum-exp in hand those are ``exp(q . k * scale - lse)``, an
[heads, obs_window, T] product computed beside the kernel (`observation_probs`).

Tuning data (block sizes, warps, stages) lives in `tuning.PREFILL`, measured by
`benchmarks/prefill_8b.py`; `PREFILL_TUNING` is it as a `PrefillTuning`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tangram_jax import kv_quant
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.attention_terms import (NO_WINDOW, apply_sinks,
                                                        first_visible_slot)
from tangram_jax.pallas_kernels.tuning import PREFILL
from tangram_jax.pallas_kernels.backend import dot_f32 as _dot

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Tile shape of the prefill kernel (hashable: a static jit argument).

    block_q: query tokens per item (the dots' M is ``block_q * q_per_kv``, q_per_kv rounded up to
      a power of two); block_k: keys per step (a multiple of the page size); num_warps,
      num_stages: Triton's warps per program and software-pipelining depth.
    target_programs: programs a call should have (~ SMs x resident programs x 2 waves); when
      the rows' query blocks give fewer, items split their history (flash-decoding style) up to
      `max_splits` ways, never below `min_split_keys` history keys per split.
    """

    block_q: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 528
    max_splits: int = 16
    min_split_keys: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got "
                             f"{self.num_warps}, {self.num_stages}")


PREFILL_TUNING = PrefillTuning(**PREFILL)

# Shared memory one program may use: Hopper's 227 KiB per block less a margin for what Triton
# adds (layout conversions, barriers). Seen on the H100: float32 at block_q 64 / block_k 64 with
# 4 query heads per KV head asked for 289 KiB and failed to launch.
_SHARED_MEMORY_BUDGET = 200 * 1024


def fit_tuning(tuning: PrefillTuning, q_per_kv: int, head_dim: int, itemsize: int
               ) -> PrefillTuning:
    """`tuning` with block_q (then block_k, down to 16) halved until one program's tiles fit
    `_SHARED_MEMORY_BUDGET`: the stacked queries [block_q * q_per_kv, d], K and V blocks
    [block_k, d] per pipeline stage, and the float32 probabilities [block_q * q_per_kv, block_k].
    Float32 models need this at the bf16 tile sizes."""
    stack = backend.next_power_of_2(q_per_kv)

    def smem(t):
        m = t.block_q * stack
        return (m * head_dim + 2 * t.num_stages * t.block_k * head_dim) * itemsize \
            + m * t.block_k * 4

    while smem(tuning) > _SHARED_MEMORY_BUDGET:
        if tuning.block_q > 16:
            tuning = dataclasses.replace(tuning, block_q=tuning.block_q // 2)
        elif tuning.block_k > 16:
            tuning = dataclasses.replace(tuning, block_k=tuning.block_k // 2)
        else:
            break
    return tuning


def row_alignment(tuning: PrefillTuning = PREFILL_TUNING) -> int:
    """Row starts in the flat token axis are multiples of this (no tile straddles two rows)."""
    return max(tuning.block_q, tuning.block_k)


def pack_rows(row_lens, alignment: int) -> tuple[np.ndarray, int]:
    """Row starts (int32 [rows]) packing rows of `row_lens` tokens back to back at `alignment`,
    and the tokens they span (the smallest valid N)."""
    lens = np.asarray(row_lens, np.int64)
    extents = -(-lens // alignment) * alignment
    starts = np.concatenate([[0], np.cumsum(extents)[:-1]]).astype(np.int32)
    return starts, int(extents.sum())


def item_capacity(num_tokens: int, num_groups: int, group_size: int,
                  tuning: PrefillTuning = PREFILL_TUNING) -> int:
    """Static item count of a call over `num_tokens` flat tokens: one per (query block, group),
    raised to ``target_programs / group_size`` so short rows can split their history."""
    base = (num_tokens // tuning.block_q) * num_groups
    return max(base, -(-tuning.target_programs // group_size))


def split_slots(num_items: int, num_tokens: int, num_groups: int,
                tuning: PrefillTuning = PREFILL_TUNING) -> int:
    """Partial-output slots of a call: ``max_splits`` when its item list has room beyond one item
    per (query block, group) of the flat axis (only then may items split), else 1. The kernel
    and `prefill_work_items` both decide by this rule."""
    return tuning.max_splits if num_items > (num_tokens // tuning.block_q) * num_groups else 1


def prefill_work_items(row_starts, row_lens, hist_len, *, num_tokens: int,
                       num_items: int | None = None,
                       tuning: PrefillTuning = PREFILL_TUNING) -> np.ndarray:
    """The kernel's item list, heaviest first (host side, ahead of the call).

    row_starts, row_lens: int [rows]; hist_len: int [rows, groups] or [layers, rows, groups];
    num_tokens: N, the flat token axis of the call; num_items: the list's length (default: one
    item per (query block, group) of the rows; `item_capacity` for the runner's calls).
    Returns int32 [num_items, 5] (or [layers, num_items, 5]) rows ``(row, q_block, group, split,
    num_splits)``: ``q_block`` indexes blocks of ``tuning.block_q`` tokens in the flat token
    axis; the item covers share `split` of `num_splits` of the group's history (the last share
    also the causal keys of its block). With room beyond one item per (query block, group)
    (`num_items` above that count), the items whose history dominates are split, one more split
    at a time to the item of largest per-split work, as long as a split keeps at least
    ``min_split_keys`` history keys (at most ``max_splits``): the work of a step is cut in
    proportion to each group's retained length, so groups of large budgets do not set its time.
    Items are sorted by per-split work, largest first. Padding items have row -1 (no-ops).
    """
    block_q = tuning.block_q
    row_starts = np.asarray(row_starts, np.int64)
    row_lens = np.asarray(row_lens, np.int64)
    hist = np.asarray(hist_len, np.int64)
    per_layer = hist.ndim == 3
    if not per_layer:
        hist = hist[None]
    layers, rows, groups = hist.shape
    if row_starts.shape != (rows,) or row_lens.shape != (rows,):
        raise ValueError(f"row_starts {row_starts.shape} and row_lens {row_lens.shape} must be "
                         f"[{rows}] like hist_len's rows")
    if (row_starts % block_q).any():
        raise ValueError(f"row starts {row_starts.tolist()} must be multiples of block_q {block_q}")
    blocks = -(-row_lens // block_q)
    item_row = np.repeat(np.arange(rows), blocks)
    block_in_row = _index_within(blocks)
    q_block = row_starts[item_row] // block_q + block_in_row
    causal = np.minimum((block_in_row + 1) * block_q, row_lens[item_row])    # keys of the chunk
    count = len(item_row) * groups
    if num_items is None:
        num_items = count
    if num_items < count:
        raise ValueError(f"num_items {num_items} < the {count} items of these rows")
    out = np.full((layers, num_items, 5), -1, np.int32)
    out[:, :, 1:] = 0
    h_all = hist[:, item_row].reshape(layers, count).astype(np.float64)       # [layers, items]
    c = np.repeat(causal, groups).astype(np.float64)
    splits_all = np.ones((layers, count), np.int64)
    spare = num_items - count
    if spare and split_slots(num_items, num_tokens, groups, tuning) > 1:
        splits_all += _greedy_splits(h_all, c, spare, tuning)
    # Every layer's items at once: (layer, item, split) in item order, then per layer by
    # per-split work, largest first (a stable sort: ties keep item order).
    per_layer_items = splits_all.sum(axis=1)                                  # [layers]
    per_item = splits_all.reshape(-1)                                         # [layers * items]
    layer = np.repeat(np.arange(layers), per_layer_items)
    item = np.repeat(np.tile(np.arange(count), layers), per_item)
    splits = np.repeat(per_item, per_item)
    split = _index_within(per_item)
    work = h_all[layer, item] / splits + np.where(split == splits - 1, c[item], 0)
    order = np.lexsort((-work, layer))
    layer, item, split, splits = layer[order], item[order], split[order], splits[order]
    slot = _index_within(per_layer_items)
    base, group = np.divmod(item, groups)
    out[layer, slot] = np.stack([item_row[base], q_block[base], group, split, splits], axis=1)
    return out if per_layer else out[0]


def _index_within(counts: np.ndarray) -> np.ndarray:
    """Each element's index among its copies in ``np.repeat(x, counts)``: 0 .. counts[i] - 1
    for the i-th, in order."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _greedy_splits(h: np.ndarray, c: np.ndarray, spare: int,
                   tuning: PrefillTuning) -> np.ndarray:
    """Extra splits per item (int [layers, items]) of `prefill_work_items`: one at a time,
    `spare` times per layer, to the item of largest per-split work ``h / splits + c`` (history
    keys h [layers, items], causal keys c [items]; ties to the lower item), while a split keeps
    at least ``min_split_keys`` history keys and an item at most ``max_splits``. The greedy as
    one sort: an item's s-th split is worth ``h / (s - 1) + c``, which falls with s, so taking
    the `spare` largest candidates of all items takes them in the greedy's order (each item's
    in turn), and a candidate that breaks a limit breaks it for every larger s."""
    layers, count = h.shape
    s = np.arange(2, tuning.max_splits + 1, dtype=np.int64)                  # [S]
    shape = (layers, count * len(s))                    # candidates, item-major per layer
    valid = (h[..., None] >= tuning.min_split_keys * s).reshape(shape)   # h / s >= the least
    key = np.where(valid, (h[..., None] / (s - 1) + c[None, :, None]).reshape(shape), -np.inf)
    # The spare-th largest key; every larger key is taken, equal ones in candidate order (the
    # lower item first, as the greedy's heap breaks ties).
    kth = min(spare, shape[1]) - 1
    cut = -np.partition(-key, kth, axis=-1)[:, kth:kth + 1]                    # [layers, 1]
    above = key > cut
    tied = (key == cut) & valid
    taken = above | (tied & (np.cumsum(tied, axis=-1, dtype=np.int32)
                             <= spare - above.sum(axis=-1, keepdims=True)))
    return taken.reshape(layers, count, len(s)).sum(axis=-1)


def _prefill_kernel(items_ref, row_start_ref, row_len_ref, hist_ref, tables_ref, q_ref, k_ref,
                    v_ref, k_pages_ref, v_pages_ref, lse_in_ref, *refs, block_q: int,
                    block_k: int, q_per_kv: int, group_size: int, page_size: int, scale: float,
                    compiled: bool, windowed: bool):
    """items_ref [items, 5]; row_start/row_len_ref [rows]; hist_ref [rows, groups];
    tables_ref [rows, groups, max_pages]; q_ref [Hkv, N * q_per_kv, d]; k/v_ref [Hkv, N, d];
    k/v_pages_ref [num_pages, page_size, d] (head j of every page); with `windowed`
    window_ref [1] int32 (`attention_terms`: the layer's window, 0 global); o_ref [splits, Hkv,
    N * q_per_kv, d] float32 (each split's normalised partial output); lse_ref [splits, Hkv,
    N * q_per_kv] (base-e log-sum-exp of each partial; the same buffer as lse_in_ref, which
    arrives -inf, so splits nobody writes stay -inf).

    A local layer (window w > 0): query i of a row (slot hist + i) sees history slots and row
    keys within w of it; the blocks wholly before the item's first query's window are skipped
    and every block it reads is masked."""
    del lse_in_ref
    window_ref, o_ref, lse_ref = refs if windowed else (None, *refs)
    j = pl.program_id(0)
    item = pl.program_id(1)
    row = items_ref[item, 0]

    @pl.when(row >= 0)
    def _():
        q_block = items_ref[item, 1]
        group = items_ref[item, 2]
        split = items_ref[item, 3]
        num_splits = items_ref[item, 4]
        kv = group * group_size + j
        start = row_start_ref[row]
        row_len = row_len_ref[row]
        table_pages = tables_ref.shape[2]
        hist = jnp.minimum(hist_ref[row, group], table_pages * page_size)
        m_rows = block_q * q_per_kv
        first_token = q_block * block_q                          # in the flat token axis
        q = q_ref[kv, pl.ds(first_token * q_per_kv, m_rows), :]
        local = first_token - start + jnp.arange(m_rows) // q_per_kv   # query's index in the row
        pages_per_block = block_k // page_size

        def step(k, v, valid, key_valid, carry):
            """One block of keys; valid None: every key is visible to every row (an interior
            block: no masks, and its slots are all written)."""
            o_prev, m_prev, l_prev = carry
            logits = _dot(q, k, trans_b=True) * scale
            if valid is not None:
                logits = jnp.where(valid, logits, _MASK_VALUE)
                v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))   # unowned: NaN
            m_next = jnp.maximum(m_prev, logits.max(axis=-1))
            correction = backend.exp2(m_prev - m_next, fast=compiled)
            p = backend.exp2(logits - m_next[:, None], fast=compiled)
            l_next = correction * l_prev + p.sum(axis=-1)
            o_next = correction[:, None] * o_prev + _dot(p.astype(v.dtype), v)
            return o_next, m_next, l_next

        def history_body(masked, block, carry):
            first_page = block * pages_per_block
            page_ids = tables_ref[row, group, pl.ds(first_page, pages_per_block)]
            if masked:
                page_ids = jnp.where(first_page + jnp.arange(pages_per_block)
                                     < pl.cdiv(hist, page_size), page_ids, 0)
            k = k_pages_ref[page_ids].reshape(block_k, -1)
            v = v_pages_ref[page_ids].reshape(block_k, -1)
            if not masked:
                return step(k, v, None, None, carry)
            slot = first_page * page_size + jnp.arange(block_k)
            key_valid = slot < hist
            valid = jnp.broadcast_to(key_valid[None, :], (m_rows, block_k))
            if windowed:
                valid = valid & (slot[None, :] >= (hist + local - window + 1)[:, None])
            return step(k, v, valid, key_valid, carry)

        def chunk_body(masked, block, carry):
            keys = block * block_k + jnp.arange(block_k)
            k = k_ref[kv, pl.ds(start + block * block_k, block_k), :]
            v = v_ref[kv, pl.ds(start + block * block_k, block_k), :]
            if not masked:
                return step(k, v, None, None, carry)
            key_valid = keys < row_len
            valid = (keys[None, :] <= local[:, None]) & key_valid[None, :]
            if windowed:
                valid = valid & (keys[None, :] >= (local - window + 1)[:, None])
            return step(k, v, valid, key_valid, carry)

        carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((m_rows,), _MASK_VALUE, jnp.float32),
                 jnp.zeros((m_rows,), jnp.float32))
        # This split's share of the history blocks; all but a partial last block are interior.
        first_local = first_token - start
        hist_blocks = pl.cdiv(hist, block_k)
        per_split = pl.cdiv(hist_blocks, num_splits)
        lo = jnp.minimum(split * per_split, hist_blocks)
        hi = jnp.minimum(lo + per_split, hist_blocks)
        interior = jnp.clip(hist // block_k, lo, hi)
        chunk_lo = 0
        if windowed:   # a local layer: from the first query's window on, every block masked
            limited = window_ref[0] > 0
            window = jnp.where(limited, window_ref[0], NO_WINDOW)
            lo = jnp.where(limited, jnp.clip(
                jnp.maximum(hist + first_local - window + 1, 0) // block_k, lo, hi), lo)
            interior = jnp.where(limited, lo, interior)
            chunk_lo = jnp.where(limited, jnp.maximum(first_local - window + 1, 0) // block_k, 0)
        carry = lax.fori_loop(lo, interior, functools.partial(history_body, False), carry)
        carry = lax.fori_loop(interior, hi, functools.partial(history_body, True), carry)
        # The causal keys (last split only): blocks below every query of this item and inside
        # the row are interior; the diagonal and the row's partial end are masked.
        last_key = jnp.minimum(first_local + block_q, row_len)
        chunk_blocks = jnp.where(split == num_splits - 1, pl.cdiv(last_key, block_k), 0)
        visible = jnp.clip(jnp.minimum((first_local + 1) // block_k, row_len // block_k), 0,
                           chunk_blocks)
        if windowed:
            chunk_lo = jnp.minimum(chunk_lo, chunk_blocks)
            visible = jnp.where(limited, chunk_lo, visible)
        carry = lax.fori_loop(chunk_lo, visible, functools.partial(chunk_body, False), carry)
        carry = lax.fori_loop(visible, chunk_blocks, functools.partial(chunk_body, True), carry)
        o, m, l = carry
        has_keys = l > 0.0
        safe_l = jnp.where(has_keys, l, 1.0)
        o_ref[split, kv, pl.ds(first_token * q_per_kv, m_rows), :] = o / safe_l[:, None]
        lse_ref[split, kv, pl.ds(first_token * q_per_kv, m_rows)] = jnp.where(
            has_keys, (m + jnp.log2(safe_l)) * backend.LN2, -jnp.inf)


def dense_history(k_pages, v_pages, block_tables, dtype):
    """Quantised pools (`kv_quant.QuantPages`) as dense pages of the rows' histories.

    Prefill attention is bound by the chunk's own [chunk x (history + chunk)] products, not by
    reading the history (each history page is read once per chunk), so the history is
    dequantised once per layer in XLA (one fused gather + dequantise of the pages the rows'
    tables name) and the kernel runs unchanged on it. (Dequantising in the kernel's loop
    instead, codes plane by plane as the decode kernel reads them, makes first turns 37% slower
    on an H100: an int -> float conversion per code in every query block's program.) Returns
    (k_pages, v_pages, block_tables):
    dense [rows * groups * max_pages, G, page_size, d] pools in `dtype` and tables renumbered
    onto them; dense pools come back as they are.
    """
    if not isinstance(k_pages, kv_quant.QuantPages) and \
            not isinstance(v_pages, kv_quant.QuantPages):
        return k_pages, v_pages, block_tables
    ids = jnp.clip(block_tables.reshape(-1), 0, k_pages.shape[0] - 1)
    compact = jnp.arange(ids.shape[0], dtype=jnp.int32).reshape(block_tables.shape)
    return (kv_quant.take_pages(k_pages, ids, dtype), kv_quant.take_pages(v_pages, ids, dtype),
            compact)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def _ragged_prefill(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts, row_lens,
                    work_items, window, sinks, *, interpret: bool, tuning: PrefillTuning):
    if isinstance(k_pages, kv_quant.TieredPages):
        # Both tiers of a group as one dense history, one launch. (A launch per tier's pool,
        # each over its own dense pages, merged by log-sum-exp, makes first turns 9% slower on
        # an H100: every query block's program runs twice.)
        k_pages, v_pages, block_tables, hist_len = kv_quant.tiered_dense_history(
            k_pages, v_pages, block_tables, hist_len, k.dtype)
    k_pages, v_pages, block_tables = dense_history(k_pages, v_pages, block_tables, k.dtype)
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = num_q_heads // num_kv_heads
    stack = backend.next_power_of_2(q_per_kv)          # Triton tiles are powers of two
    qg = q.reshape(n, num_kv_heads, q_per_kv, head_dim)
    if stack != q_per_kv:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, stack - q_per_kv), (0, 0)))
    qg = jnp.swapaxes(qg, 0, 1).reshape(num_kv_heads, n * stack, head_dim)
    kt, vt = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)            # [Hkv, N, d]
    max_pages = block_tables.shape[-1]
    ppb = tuning.block_k // page_size
    block_tables = jnp.pad(block_tables, ((0, 0), (0, 0), (0, -max_pages % ppb)))
    kernel = functools.partial(
        _prefill_kernel, block_q=tuning.block_q, block_k=tuning.block_k, q_per_kv=stack,
        group_size=group_size, page_size=page_size, scale=backend.LOG2E / math.sqrt(head_dim),
        compiled=not interpret, windowed=window is not None)
    windows = () if window is None else (jnp.reshape(jnp.asarray(window, jnp.int32), (1,)),)
    splits = split_slots(work_items.shape[0], n, num_kv_heads // group_size, tuning)
    lse_init = jnp.full((splits, num_kv_heads, n * stack), -jnp.inf, jnp.float32)
    whole = lambda x: pl.BlockSpec(x.shape, lambda j, i: (0,) * x.ndim)  # noqa: E731
    pool_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda j, i: (0, j, 0, 0))
    o_shape = (splits, *qg.shape)
    parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(group_size, work_items.shape[0]),
        in_specs=[whole(work_items), whole(row_starts), whole(row_lens), whole(hist_len),
                  whole(block_tables), whole(qg), whole(kt), whole(vt), pool_spec, pool_spec,
                  whole(lse_init), *(whole(w) for w in windows)],
        out_specs=[pl.BlockSpec(o_shape, lambda j, i: (0, 0, 0, 0)), whole(lse_init)],
        out_shape=[jax.ShapeDtypeStruct(o_shape, jnp.float32),
                   jax.ShapeDtypeStruct(lse_init.shape, jnp.float32)],
        input_output_aliases={10: 1},
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=tuning.num_warps,
                                                num_stages=tuning.num_stages),
        name="ragged_prefill_attention",
    )(work_items, row_starts, row_lens, hist_len, block_tables, qg, kt, vt, k_pages, v_pages,
      lse_init, *windows)
    if splits == 1:
        out, lse = parts[0], lse_parts[0]
    else:   # merge the splits' partials by their log-sum-exps
        top = lse_parts.max(axis=0)
        safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
        weight = jnp.exp(lse_parts - safe_top)                    # 0 where a split is empty
        total = weight.sum(axis=0)
        out = jnp.where(weight[..., None] > 0, parts, 0.0) * weight[..., None]
        out = out.sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
        lse = jnp.where(total > 0, safe_top + jnp.log(jnp.where(total > 0, total, 1.0)),
                        -jnp.inf)
    out = jnp.swapaxes(out.reshape(num_kv_heads, n, stack, head_dim)[:, :, :q_per_kv], 0, 1)
    lse = lse.reshape(num_kv_heads, n, stack)[:, :, :q_per_kv]
    lse = jnp.moveaxis(lse, 1, 2).reshape(num_q_heads, n)
    # Tokens outside every row (alignment gaps, bucket padding) are not computed: zero them.
    token = jnp.arange(n)
    in_row = ((token[None, :] >= row_starts[:, None]) &
              (token[None, :] < row_starts[:, None] + row_lens[:, None])).any(axis=0)
    out = jnp.where(in_row[:, None, None], out.reshape(n, num_q_heads, head_dim), 0)
    return apply_sinks(out.astype(q.dtype), jnp.where(in_row[None, :], lse, -jnp.inf), sinks)


def _check_ragged(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts, row_lens):
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"q must be [N, Hq, d] and k/v [N, Hkv, d]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on N or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads "
                         f"{k.shape[1]}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != q.shape[2]:
        raise ValueError(f"k_pages/v_pages must be [num_pages, G, page_size, {q.shape[2]}], got "
                         f"{k_pages.shape}, {v_pages.shape}")
    if k.shape[1] % k_pages.shape[1]:
        raise ValueError(f"num_kv_heads {k.shape[1]} is not a multiple of G {k_pages.shape[1]}")
    # Tables and lengths are of groups, or with precision tiers of tier groups (2 per group).
    tiers = 2 if kv_quant.is_tiered(k_pages, v_pages) else 1
    rows, groups = len(row_starts), tiers * (k.shape[1] // k_pages.shape[1])
    if hist_len.shape != (rows, groups) or block_tables.ndim != 3 or \
            block_tables.shape[:2] != (rows, groups) or row_lens.shape != (rows,):
        raise ValueError(f"expected {rows} rows of {groups} {'tier ' * (tiers > 1)}groups: "
                         f"block_tables {block_tables.shape}, hist_len {hist_len.shape}, "
                         f"row_lens {row_lens.shape}")
    for name, x in (("block_tables", block_tables), ("hist_len", hist_len),
                    ("row_starts", row_starts), ("row_lens", row_lens)):
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")


def ragged_prefill_attention(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts,
                             row_lens, work_items, *, interpret: bool | None = None,
                             tuning: PrefillTuning = PREFILL_TUNING, window=None, sinks=None):
    """Attention of a ragged batch of prefill rows over their retained histories and themselves.

    Args:
      q: [N, num_q_heads, head_dim]; k, v: [N, num_kv_heads, head_dim] (flat token axis).
      k_pages, v_pages: [num_pages, G, page_size, head_dim]: arrays, `kv_quant.QuantPages`
        (the history is dequantised: `dense_history`), or `kv_quant.TieredPages` (precision
        tiers: both tiers of a group read as one dense history, `kv_quant.tiered_dense_history`).
      block_tables: int32 [rows, groups, max_pages]; hist_len: int32 [rows, groups] (with tiers
        [rows, 2 groups, ...]: ``2 g`` high, ``2 g + 1`` low, `kv_layout.TieredLayout`).
      row_starts: int32 [rows], multiples of `row_alignment(tuning)`; row_lens: int32 [rows]
        (a row may be empty); rows must not overlap and must fit in N rounded to the alignment
        (`pack_rows` makes such starts).
      work_items: int32 [items, 5] from `prefill_work_items(..., tuning=tuning)`; more items than
        one per (query block, group) (see `item_capacity`) lets items split their history.
      window: None, or an int32 scalar (traced): a local layer's window, 0 for a global layer;
        sinks: None or [num_q_heads] sink logits (`attention_terms`).
    Returns (out [N, num_q_heads, head_dim] in q's dtype, 0 outside every row;
      lse float32 [num_q_heads, N], natural log-sum-exp of each query, -inf where a query has no
      key or lies outside every row).
    """
    _check_ragged(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts, row_lens)
    if tuning.block_k % k_pages.shape[2]:
        raise ValueError(f"block_k {tuning.block_k} must be a multiple of page_size "
                         f"{k_pages.shape[2]}")
    if q.shape[0] % row_alignment(tuning):
        raise ValueError(f"N = {q.shape[0]} must be a multiple of {row_alignment(tuning)} "
                         f"(row_alignment)")
    if work_items.ndim != 2 or work_items.shape[1] != 5 or work_items.dtype != jnp.int32:
        raise ValueError(f"work_items must be int32 [items, 5], got {work_items.shape} "
                         f"{work_items.dtype}")
    return _ragged_prefill(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts,
                           row_lens, work_items, window, sinks,
                           interpret=backend.resolve_interpret(interpret), tuning=tuning)


@functools.partial(jax.jit, static_argnames=("chunk",))
def _row_slices(x, row_starts, chunk: int):
    """[rows, chunk, ...] rows of the flat token axis (clamped at the end; callers mask)."""
    idx = jnp.minimum(row_starts[:, None] + jnp.arange(chunk)[None], x.shape[0] - 1)
    return x[idx]


@functools.partial(jax.jit, static_argnames=("obs_window", "chunk"))
def observation_probs(q, k, lse, row_starts, row_lens, *, obs_window: int, chunk: int):
    """Softmax rows of each row's last `obs_window` valid queries over the row's own keys.

    q [N, Hq, d], k [N, Hkv, d], lse [Hq, N] (from the kernel); row_starts, row_lens [rows].
    Returns float32 [rows, Hq, obs_window, chunk]: entry (r, h, i, t) is the probability that
    query ``row_len - obs_window + i`` of row r puts on the row's key t (normalised over history +
    chunk); 0 for queries before the row's start, masked keys and keys t >= row_len.
    """
    num_q_heads, head_dim = q.shape[1:]
    q_per_kv = num_q_heads // k.shape[1]
    local = row_lens[:, None] - obs_window + jnp.arange(obs_window)[None]    # [rows, W]
    row_ok = local >= 0
    token = row_starts[:, None] + jnp.clip(local, 0, None)
    token = jnp.minimum(token, q.shape[0] - 1)
    q_obs = q[token].astype(jnp.float32)                                       # [rows, W, Hq, d]
    keys = jnp.repeat(_row_slices(k, row_starts, chunk).astype(jnp.float32), q_per_kv, axis=2)
    logits = jnp.einsum("rwhd,rthd->rhwt", q_obs, keys,
                        precision=lax.Precision.HIGHEST) / math.sqrt(head_dim)
    t = jnp.arange(chunk)
    valid = (t[None, None, :] <= local[..., None]) & (t[None, None, :] < row_lens[:, None, None]) \
        & row_ok[..., None]                                                    # [rows, W, T]
    row_lse = jnp.moveaxis(lse[:, token], 0, 1)                               # [rows, Hq, W]
    probs = jnp.exp(jnp.where(valid[:, None], logits - row_lse[..., None], -jnp.inf))
    return jnp.where(valid[:, None], probs, 0.0)


@functools.partial(jax.jit, static_argnames=("tuning",))
def ragged_prefill_attention_reference(q, k, v, k_pages, v_pages, block_tables, hist_len,
                                       row_starts, row_lens, work_items=None, tuning=None, *,
                                       window=None, sinks=None):
    """Float32 jnp reference of `ragged_prefill_attention`: per row, one full softmax of every
    token over [the row's gathered history ; all N keys], masked to the row's own queries and
    causal keys (and a local layer's window), then the sinks (`attention_terms`); builds an
    N x keys matrix per row. `work_items` and `tuning` are accepted for a uniform signature and
    ignored."""
    del work_items, tuning
    if isinstance(k_pages, kv_quant.TieredPages):   # both tiers of a group as one history
        k_pages, v_pages, block_tables, hist_len = kv_quant.tiered_dense_history(
            k_pages, v_pages, block_tables, hist_len, jnp.float32)
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = num_q_heads // num_kv_heads
    rows, groups, max_pages = block_tables.shape
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    num_hist = max_pages * page_size
    qg = q.astype(jnp.float32).reshape(n, num_kv_heads, q_per_kv, head_dim)
    new_k = jnp.moveaxis(k, 0, 1).astype(jnp.float32)                        # [Hkv, N, d]
    new_v = jnp.moveaxis(v, 0, 1).astype(jnp.float32)
    token = jnp.arange(n)
    s = jnp.arange(num_hist)
    out = jnp.zeros((n, num_kv_heads, q_per_kv, head_dim), jnp.float32)
    lse = jnp.full((n, num_kv_heads, q_per_kv), -jnp.inf, jnp.float32)
    for r in range(rows):
        def history(pages):   # -> [num_kv_heads, num_hist, d]
            x = kv_quant.take_pages(pages, tables[r], jnp.float32)   # [groups, P, G, ps, d]
            return jnp.moveaxis(x, 2, 1).reshape(num_kv_heads, num_hist, head_dim)

        keys = jnp.concatenate([history(k_pages), new_k], axis=1)            # [Hkv, S, d]
        vals = jnp.concatenate([history(v_pages), new_v], axis=1)
        local = token - row_starts[r]
        member = (local >= 0) & (local < row_lens[r])                         # [N]
        head_hist = jnp.repeat(hist_len[r], group_size)                      # [Hkv]
        hist_ok = s[None, :] < head_hist[:, None]                             # [Hkv, H]
        chunk_ok = member[None, :] & (local[None, :] <= local[:, None])       # [N(q), N(k)]
        hist_ok = jnp.broadcast_to(hist_ok[None], (n, num_kv_heads, num_hist))
        if window is not None:   # query i of the row sits at slot hist + i
            lower = first_visible_slot(head_hist[None, :] + local[:, None], window)  # [N, Hkv]
            hist_ok = hist_ok & (s[None, None, :] >= lower[..., None])
            chunk_ok = chunk_ok & (local[None, :] >= first_visible_slot(local, window)[:, None])
        valid = jnp.concatenate([hist_ok,
                                 jnp.broadcast_to(chunk_ok[:, None], (n, num_kv_heads, n))],
                                axis=2) & member[:, None, None]               # [N, Hkv, S]
        logits = jnp.einsum("nkjd,ksd->nkjs", qg, keys,
                            precision=lax.Precision.HIGHEST) / math.sqrt(head_dim)
        logits = jnp.where(valid[:, :, None], logits, -jnp.inf)
        m = logits.max(axis=-1, keepdims=True)
        safe_m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(valid[:, :, None], jnp.exp(logits - safe_m), 0.0)
        l = p.sum(axis=-1, keepdims=True)
        p = p / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)
        key_used = valid.any(axis=0)                                          # [Hkv, S]
        o = jnp.einsum("nkjs,ksd->nkjd", p, jnp.where(key_used[..., None], vals, 0.0),
                       precision=lax.Precision.HIGHEST)
        row_lse = jnp.where(l[..., 0] > 0, safe_m[..., 0] + jnp.log(jnp.maximum(l[..., 0],
                                                                                1e-30)), -jnp.inf)
        out = jnp.where(member[:, None, None, None], o, out)
        lse = jnp.where(member[:, None, None], row_lse, lse)
    return apply_sinks(out.reshape(n, num_q_heads, head_dim).astype(q.dtype),
                       jnp.moveaxis(lse.reshape(n, num_q_heads), 0, 1), sinks)


# ----- one chunk of one sequence (the runner's per-chunk contract) -----------------------------
def chunk_prefill_attention(q, k_chunk, v_chunk, k_pages, v_pages, block_table, hist_len,
                            chunk_len, *, obs_window: int, interpret: bool | None = None,
                            tuning: PrefillTuning = PREFILL_TUNING):
    """Attention of one sequence's prefill chunk over its retained history and itself (causal):
    `ragged_prefill_attention` with one row, plus the observation-window probabilities.

    Args:
      q: [T, num_q_heads, head_dim]; k_chunk, v_chunk: [T, num_kv_heads, head_dim] (RoPE applied,
        heads in permuted order); T is the static chunk size, rows >= chunk_len are padding.
      k_pages, v_pages: [num_pages, G, page_size, head_dim]; block_table: int32 [groups,
        max_pages]; hist_len: int32 [groups] retained history tokens.
      chunk_len: int32 scalar, valid rows.
      obs_window: rows of the observation window (static).
    Returns (out [T, num_q_heads, head_dim] in q's dtype, 0 on padding rows;
      obs_probs float32 [num_q_heads, obs_window, T]: row i is query chunk_len - obs_window + i,
      its softmax over history + chunk restricted to the chunk's keys; rows before the chunk
      start are 0).
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, d], got {q.shape}")
    chunk = q.shape[0]
    if obs_window < 1 or obs_window > chunk:
        raise ValueError(f"obs_window must be in [1, T={chunk}], got {obs_window}")
    if block_table.ndim != 2 or hist_len.ndim != 1:
        raise ValueError(f"block_table must be [groups, max_pages] and hist_len [groups], got "
                         f"{block_table.shape}, {hist_len.shape}")
    tuning = fit_tuning(tuning, q.shape[1] // k_chunk.shape[1], q.shape[2], q.dtype.itemsize)
    align = row_alignment(tuning)
    n = -(-chunk // align) * align
    pad = ((0, n - chunk), (0, 0), (0, 0))
    starts = jnp.zeros((1,), jnp.int32)
    lens = jnp.reshape(jnp.asarray(chunk_len, jnp.int32), (1,))
    num_groups = hist_len.shape[0]
    # Items of the whole padded chunk in every group (the kernel stops at the row's length).
    items = prefill_work_items([0], [chunk], np.zeros((1, num_groups)), num_tokens=n,
                               tuning=tuning)
    out, lse = ragged_prefill_attention(
        jnp.pad(q, pad), jnp.pad(k_chunk, pad), jnp.pad(v_chunk, pad), k_pages, v_pages,
        block_table[None], hist_len[None], starts, lens, jnp.asarray(items),
        interpret=interpret, tuning=tuning)
    obs = observation_probs(q, k_chunk, lse[:, :chunk], starts, lens, obs_window=obs_window,
                            chunk=chunk)
    return out[:chunk], obs[0]


@functools.partial(jax.jit, static_argnames=("obs_window",))
def chunk_prefill_attention_reference(q, k_chunk, v_chunk, k_pages, v_pages, block_table,
                                      hist_len, chunk_len, *, obs_window: int):
    """Float32 jnp reference of `chunk_prefill_attention` (through the ragged reference)."""
    chunk = q.shape[0]
    starts = jnp.zeros((1,), jnp.int32)
    lens = jnp.reshape(jnp.asarray(chunk_len, jnp.int32), (1,))
    out, lse = ragged_prefill_attention_reference(q, k_chunk, v_chunk, k_pages, v_pages,
                                                  block_table[None], hist_len[None], starts, lens)
    obs = observation_probs(q, k_chunk, lse, starts, lens, obs_window=obs_window, chunk=chunk)
    return out, obs[0]
