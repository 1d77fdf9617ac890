"""Ragged paged decode attention over head groups, driven by a work list (one launch per layer).

Layout (see `tangram_jax.kv_layout`): the pool ``k_pages, v_pages: [num_pages, G, page_size,
head_dim]`` is shared by every layer and group; this layer's ``block_tables: [batch, groups,
max_pages]`` and ``lengths: [batch, groups]`` say which pages and how many slots each (sequence,
group) uses. Query heads ``j*q_per_kv .. (j+1)*q_per_kv - 1`` of a group attend to its KV head j.

Grid: ``(batch, item, G // heads_per_program)``. Item i of the work list is
``(group, split, num_splits)``: the program reads that group's length, cuts its pages into
`num_splits` page-aligned shares of ``ceil(pages / num_splits)`` (rounded up to whole compute
blocks) and runs an online softmax over share `split` for `heads_per_program` KV heads (default 1:
measured fastest, see benchmarks/NOTES.md) and their query heads, writing a normalised partial
output and its log-sum-exp per head. A second, tiny jnp step merges the partials of each group
by log-sum-exp. The work list is the only thing that differs between the AOT split map, uniform
splits and runtime planning (`split_map.py`): a static one becomes a constant of the jitted step,
a planned one is a runtime int32 array of shape ``[batch, items, 3]``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.backend import dot_f32 as _dot

# Masked logits: far below any real logit, but finite so that max/exp never see inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Query rows of one KV head are padded to this for the matrix unit (tl.dot needs M >= 16).
_MIN_DOT_ROWS = 16


def _decode_kernel(work_ref, lengths_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref,
                   o_ref, lse_ref, *, page_size: int, pages_per_block: int, q_per_kv: int,
                   scale: float, max_pages: int):
    """One (sequence, work item, KV heads j0 .. j0 + H - 1 of the group) program.

    work_ref [items, 3]; lengths_ref [groups]; block_tables_ref [groups, max_pages];
    q_ref [groups, H, rows, head_dim] (these KV heads' query rows, padded); k/v_pages_ref
    [num_pages, H, page_size, head_dim] (these KV heads' slab of the pool);
    o_ref [H, rows, head_dim] float32; lse_ref [H, rows] float32.
    """
    item = pl.program_id(1)
    group = work_ref[item, 0]
    split = work_ref[item, 1]
    num_splits = work_ref[item, 2]
    length = lengths_ref[group]
    heads = k_pages_ref.shape[1]
    block_tokens = pages_per_block * page_size

    # Lengths past the block table (a caller's bug) are cut there rather than read out of bounds.
    num_pages = jnp.minimum(pl.cdiv(length, page_size), max_pages)
    pages_per_split = pl.cdiv(pl.cdiv(num_pages, jnp.maximum(num_splits, 1)),
                              pages_per_block) * pages_per_block
    start_page = split * pages_per_split
    end_page = jnp.where(num_splits > 0, jnp.minimum(start_page + pages_per_split, num_pages),
                         start_page)
    end_page = jnp.maximum(end_page, start_page)
    # Tokens of this share that exist: the last page may be partly filled.
    end_token = jnp.minimum(length, end_page * page_size)
    num_blocks = pl.cdiv(end_page - start_page, pages_per_block)

    qs = [q_ref[group, j] for j in range(heads)]                         # [rows, head_dim]
    rows = qs[0].shape[0]

    def body(block, carry):
        first_page = start_page + block * pages_per_block
        page_valid = first_page + jnp.arange(pages_per_block) < end_page
        page_ids = block_tables_ref[group, pl.ds(first_page, pages_per_block)]
        page_ids = jnp.where(page_valid, page_ids, 0)
        # Every head's K and V gathers are issued before any is used.
        ks = [k_pages_ref[page_ids, j].reshape(block_tokens, -1) for j in range(heads)]
        vs = [v_pages_ref[page_ids, j].reshape(block_tokens, -1) for j in range(heads)]
        token_valid = first_page * page_size + jnp.arange(block_tokens) < end_token
        new = []
        for j in range(heads):
            o_prev, m_prev, l_prev = carry[j]
            logits = _dot(qs[j], ks[j], trans_b=True) * scale
            logits = jnp.where(token_valid[None, :], logits, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, logits.max(axis=-1))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(logits - m_next[:, None])
            l_next = correction * l_prev + p.sum(axis=-1)
            # Slots past the length are not ours (may hold anything, NaN included): zero them.
            v = jnp.where(token_valid[:, None], vs[j], jnp.zeros_like(vs[j]))
            o_next = correction[:, None] * o_prev + _dot(p.astype(v.dtype), v)
            new.append((o_next, m_next, l_next))
        return tuple(new)

    init = tuple((jnp.zeros(qs[0].shape, jnp.float32),
                  jnp.full((rows,), _MASK_VALUE, jnp.float32),
                  jnp.zeros((rows,), jnp.float32)) for _ in range(heads))
    final = lax.fori_loop(0, num_blocks, body, init)
    row_written = jnp.arange(rows) < q_per_kv
    for j, (o, m, l) in enumerate(final):
        has_tokens = l > 0.0
        o = o / jnp.where(has_tokens, l, 1.0)[:, None]
        lse = jnp.where(has_tokens, m + jnp.log(jnp.where(has_tokens, l, 1.0)), -jnp.inf)
        plgpu.store(o_ref.at[jnp.int32(j)], o, mask=jnp.broadcast_to(row_written[:, None], o.shape))
        lse_ref[j, :] = lse


def merge_partials(o_part: jax.Array, lse_part: jax.Array, work: jax.Array,
                   num_groups: int) -> jax.Array:
    """Log-sum-exp merge of the work items' partial results into one output per group.

    o_part [batch, items, G, q_per_kv, d] f32 (normalised), lse_part [batch, items, G, q_per_kv],
    work [batch, items, 3]. Returns [batch, groups, G, q_per_kv, d] f32; groups with no tokens 0.
    """
    owner = (work[..., 0:1] == jnp.arange(num_groups)) & (work[..., 2:3] > 0)  # [b, i, groups]
    lse = jnp.where(owner[..., None, None], lse_part[:, :, None], -jnp.inf)     # [b,i,n,G,q]
    m = lse.max(axis=1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[:, None])
    den = w.sum(axis=1)
    num = jnp.einsum("bingq,bigqd->bngqd", w, o_part, precision=lax.Precision.HIGHEST)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _check_inputs(q, k_pages, v_pages, block_tables, lengths, work):
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, groups, G*q_per_kv, head_dim], got {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages/v_pages must both be [num_pages, G, page_size, head_dim], got "
                         f"{k_pages.shape} and {v_pages.shape}")
    batch, num_groups, q_rows, head_dim = q.shape
    _, group_size, _, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and pages ({kv_dim}) differ")
    if q_rows % group_size:
        raise ValueError(f"q has {q_rows} heads per group, not a multiple of G={group_size}")
    if block_tables.ndim != 3 or block_tables.shape[:2] != (batch, num_groups):
        raise ValueError(f"block_tables must be [batch={batch}, groups={num_groups}, max_pages], "
                         f"got {block_tables.shape}")
    if lengths.shape != (batch, num_groups):
        raise ValueError(f"lengths must be [batch={batch}, groups={num_groups}], got "
                         f"{lengths.shape}")
    for name, a in (("block_tables", block_tables), ("lengths", lengths), ("work_list", work)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    if work.shape[-1] != 3 or work.ndim not in (2, 3) or (work.ndim == 3 and
                                                          work.shape[0] != batch):
        raise ValueError(f"work_list must be [items, 3] or [batch={batch}, items, 3], got "
                         f"{work.shape}")


_STATIC = ("interpret", "block_tokens", "num_warps", "num_stages", "heads_per_program")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_partials(q, k_pages, v_pages, block_tables, lengths, work, *, interpret: bool,
                    block_tokens: int, num_warps: int, num_stages: int,
                    heads_per_program: int = 1):
    """The kernel alone: per work item normalised partial outputs and log-sum-exps.

    Returns (o_part f32 [batch, items, G, q_per_kv, d], lse f32 [batch, items, G, q_per_kv],
    work [batch, items, 3]). `ragged_paged_decode_attention` merges them."""
    batch, num_groups, q_rows, head_dim = q.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = q_rows // group_size
    rows = max(_MIN_DOT_ROWS, backend.next_power_of_2(q_per_kv))
    pages_per_block = max(1, block_tokens // page_size)
    max_pages = table_pages = block_tables.shape[-1]
    if max_pages % pages_per_block:
        # Compute blocks start at multiples of pages_per_block: pad so they never read past.
        block_tables = jnp.pad(block_tables,
                               ((0, 0), (0, 0), (0, -max_pages % pages_per_block)))
        max_pages = block_tables.shape[-1]
    if work.ndim == 2:
        work = jnp.broadcast_to(work, (batch, *work.shape))
    num_items = work.shape[1]

    q_pad = q.reshape(batch, num_groups, group_size, q_per_kv, head_dim)
    q_pad = jnp.pad(q_pad, ((0, 0), (0, 0), (0, 0), (0, rows - q_per_kv), (0, 0)))

    kernel = functools.partial(_decode_kernel, page_size=page_size,
                               pages_per_block=pages_per_block, q_per_kv=q_per_kv,
                               scale=1.0 / math.sqrt(head_dim), max_pages=table_pages)
    heads = heads_per_program
    if group_size % heads:
        raise ValueError(f"heads_per_program {heads} must divide G={group_size}")
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(batch, num_items, group_size // heads),
        in_specs=[
            pl.BlockSpec((None, num_items, 3), lambda b, i, j: (b, 0, 0)),
            pl.BlockSpec((None, num_groups), lambda b, i, j: (b, 0)),
            pl.BlockSpec((None, num_groups, max_pages), lambda b, i, j: (b, 0, 0)),
            pl.BlockSpec((None, num_groups, heads, rows, head_dim),
                         lambda b, i, j: (b, 0, j, 0, 0)),
            pl.BlockSpec((num_pages, heads, page_size, head_dim), lambda b, i, j: (0, j, 0, 0)),
            pl.BlockSpec((num_pages, heads, page_size, head_dim), lambda b, i, j: (0, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, heads, rows, head_dim), lambda b, i, j: (b, i, j, 0, 0)),
            pl.BlockSpec((None, None, heads, rows), lambda b, i, j: (b, i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_items, group_size, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_items, group_size, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=num_warps, num_stages=num_stages),
        name="ragged_paged_decode_attention",
    )(work, lengths, block_tables, q_pad, k_pages, v_pages)

    return o_part[..., :q_per_kv, :], lse_part[..., :q_per_kv], work


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(q, k_pages, v_pages, block_tables, lengths, work, **kwargs):
    o_part, lse_part, work = decode_partials(q, k_pages, v_pages, block_tables, lengths, work,
                                             **kwargs)
    out = merge_partials(o_part, lse_part, work, q.shape[1])
    return out.reshape(q.shape).astype(q.dtype)


def ragged_paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, work_list,
                                  interpret: bool | None = None, block_tokens: int = 64,
                                  num_warps: int = 4, num_stages: int = 2,
                                  heads_per_program: int = 1) -> jax.Array:
    """Decode attention of one layer for all its head groups, in one launch.

    Args:
      q: [batch, groups, G * q_per_kv, head_dim] (query heads of group g contiguous).
      k_pages, v_pages: [num_pages, G, page_size, head_dim], the whole pool.
      block_tables: int32 [batch, groups, max_pages], this layer's.
      lengths: int32 [batch, groups] retained tokens (0 allowed: that group's output is 0);
        must be <= max_pages * page_size.
      work_list: int32 [items, 3] rows (group, split, num_splits), shared by every batch row (a
        numpy array from a `SplitMap` becomes a constant of the trace), or [batch, items, 3] per
        row (runtime planned). Rows with num_splits 0 are no-ops.
      block_tokens, num_warps, num_stages, heads_per_program: Triton tuning (tokens per inner
        step = block_tokens // page_size pages; KV heads of the group one program streams).
    Returns [batch, groups, G * q_per_kv, head_dim] in q's dtype; softmax in float32, scale
    1/sqrt(head_dim).
    """
    work = jnp.asarray(work_list, dtype=jnp.int32) if isinstance(work_list, np.ndarray) \
        else work_list
    _check_inputs(q, k_pages, v_pages, block_tables, lengths, work)
    return _decode(q, k_pages, v_pages, block_tables, lengths, work,
                   interpret=backend.resolve_interpret(interpret), block_tokens=block_tokens,
                   num_warps=num_warps, num_stages=num_stages,
                   heads_per_program=heads_per_program)


@jax.jit
def ragged_paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths):
    """Gather every group's pages and run a masked softmax in jnp (float32)."""
    batch, num_groups, q_rows, head_dim = q.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    max_pages = block_tables.shape[-1]
    tables = jnp.clip(block_tables, 0, num_pages - 1)

    def gather(pages):   # -> [batch, groups, G, max_pages * page_size, d]
        x = pages[tables]                                 # [b, n, max_pages, G, page_size, d]
        x = jnp.moveaxis(x, 3, 2)
        return x.reshape(batch, num_groups, group_size, max_pages * page_size, head_dim)

    k = gather(k_pages).astype(jnp.float32)
    v = gather(v_pages).astype(jnp.float32)
    qg = q.reshape(batch, num_groups, group_size, q_rows // group_size, head_dim)
    logits = jnp.einsum("bngqd,bngtd->bngqt", qg.astype(jnp.float32), k,
                        precision=lax.Precision.HIGHEST) / math.sqrt(head_dim)
    valid = jnp.arange(max_pages * page_size) < lengths[:, :, None, None, None]
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(valid, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    v = jnp.where(valid[..., 0, :, None], v, 0.0)
    out = jnp.einsum("bngqt,bngtd->bngqd", p / jnp.where(den > 0, den, 1.0), v,
                     precision=lax.Precision.HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
