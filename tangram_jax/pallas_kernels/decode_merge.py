"""The decode's second launch: partial outputs of a group's work items merged by log-sum-exp.

`decode_attention.py`'s launch writes, per (sequence, work item), a normalised partial output
and its log-sum-exp; `merge_partials_pallas` (grid ``(batch, group, query head x head_dim
slice)``) merges each group's partials into the output (sinks add their mass to the
denominator), `merge_partials` is its jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.tuning import MERGE_TUNING

# The merge launch's tiles (`tuning.MERGE_TUNING`): work items one step reads at once (at most),
# the f32 elements of a step's partial outputs (head_dim is split to fit), and warps a program.
_MERGE_CHUNK_ITEMS = MERGE_TUNING["chunk_items"]
_MERGE_TILE_F32 = MERGE_TUNING["tile_f32"]
_MERGE_WARPS = MERGE_TUNING["num_warps"]


def _merge_kernel(*refs, num_items: tuple, chunks: tuple, dim_splits: int, sinks: bool):
    """One (sequence, group, query head of the group x head_dim slice) program: log-sum-exp
    merge of the work items that cover this group, over the partials of every decode launch.

    refs: per launch (n of them) its work_ref [items, 3], then per launch o_part_ref [items,
    heads_per_group, head_dim] f32 (normalised), then per launch lse_part_ref [items,
    heads_per_group] f32; then with `sinks` sinks_ref [heads_per_group] f32 (this group's sink
    logits, `attention_terms`: a term of the denominator); then out_ref [head_dim // dim_splits]
    in the output dtype. Each launch's
    partials are read where that launch wrote them (with precision tiers no concatenation of
    the tiers' partials is written and read back first).
    One pass over each launch's items in `chunks`-item steps, unrolled (num_items is static), so
    all loads can be in flight at once: only items of this group are read (masked loads), and
    the running maximum rescales what earlier steps summed.
    """
    n = len(num_items)
    work_refs, o_refs, lse_refs, out_ref = refs[:n], refs[n:2 * n], refs[2 * n:3 * n], refs[-1]
    sinks_ref = refs[3 * n] if sinks else None
    group = pl.program_id(1)
    head = pl.program_id(2) // dim_splits
    dim_block = out_ref.shape[-1]
    dims = (pl.program_id(2) % dim_splits) * dim_block + jnp.arange(dim_block)[None, :]
    group_col, num_splits_col = jnp.int32(0), jnp.int32(2)
    m = jnp.float32(-jnp.inf)
    num = jnp.zeros(out_ref.shape, jnp.float32)
    den = jnp.float32(0.0)
    for work_ref, o_part_ref, lse_part_ref, items, chunk in zip(work_refs, o_refs, lse_refs,
                                                                num_items, chunks):
        for start in range(0, items, chunk):
            idx = start + jnp.arange(chunk)
            in_row = idx < items
            owned = (plgpu.load(work_ref.at[idx, group_col], mask=in_row, other=-1) == group) & \
                (plgpu.load(work_ref.at[idx, num_splits_col], mask=in_row, other=0) > 0)
            lse = plgpu.load(lse_part_ref.at[idx, head], mask=owned, other=-jnp.inf)  # [chunk]
            o = plgpu.load(o_part_ref.at[idx[:, None], head, dims], mask=owned[:, None],
                           other=0.0)                                              # [chunk, d]
            m_next = jnp.maximum(m, lse.max())
            m_safe = jnp.where(m_next > -jnp.inf, m_next, 0.0)
            rescale = jnp.exp(m - m_safe)                     # 0 while nothing was summed yet
            w = jnp.where(owned, jnp.exp(lse - m_safe), 0.0)
            num = num * rescale + (w[:, None] * o).sum(axis=0)
            den = den * rescale + w.sum()
            m = m_next
    if sinks_ref is not None:
        sink = sinks_ref[head]
        den = den + jnp.exp(sink - jnp.where(m > -jnp.inf, m, sink))
    out_ref[...] = (num / jnp.where(den > 0, den, 1.0)).astype(out_ref.dtype)


def merge_partials(o_part: jax.Array, lse_part: jax.Array, work: jax.Array,
                   num_groups: int, sinks: jax.Array | None = None) -> jax.Array:
    """Log-sum-exp merge of the work items' partial results into one output per group (jnp).

    o_part [batch, items, G, q_per_kv, d] f32 (normalised), lse_part [batch, items, G, q_per_kv],
    work [items, 3] or [batch, items, 3]. Returns [batch, groups, G, q_per_kv, d] f32; groups
    with no tokens 0; sinks [groups * G * q_per_kv] or None (`attention_terms`). The Pallas
    merge (`_merge_kernel`) computes the same; this one documents it and tests it.
    """
    work = jnp.broadcast_to(work, (o_part.shape[0], *work.shape[-2:]))
    owner = (work[..., 0:1] == jnp.arange(num_groups)) & (work[..., 2:3] > 0)  # [b, i, groups]
    lse = jnp.where(owner[..., None, None], lse_part[:, :, None], -jnp.inf)     # [b,i,n,G,q]
    m = lse.max(axis=1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[:, None])
    den = w.sum(axis=1)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(den.shape[1:])
        den = den + jnp.exp(sink - m)
    num = jnp.einsum("bingq,bigqd->bngqd", w, o_part, precision=lax.Precision.HIGHEST)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("num_groups", "out_dtype", "interpret"))
def merge_partials_pallas(o_part, lse_part, work, sinks=None, *, num_groups: int, out_dtype,
                          interpret: bool):
    """`merge_partials` as one Pallas launch, writing the final layout and dtype.

    o_part [batch, items, G, q_per_kv, d], lse_part [batch, items, G, q_per_kv],
    work [items, 3] or [batch, items, 3] -> [batch, groups, G * q_per_kv, d] in `out_dtype`.
    Several decode launches' partials (precision tiers launched per tier) are passed as tuples
    of these, a launch an entry (each its own item count and work list), and merged together
    as if their items were one list. sinks: None or [groups * G * q_per_kv] sink logits
    (`attention_terms`)."""
    o_parts, lse_parts, works = _as_tuple(o_part), _as_tuple(lse_part), _as_tuple(work)
    if not len(o_parts) == len(lse_parts) == len(works):
        raise ValueError(f"o_part, lse_part and work must have one entry per launch, got "
                         f"{len(o_parts)}, {len(lse_parts)} and {len(works)}")
    batch, _, group_size, q_per_kv, head_dim = o_parts[0].shape
    heads = group_size * q_per_kv
    num_items = tuple(o.shape[1] for o in o_parts)
    o_parts = [o.reshape(batch, o.shape[1], heads, head_dim) for o in o_parts]
    lse_parts = [x.reshape(batch, x.shape[1], heads) for x in lse_parts]
    chunks = tuple(min(_MERGE_CHUNK_ITEMS, backend.next_power_of_2(i)) for i in num_items)
    # A chunk of partial outputs is at most _MERGE_TILE_F32 (64 registers a thread at 2 warps),
    # so all chunks of a program stay in flight: long rows (small batches) split head_dim.
    dim_block = min(head_dim, max(16, _MERGE_TILE_F32 // max(chunks)))
    dim_splits = head_dim // dim_block
    extra = () if sinks is None else (sinks.astype(jnp.float32).reshape(num_groups, heads),)
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_items=num_items, chunks=chunks,
                          dim_splits=dim_splits, sinks=sinks is not None),
        grid=(batch, num_groups, heads * dim_splits),
        in_specs=[
            *(_work_spec(w) for w in works),
            *(pl.BlockSpec((None, i, heads, head_dim), lambda b, n, h: (b, 0, 0, 0))
              for i in num_items),
            *(pl.BlockSpec((None, i, heads), lambda b, n, h: (b, 0, 0)) for i in num_items),
            *(pl.BlockSpec((None, heads), lambda b, n, h: (n, 0)) for _ in extra),
        ],
        out_specs=pl.BlockSpec((None, None, None, dim_block),
                               lambda b, n, h: (b, n, h // dim_splits, h % dim_splits)),
        out_shape=jax.ShapeDtypeStruct((batch, num_groups, heads, head_dim), out_dtype),
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=_MERGE_WARPS, num_stages=1),
        name="ragged_paged_decode_merge",
    )(*works, *o_parts, *lse_parts, *extra)


def _work_spec(work):
    """A shared work list [items, 3] is read by every batch row; a planned one per row."""
    if work.ndim == 2:
        return pl.BlockSpec(work.shape, lambda b, *_: (0, 0))
    return pl.BlockSpec((None, *work.shape[1:]), lambda b, *_: (b, 0, 0))


def _as_tuple(x) -> tuple:
    """A launch's array as a one-entry tuple; tuples and lists of launches as tuples."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
