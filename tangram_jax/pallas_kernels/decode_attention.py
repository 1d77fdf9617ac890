"""Ragged paged decode attention over head groups, driven by a work list (one launch per layer).

Layout (see `tangram_jax.kv_layout`): the pool ``k_pages, v_pages: [num_pages, G, page_size,
head_dim]`` is shared by every layer and group; this layer's ``block_tables: [batch, groups,
max_pages]`` and ``lengths: [batch, groups]`` say which pages and how many slots each (sequence,
group) uses. Query heads ``j*q_per_kv .. (j+1)*q_per_kv - 1`` of a group attend to its KV head j.

Grid: ``(batch, item, G // heads_per_program)``. Item i of the work list is
``(group, split, num_splits)``: the program reads that group's length, cuts its compute blocks
(``block_tokens`` of page-aligned tokens) into `num_splits` contiguous runs of about equal cost
and runs an online softmax over run `split` for `heads_per_program` KV heads (default 1:
measured fastest, see benchmarks/NOTES.md) and their query heads, writing a normalised partial
output and its log-sum-exp per head. A second Pallas kernel (grid ``(batch, group, query head x
head_dim slice)``) merges the partials of each group by log-sum-exp into the output, so a call
is two launches. The work list is the only thing that differs between the AOT split map, uniform
splits and runtime planning (`split_map.py`): a static one becomes a constant of the jitted step,
a planned one is a runtime int32 array of shape ``[batch, items, 3]``.

Quantised pools (`tangram_jax.kv_quant`, K8V8 / K8V4 / K4V2): the same grid and work lists; the
kernel reads packed codes and per-slot scale / zero instead of pages of values, so a work item
moves fewer bytes (what the split map weighs: `split_map.build_split_map`'s `bytes_per_token`).

Precision tiers (`kv_quant.TieredPages`, ``k8v4-k4v2``: each group's tokens in a K8V4 pool and
a K4V2 pool, block tables and lengths of tier groups): still the same grid, one work list of
groups and two launches. A group's blocks are its high tier's then its low tier's, each block
costing its tier's bytes (`_block_costs`), and an item's run is cut by cost, so one item may read
the end of the high tier and the start of the low tier, dequantising each page in its own
format inside one online softmax; the merge is the untiered one.
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

from tangram_jax import kv_quant
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.backend import dot_f32 as _dot

# Masked logits: far below any real logit, but finite so that max/exp never see inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Query rows of one KV head are padded to this for the matrix unit (tl.dot needs M >= 16).
_MIN_DOT_ROWS = 16
# Work items one merge step reads at once.
_MERGE_CHUNK_ITEMS = 128


def _tier_pools(k_pages, v_pages) -> list[tuple]:
    """The (k, v) pools a decode launch reads, high tier first: one pair, or the two tiers of
    `kv_quant.TieredPages`."""
    if isinstance(k_pages, kv_quant.TieredPages):
        return [(k_pages.high, v_pages.high), (k_pages.low, v_pages.low)]
    return [(k_pages, v_pages)]


def _page_inputs(pages) -> tuple:
    """The arrays a pool passes to the kernel: (pages,) or (codes, scale, zero)."""
    if isinstance(pages, kv_quant.QuantPages):
        return pages.codes, pages.scale, pages.zero
    return (pages,)


def _bits(pages) -> int | None:
    return pages.bits if isinstance(pages, kv_quant.QuantPages) else None


def _slot_bytes(pages) -> int:
    """Bytes of one (token, KV head) slot of a pool's array(s): codes + scale + zero, or a
    row of values."""
    per_page = sum(int(np.prod(a.shape[1:])) * jnp.dtype(a.dtype).itemsize
                   for a in _page_inputs(pages))
    return per_page // int(np.prod(pages.shape[1:3]))


def _block_costs(tier_pools) -> tuple[int, ...]:
    """What one block of each tier costs a work item, in the smallest integers with the ratio of
    the tiers' bytes per slot (K and V): 1 for a single pool, 13 : 7 for K8V4 : K4V2 at
    head_dim 128 (208 : 112 B)."""
    slot_bytes = [_slot_bytes(k) + _slot_bytes(v) for k, v in tier_pools]
    divisor = math.gcd(*slot_bytes)
    return tuple(b // divisor for b in slot_bytes)


def _decode_kernel(work_ref, lengths_ref, block_tables_ref, q_ref, *refs, page_size: int,
                   block_tokens: int, q_per_kv: int, scale: float, max_pages: int,
                   prefetch_page_ids: bool, formats: tuple, block_costs: tuple):
    """One (sequence, work item, KV heads j0 .. j0 + H - 1 of the group) program.

    `formats`: per tier of the pool (one, or high then low with precision tiers) its
    (key_bits, value_bits), None for values stored unquantised; `block_costs`: per tier what one
    block of its pages costs (`_block_costs`: its bytes, scaled to small integers).
    work_ref [items, 3] rows (group, split, num_splits); lengths_ref [tiers * groups] and
    block_tables_ref [tiers * groups, max_pages] of tier groups (``tiers * g + t``: tier t of
    group g; the groups themselves with one tier); q_ref [groups, H, rows, head_dim] over
    q_per_kv real rows (the rest are masked on load, never read); then per tier its K refs and
    its V refs, each either pages [num_pages_t, H, page_size, head_dim] (these KV heads' slab of
    the tier's pool) or, quantised at that tier's bits (`kv_quant`), codes uint8 [num_pages_t,
    H, page_size, head_dim * bits / 8] and scale, zero float32 [num_pages_t, H, page_size];
    o_ref [H, rows, head_dim] float32 and lse_ref [H, rows] float32, both over q_per_kv real
    rows (masked stores).

    A work item's share of its group: the group's tokens are its tiers' pages one after the
    other (high tier first), cut into blocks of `block_tokens`; a block of tier t costs
    ``block_costs[t]`` and the group's total cost W is cut into `num_splits` equal ranges:
    item `split` runs the blocks whose cost starts in ``[split W / n, (split + 1) W / n)``, so
    each item reads about the same bytes whatever the mix of formats, and every block is read
    by exactly one item. One online softmax runs over the item's blocks of every tier (each
    tier's pages dequantised in its own format), so the merge sees one partial per item.

    Quantised tiles are never dequantised element by element: with x = code * s + z per token,
    ``q . k_t = s_t (q . code_t) + z_t sum(q)`` and ``sum_t p_t v_t = (p * s) @ codes + (p . z)``,
    so the matrix unit multiplies the raw codes (exact in bf16) plane by plane (a plane of a
    packed row is a contiguous slice of head_dim, see `kv_quant`), and the scales are applied
    to the [rows, tokens] logits and probabilities. Keys are multiplied in their own tier's
    planes; values accumulate in the first tier's planes (a later tier's codes are gathered
    and shifted per column into them), so the output accumulators are shared by the tiers.
    """
    num_tiers = len(formats)
    tier_refs, rest = [], refs
    for key_bits, value_bits in formats:
        n_k, n_v = (1 if key_bits is None else 3), (1 if value_bits is None else 3)
        tier_refs.append((rest[:n_k], rest[n_k:n_k + n_v]))
        rest = rest[n_k + n_v:]
    o_ref, lse_ref = rest
    item = pl.program_id(1)
    group = work_ref[item, 0]
    split = work_ref[item, 1]
    num_splits = work_ref[item, 2]
    heads = tier_refs[0][0][0].shape[1]
    head_dim = q_ref.shape[-1]
    pages_per_block = max(1, block_tokens // page_size)
    compute_dtype = q_ref.dtype

    # The item's blocks of each tier (the byte-weighted cut of the docstring). Lengths past the
    # block table (a caller's bug) are cut there rather than read out of bounds.
    lengths = [lengths_ref[num_tiers * group + t] for t in range(num_tiers)]
    tier_blocks = [pl.cdiv(jnp.minimum(pl.cdiv(n, page_size), max_pages), pages_per_block)
                   for n in lengths]
    offsets = [jnp.int32(0)]
    for blocks, cost in zip(tier_blocks, block_costs):
        offsets.append(offsets[-1] + blocks * cost)
    total = offsets[-1]
    cut_lo = split * total // jnp.maximum(num_splits, 1)
    cut_hi = jnp.where(num_splits > 0, (split + 1) * total // jnp.maximum(num_splits, 1), cut_lo)
    shares = []           # per tier (first block, blocks, end token)
    for t, cost in enumerate(block_costs):
        first = jnp.minimum(pl.cdiv(jnp.maximum(cut_lo - offsets[t], 0), cost), tier_blocks[t])
        last = jnp.minimum(pl.cdiv(jnp.maximum(cut_hi - offsets[t], 0), cost), tier_blocks[t])
        # Tokens of this share that exist: the last page may be partly filled.
        end_token = jnp.minimum(lengths[t], jnp.minimum(last * pages_per_block, max_pages)
                                * page_size)
        shares.append((first, last - first, end_token))

    rows = q_ref.shape[-2]
    row_real = jnp.arange(rows) < q_per_kv
    row_ids = jnp.arange(rows)[:, None]
    # Python ints as ref indices trip the interpreter's discharge rule: index with int32 arrays.
    head_ids = [jnp.int32(j) for j in range(heads)]

    def planes_of(bits):  # head_dim as the planes a row is packed in (one when not quantised)
        return 1 if bits is None else 8 // bits

    def plane_cols(planes):
        return [p * (head_dim // planes) + jnp.arange(head_dim // planes)[None, :]
                for p in range(planes)]

    # Output accumulators: the first tier's value planes.
    acc_planes = planes_of(formats[0][1])
    acc_cols = plane_cols(acc_planes)
    value_zero = any(v is not None for _, v in formats)
    q_planes = {}         # q of each head in the plane layout of each tier's keys
    for key_bits, _ in formats:
        n = planes_of(key_bits)
        if n in q_planes:
            continue
        if n == 1:        # the whole head (a block load, as before quantised pages existed)
            q_planes[n] = [[plgpu.load(q_ref.at[group, j], mask=row_real[:, None], other=0)]
                           for j in head_ids]
        else:             # per head, planes [rows, d/n]
            q_planes[n] = [[plgpu.load(q_ref.at[group, j, row_ids, cols], mask=row_real[:, None],
                                       other=0) for cols in plane_cols(n)] for j in head_ids]
    # sum(q) per query row, what a key's zero point adds to its logit.
    q_sums = [sum(x.astype(jnp.float32).sum(axis=-1) for x in planes)
              for planes in next(iter(q_planes.values()))]
    offsets_in_block = jnp.arange(block_tokens)

    def load_tile(refs, bits, page, j, slot, token_valid, planes):
        """([tokens, d/planes] x planes in compute_dtype, scale [tokens] or None, zero or
        None). `planes`: the row's own packing (one load, a shift per plane), or another
        plane layout (per plane a gather of the bytes holding its dims and a shift per
        column)."""
        mask = token_valid[:, None]

        def gather(cols):   # every index of a gather is an array (the interpreter cannot mix)
            return plgpu.load(refs[0].at[page[:, None], j, slot[:, None], cols], mask=mask,
                              other=0)
        if bits is None:
            return ([gather(jnp.arange(head_dim)[None, :])] if planes == 1 else
                    [gather(cols) for cols in plane_cols(planes)]), None, None
        levels = jnp.uint8((1 << bits) - 1)
        if planes == planes_of(bits):
            # Shifts and masks on the uint8 codes themselves (no widening to int32: the unpack
            # is per element of every tile, the kernel's main work besides the products).
            codes = gather(jnp.arange(refs[0].shape[-1])[None, :])
            tiles = [(codes if bits == 8 else
                      (codes >> jnp.uint8(p * bits)) & levels).astype(compute_dtype)
                     for p in range(planes)]
        else:
            packed = refs[0].shape[-1]       # dims of one packed plane
            tiles = [((gather(cols % packed) >> ((cols // packed) * bits).astype(jnp.uint8))
                      & levels).astype(compute_dtype) for cols in plane_cols(planes)]
        s = plgpu.load(refs[1].at[page, j, slot], mask=token_valid, other=0)
        z = plgpu.load(refs[2].at[page, j, slot], mask=token_valid, other=0)
        return tiles, s, z

    def run_tier(t, states):
        """The online softmax over this item's blocks of tier t, from `states`."""
        (k_refs, v_refs), (key_bits, value_bits) = tier_refs[t], formats[t]
        first_block, num_blocks, end_token = shares[t]
        table_row = num_tiers * group + t
        qs = q_planes[planes_of(key_bits)]

        def page_ids(block):                                                 # [tokens]
            token = (first_block + block) * block_tokens + offsets_in_block
            # Clamped: the prefetch reads one block past the share; those ids are never used.
            return block_tables_ref[table_row, jnp.minimum(token // page_size, max_pages - 1)]

        def attend(block, page, states):
            token = (first_block + block) * block_tokens + offsets_in_block
            token_valid = token < end_token
            # The K/V tile is gathered as [tokens, head_dim] rows (one page id per token, each
            # page a contiguous run of page_size rows), so it lands in shared memory in the
            # layout the matrix unit reads, with no reshape. Slots past the length are not
            # loaded at all (masked: they may hold anything, NaN included) and read as 0.
            slot = token % page_size
            ks = [load_tile(k_refs, key_bits, page, j, slot, token_valid, planes_of(key_bits))
                  for j in head_ids]
            vs = [load_tile(v_refs, value_bits, page, j, slot, token_valid, acc_planes)
                  for j in head_ids]
            new = []
            for j in range(heads):
                o_prev, o_zero_prev, m_prev, l_prev = states[j]
                k_tile, k_scale, k_zero = ks[j]
                v_tile, v_scale, v_zero = vs[j]
                logits = _dot(qs[j][0], k_tile[0].astype(qs[j][0].dtype), trans_b=True)
                for qp, kp in zip(qs[j][1:], k_tile[1:]):
                    logits = logits + _dot(qp, kp, trans_b=True)
                if key_bits is not None:
                    logits = logits * k_scale[None, :] + q_sums[j][:, None] * k_zero[None, :]
                logits = jnp.where(token_valid[None, :], logits * scale, _MASK_VALUE)
                m_next = jnp.maximum(m_prev, logits.max(axis=-1))
                correction = jnp.exp(m_prev - m_next)
                p = jnp.exp(logits - m_next[:, None])
                l_next = correction * l_prev + p.sum(axis=-1)
                if value_bits is None:
                    weights = p.astype(v_tile[0].dtype)
                    o_zero_next = correction * o_zero_prev if value_zero else o_zero_prev
                else:
                    weights = (p * v_scale[None, :]).astype(compute_dtype)
                    o_zero_next = correction * o_zero_prev + (p * v_zero[None, :]).sum(axis=-1)
                o_next = tuple(correction[:, None] * o + _dot(weights, vp)
                               for o, vp in zip(o_prev, v_tile))
                new.append((o_next, o_zero_next, m_next, l_next))
            return tuple(new)

        if prefetch_page_ids:
            # Page ids of the next block travel in the loop carry, so the K/V gathers do not
            # depend on a load of their own iteration and Triton's pipeliner can keep
            # num_stages - 1 blocks in flight (without this it single-buffers them).
            def body(block, carry):
                page, states = carry
                return page_ids(block + 1), attend(block, page, states)
            return lax.fori_loop(0, num_blocks, body, (page_ids(0), states))[1]
        return lax.fori_loop(0, num_blocks,
                             lambda block, states: attend(block, page_ids(block), states),
                             states)

    states = tuple((tuple(jnp.zeros((rows, head_dim // acc_planes), jnp.float32)
                          for _ in range(acc_planes)),
                    jnp.zeros((rows,), jnp.float32),
                    jnp.full((rows,), _MASK_VALUE, jnp.float32),
                    jnp.zeros((rows,), jnp.float32)) for _ in range(heads))
    for t in range(num_tiers):           # high tier first, the same running softmax
        states = run_tier(t, states)
    for j, (o_planes, o_zero, m, l) in zip(head_ids, states):
        has_tokens = l > 0.0
        denominator = jnp.where(has_tokens, l, 1.0)[:, None]
        lse = jnp.where(has_tokens, m + jnp.log(jnp.where(has_tokens, l, 1.0)), -jnp.inf)
        if not value_zero and acc_planes == 1:
            plgpu.store(o_ref.at[j], o_planes[0] / denominator, mask=row_real[:, None])
        else:
            for o, cols in zip(o_planes, acc_cols):
                plgpu.store(o_ref.at[j, row_ids, cols], (o + o_zero[:, None]) / denominator,
                            mask=row_real[:, None])
        plgpu.store(lse_ref.at[j], lse, mask=row_real)


def _merge_kernel(work_ref, o_part_ref, lse_part_ref, out_ref, *, num_items: int,
                  chunk: int, dim_splits: int):
    """One (sequence, group, query head of the group x head_dim slice) program: log-sum-exp
    merge of the work items that cover this group.

    work_ref [items, 3]; o_part_ref [items, heads_per_group, head_dim] f32 (normalised);
    lse_part_ref [items, heads_per_group] f32; out_ref [head_dim // dim_splits] in the output
    dtype.
    One pass over the row's items in `chunk`-item steps, unrolled (num_items is static), so all
    loads can be in flight at once: only items of this group are read (masked loads), and the
    running maximum rescales what earlier steps summed.
    """
    group = pl.program_id(1)
    head = pl.program_id(2) // dim_splits
    dim_block = out_ref.shape[-1]
    dims = (pl.program_id(2) % dim_splits) * dim_block + jnp.arange(dim_block)[None, :]
    group_col, num_splits_col = jnp.int32(0), jnp.int32(2)
    m = jnp.float32(-jnp.inf)
    num = jnp.zeros(out_ref.shape, jnp.float32)
    den = jnp.float32(0.0)
    for start in range(0, num_items, chunk):
        idx = start + jnp.arange(chunk)
        in_row = idx < num_items
        owned = (plgpu.load(work_ref.at[idx, group_col], mask=in_row, other=-1) == group) & \
            (plgpu.load(work_ref.at[idx, num_splits_col], mask=in_row, other=0) > 0)
        lse = plgpu.load(lse_part_ref.at[idx, head], mask=owned, other=-jnp.inf)   # [chunk]
        o = plgpu.load(o_part_ref.at[idx[:, None], head, dims], mask=owned[:, None],
                       other=0.0)                                               # [chunk, d]
        m_next = jnp.maximum(m, lse.max())
        m_safe = jnp.where(m_next > -jnp.inf, m_next, 0.0)
        rescale = jnp.exp(m - m_safe)                     # 0 while nothing was summed yet
        w = jnp.where(owned, jnp.exp(lse - m_safe), 0.0)
        num = num * rescale + (w[:, None] * o).sum(axis=0)
        den = den * rescale + w.sum()
        m = m_next
    out_ref[...] = (num / jnp.where(den > 0, den, 1.0)).astype(out_ref.dtype)


def merge_partials(o_part: jax.Array, lse_part: jax.Array, work: jax.Array,
                   num_groups: int) -> jax.Array:
    """Log-sum-exp merge of the work items' partial results into one output per group (jnp).

    o_part [batch, items, G, q_per_kv, d] f32 (normalised), lse_part [batch, items, G, q_per_kv],
    work [items, 3] or [batch, items, 3]. Returns [batch, groups, G, q_per_kv, d] f32; groups
    with no tokens 0. The Pallas merge (`_merge_kernel`) computes the same; this one documents
    it and tests it.
    """
    work = jnp.broadcast_to(work, (o_part.shape[0], *work.shape[-2:]))
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
    if isinstance(k_pages, kv_quant.TieredPages) != isinstance(v_pages, kv_quant.TieredPages):
        raise TypeError(f"k_pages and v_pages must both be TieredPages or neither, got "
                        f"{type(k_pages).__name__} and {type(v_pages).__name__}")
    tier_pools = _tier_pools(k_pages, v_pages)
    for k, v in tier_pools:
        if k.ndim != 4 or k.shape[1:] != v.shape[1:] or k.shape[0] != v.shape[0] or \
                k.shape[1:] != tier_pools[0][0].shape[1:]:
            raise ValueError(f"k_pages/v_pages (each tier's) must be [num_pages, G, page_size, "
                             f"head_dim] of one G, page_size and head_dim, got {k.shape} and "
                             f"{v.shape}")
    batch, num_groups, q_rows, head_dim = q.shape
    _, group_size, _, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and pages ({kv_dim}) differ")
    if q_rows % group_size:
        raise ValueError(f"q has {q_rows} heads per group, not a multiple of G={group_size}")
    table_groups = len(tier_pools) * num_groups     # tier groups with tiers
    if block_tables.ndim != 3 or block_tables.shape[:2] != (batch, table_groups):
        raise ValueError(f"block_tables must be [batch={batch}, groups x tiers={table_groups}, "
                         f"max_pages], got {block_tables.shape}")
    if lengths.shape != (batch, table_groups):
        raise ValueError(f"lengths must be [batch={batch}, groups x tiers={table_groups}], got "
                         f"{lengths.shape}")
    for name, a in (("block_tables", block_tables), ("lengths", lengths), ("work_list", work)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    if work.shape[-1] != 3 or work.ndim not in (2, 3) or (work.ndim == 3 and
                                                          work.shape[0] != batch):
        raise ValueError(f"work_list must be [items, 3] or [batch={batch}, items, 3], got "
                         f"{work.shape}")


def _work_spec(work):
    """A shared work list [items, 3] is read by every batch row; a planned one per row."""
    if work.ndim == 2:
        return pl.BlockSpec(work.shape, lambda b, *_: (0, 0))
    return pl.BlockSpec((None, *work.shape[1:]), lambda b, *_: (b, 0, 0))


_STATIC = ("interpret", "block_tokens", "num_warps", "num_stages", "heads_per_program")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_partials(q, k_pages, v_pages, block_tables, lengths, work, *, interpret: bool,
                    block_tokens: int, num_warps: int, num_stages: int,
                    heads_per_program: int = 1):
    """The kernel alone: per work item normalised partial outputs and log-sum-exps. Inputs as
    for `ragged_paged_decode_attention` (one pool, or `kv_quant.TieredPages` with tables and
    lengths of tier groups), unchecked.

    Returns (o_part f32 [batch, items, G, q_per_kv, d], lse f32 [batch, items, G, q_per_kv],
    work as given). `ragged_paged_decode_attention` merges them."""
    batch, num_groups, q_rows, head_dim = q.shape
    _, group_size, page_size, _ = k_pages.shape
    q_per_kv = q_rows // group_size
    rows = max(_MIN_DOT_ROWS, backend.next_power_of_2(q_per_kv))
    pages_per_block = max(1, block_tokens // page_size)
    block_tokens = pages_per_block * page_size
    max_pages = block_tables.shape[-1]
    num_items = work.shape[-2]
    heads = heads_per_program
    if group_size % heads:
        raise ValueError(f"heads_per_program {heads} must divide G={group_size}")
    tier_pools = _tier_pools(k_pages, v_pages)

    kernel = functools.partial(_decode_kernel, page_size=page_size, block_tokens=block_tokens,
                               q_per_kv=q_per_kv, scale=1.0 / math.sqrt(head_dim),
                               max_pages=max_pages, prefetch_page_ids=num_stages >= 3,
                               formats=tuple((_bits(k), _bits(v)) for k, v in tier_pools),
                               block_costs=_block_costs(tier_pools))
    # Each pool array's slab of these KV heads (every tier's, high first): pages [num_pages_t,
    # H, page_size, d'] or per-slot scales [num_pages_t, H, page_size].
    page_arrays = tuple(a for k, v in tier_pools for a in (*_page_inputs(k), *_page_inputs(v)))
    page_specs = [pl.BlockSpec((a.shape[0], heads, *a.shape[2:]),
                               lambda b, i, j, nd=a.ndim: (0, j) + (0,) * (nd - 2))
                  for a in page_arrays]
    # q and the partials keep their q_per_kv real rows; the kernel's blocks have `rows` (a
    # power of two, >= 16 for the matrix unit) and mask the rest on load and store.
    q = q.reshape(batch, num_groups, group_size, q_per_kv, head_dim)
    return *pl.pallas_call(
        kernel,
        grid=(batch, num_items, group_size // heads),
        in_specs=[
            _work_spec(work),
            pl.BlockSpec((None, lengths.shape[1]), lambda b, i, j: (b, 0)),
            pl.BlockSpec((None, *block_tables.shape[1:]), lambda b, i, j: (b, 0, 0)),
            pl.BlockSpec((None, num_groups, heads, rows, head_dim),
                         lambda b, i, j: (b, 0, j, 0, 0)),
            *page_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, heads, rows, head_dim), lambda b, i, j: (b, i, j, 0, 0)),
            pl.BlockSpec((None, None, heads, rows), lambda b, i, j: (b, i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_items, group_size, q_per_kv, head_dim),
                                 jnp.float32),
            jax.ShapeDtypeStruct((batch, num_items, group_size, q_per_kv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=num_warps, num_stages=num_stages),
        name="ragged_paged_decode_attention",
    )(work, lengths, block_tables, q, *page_arrays), work


@functools.partial(jax.jit, static_argnames=("num_groups", "out_dtype", "interpret"))
def merge_partials_pallas(o_part, lse_part, work, *, num_groups: int, out_dtype,
                          interpret: bool):
    """`merge_partials` as one Pallas launch, writing the final layout and dtype.

    o_part [batch, items, G, q_per_kv, d], lse_part [batch, items, G, q_per_kv],
    work [items, 3] or [batch, items, 3] -> [batch, groups, G * q_per_kv, d] in `out_dtype`."""
    batch, num_items, group_size, q_per_kv, head_dim = o_part.shape
    heads = group_size * q_per_kv
    o_part = o_part.reshape(batch, num_items, heads, head_dim)
    lse_part = lse_part.reshape(batch, num_items, heads)
    chunk = min(_MERGE_CHUNK_ITEMS, backend.next_power_of_2(num_items))
    # A chunk of partial outputs is at most 4096 f32 (32 registers a thread at 4 warps), so all
    # chunks of a program stay in flight: long rows (small batches) split head_dim instead.
    dim_block = min(head_dim, max(16, 4096 // chunk))
    dim_splits = head_dim // dim_block
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_items=num_items, chunk=chunk,
                          dim_splits=dim_splits),
        grid=(batch, num_groups, heads * dim_splits),
        in_specs=[
            _work_spec(work),
            pl.BlockSpec((None, num_items, heads, head_dim), lambda b, n, h: (b, 0, 0, 0)),
            pl.BlockSpec((None, num_items, heads), lambda b, n, h: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, dim_block),
                               lambda b, n, h: (b, n, h // dim_splits, h % dim_splits)),
        out_shape=jax.ShapeDtypeStruct((batch, num_groups, heads, head_dim), out_dtype),
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=4, num_stages=1),
        name="ragged_paged_decode_merge",
    )(work, o_part, lse_part)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(q, k_pages, v_pages, block_tables, lengths, work, **kwargs):
    o_part, lse_part, work = decode_partials(q, k_pages, v_pages, block_tables, lengths, work,
                                             **kwargs)
    return merge_partials_pallas(o_part, lse_part, work, num_groups=q.shape[1],
                                 out_dtype=q.dtype, interpret=kwargs["interpret"])


def ragged_paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, work_list,
                                  interpret: bool | None = None, block_tokens: int = 32,
                                  num_warps: int = 2, num_stages: int = 3,
                                  heads_per_program: int = 1) -> jax.Array:
    """Decode attention of one layer for all its head groups, in one launch.

    Args:
      q: [batch, groups, G * q_per_kv, head_dim] (query heads of group g contiguous).
      k_pages, v_pages: [num_pages, G, page_size, head_dim], the whole pool: arrays in q's
        dtype, or `kv_quant.QuantPages` of that logical shape (keys and values may have
        different bits), dequantised on the fly; or precision tiers, `kv_quant.TieredPages`
        (a pool per tier, each read in its own format by the same work items).
      block_tables: int32 [batch, groups, max_pages], this layer's; with tiers [batch,
        2 * groups, max_pages] of tier groups (``2 g`` group g's high tier, ``2 g + 1`` its
        low tier, entries ids of that tier's pool).
      lengths: int32 [batch, groups] retained tokens (0 allowed: that group's output is 0),
        [batch, 2 * groups] with tiers; must be <= max_pages * page_size.
      work_list: int32 [items, 3] rows (group, split, num_splits) of groups (with tiers too: an
        item covers a byte-weighted range of both tiers of its group), shared by every batch row (a
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
    """Gather every group's pages (dequantised: `kv_quant`) and run a masked softmax in jnp
    (float32). Precision tiers (`kv_quant.TieredPages`, tables and lengths of tier groups): both
    tiers of a group as one dense history (`kv_quant.tiered_dense_history`)."""
    if isinstance(k_pages, kv_quant.TieredPages):
        k_pages, v_pages, block_tables, lengths = kv_quant.tiered_dense_history(
            k_pages, v_pages, block_tables, lengths, jnp.float32)
    batch, num_groups, q_rows, head_dim = q.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    max_pages = block_tables.shape[-1]
    tables = jnp.clip(block_tables, 0, num_pages - 1)

    def gather(pages):   # -> [batch, groups, G, max_pages * page_size, d] float32
        x = kv_quant.take_pages(pages, tables, jnp.float32)   # [b, n, max_pages, G, ps, d]
        x = jnp.moveaxis(x, 3, 2)
        return x.reshape(batch, num_groups, group_size, max_pages * page_size, head_dim)

    k = gather(k_pages)
    v = gather(v_pages)
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
