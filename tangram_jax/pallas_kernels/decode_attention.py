"""Ragged paged decode attention over head groups, driven by a work list (a launch per layer
and KV pool, then a merge).

Layout (see `tangram_jax.kv_layout`): the pool ``k_pages, v_pages: [num_pages, G, page_size,
head_dim]`` is shared by every layer and group; this layer's ``block_tables: [batch, groups,
max_pages]`` and ``lengths: [batch, groups]`` say which pages and how many slots each (sequence,
group) uses. Query heads ``j*q_per_kv .. (j+1)*q_per_kv - 1`` of a group attend to its KV head j.

Grid: ``(batch, item, G // heads_per_program)``. Item i of the work list is
``(group, split, num_splits)``: the program reads that group's length, cuts its compute blocks
(``block_tokens`` of page-aligned tokens) into `num_splits` contiguous runs of equal length (to
a block) and runs an online softmax over run `split` for `heads_per_program` KV heads side by
side in one tile (default 1: two heads a tile gain a few percent for K4V2 alone on an H100, not
enough to be the default) and their query heads,
writing a normalised partial output and its log-sum-exp per head. A second Pallas kernel
(grid ``(batch, group, query head x head_dim slice)``) merges the partials of each group by
log-sum-exp into the output (`decode_merge.py`), so a call is two launches. The work list is the only thing that
differs between the AOT split map, uniform splits and runtime planning (`split_map.py`): a
static one becomes a constant of the jitted step, a planned one is a runtime int32 array of
shape ``[batch, items, 3]``.

Quantised pools (`tangram_jax.kv_quant`, K8V8 / K8V4 / K4V2): the same grid and work lists; the
kernel reads packed codes and per-slot scale / zero instead of pages of values, so a work item
moves fewer bytes (what the split map weighs: `split_map.build_split_map`'s `bytes_per_token`).
Compiled kernels unpack the codes (bytes or 16-bit units, by page format: `kv_quant`) in
inline PTX into subnormal operands (`packed_codes.unpack_planes`); interpreted ones (the CPU tests) cast the
same codes, the same products up to powers of two. Slot-pair pools (K4V2) hold two slots' bytes
in each 16-bit unit, so a block's tokens come as two sets (even, odd) of full-width planes.

Precision tiers (`kv_quant.TieredPages`, ``k8v4-k4v2``: each group's tokens in a K8V4 pool and
a K4V2 pool, block tables and lengths of tier groups): one launch whose items are the high
tier's work list then the low tier's (`split_map.build_tier_split_map`: a map over the tier
groups, cut by tier); each program runs the same kernel body over its item's tier
(`decode_pools._parts_kernel`), in that tier's format and tuning, reading only its tier
groups' table rows; then the merge of the launch's partials (a group's items of either tier
are shares of its keys): two launches a layer, as untiered. On an H100 one launch is 3-7%
faster than a launch per tier (`decode_partials` with `tier`, the baseline of
benchmarks/kv_precision_decode.py's ":per-tier" entries;
benchmarks/results/kv_precision_decode_tiers_one_launch.json), whose two half-size launches
each pay a ramp and a last round. (Items that read both tiers in two loops of one body are
slower still: their registers.)
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
from tangram_jax.pallas_kernels.attention_terms import first_visible_slot
from tangram_jax.pallas_kernels.backend import dot_f32 as _dot
from tangram_jax.pallas_kernels.decode_merge import _work_spec, merge_partials_pallas
from tangram_jax.pallas_kernels.decode_pools import (_bits, _check_inputs, _page_inputs,
                                                     _parts_kernel, _slot_pairs, _work_lists,
                                                     decode_tuning)
from tangram_jax.pallas_kernels.packed_codes import code_operand, unpack_planes

# Masked logits: far below any real logit, but finite so that max/exp never see inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Query rows of one KV head are padded to this for the matrix unit (tl.dot needs M >= 16).
_MIN_DOT_ROWS = 16
# The partials' stores ask L2 to keep their lines (`evict_last`): the merge reads them right
# after the launch, and the KV streaming through L2 would evict them first. Measured on an H100
# (benchmarks/results/kv_precision_decode_partials_merge.json): the decode launch itself -1.3%
# (K4V2) and -1.7% (tiers) at 32 x 32k, the merge -0.4 us; equal at 64 x 32k. (`evict_first` on
# the KV loads, and partials in bf16, move nothing.)
_PARTIAL_EVICTION = "evict_last"


def _div(x, d: int):
    """x // d of non-negative int32 x (a logical shift for a power of two d)."""
    if d & (d - 1) == 0:
        return lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))
    return lax.div(x, jnp.int32(d))


def _rem(x, d: int):
    """x % d of non-negative int32 x (a mask for a power of two d)."""
    if d & (d - 1) == 0:
        return x & jnp.int32(d - 1)
    return lax.rem(x, jnp.int32(d))


def _decode_kernel(work_ref, lengths_ref, block_tables_ref, q_ref, *refs, page_size: int,
                   block_tokens: int, q_per_kv: int, scale: float, max_pages: int,
                   prefetch_page_ids: bool, key_bits: int | None, value_bits: int | None,
                   slot_pairs: bool, tier: int, num_tiers: int, compiled: bool, item,
                   starts_ref=None):
    """One (sequence, work item `item`, KV heads j0 .. j0 + H - 1 of the group) program.

    starts_ref (a local layer's window, `attention_terms`): [num_tiers * groups] the first slot
    each group's query sees; the item's blocks wholly before it are skipped and the rest masked.

    work_ref [items, 3] rows (group, split, num_splits); lengths_ref [num_tiers * groups] and
    block_tables_ref [num_tiers * groups, max_pages], of which this launch reads row
    ``num_tiers * group + tier`` (the groups themselves with one tier; with precision tiers
    each tier's launch reads its own tier groups, so no slice of the tables is copied);
    q_ref [groups, H, rows, head_dim] over q_per_kv real rows (the rest are masked on load,
    never read); then the K refs and the V refs, each either pages [num_pages, H, page_size,
    head_dim] (these KV heads' slab of the pool) or, quantised at `key_bits` / `value_bits`
    (`kv_quant`), codes [num_pages, H, page_size, head_dim * bits / unit] (uint8 or uint16
    units: the page format's `code_unit`, each unit 8 or 16 / bits planes; with `slot_pairs`
    uint16 [num_pages, H, page_size / 2, head_dim * bits / 8], a byte row of each of two
    adjacent slots) and scale, zero
    float32 [num_pages, H, page_size] (values in groups, `kv_quant.scale_shape`: [...,
    groups], one a plane, so each plane's product is weighed by its own scale and zero);
    o_ref [H, rows, head_dim] float32 and lse_ref [H, rows] float32, both over q_per_kv real
    rows (masked stores).

    A work item's share of its group: the group's pages cut into blocks of `block_tokens`, B
    blocks cut into `num_splits` equal ranges: item `split` runs the blocks in
    ``[floor(split B / n), floor((split + 1) B / n))``, so every block is read by exactly one
    item and the items of a group differ by at most one block.

    Quantised tiles are never dequantised element by element: with x = code * s + z per token,
    ``q . k_t = s_t (q . code_t) + z_t sum(q)`` and ``sum_t p_t v_t = (p * s) @ codes + (p . z)``,
    so the matrix unit multiplies the codes (exact in the operand dtype, `code_operand`) plane
    by plane (a plane of a packed row is a contiguous slice of head_dim, see `kv_quant`), and
    the scales are applied to the [rows, tokens] logits and probabilities. Compiled, the codes
    are unpacked by inline PTX on 32-bit words into subnormal operands (`unpack_planes`), whose
    powers of two the per-token key scale and the output's final scale take back (exactly: the
    products are the codes', scaled; `code_operand`). The softmax runs in base 2:
    scale * log2(e) is folded into the per-token key scale and zero (bf16 pools: into the
    logits), and each exp2 is one ``ex2.approx`` (`backend.exp2`): each of the two cuts the
    quantised formats' time on an H100 (libdevice's exp wraps the MUFU in range reduction).
    """
    n_k, n_v = (1 if key_bits is None else 3), (1 if value_bits is None else 3)
    k_refs, v_refs = refs[:n_k], refs[n_k:n_k + n_v]
    o_ref, lse_ref = refs[n_k + n_v:]
    group = work_ref[item, 0]
    split = work_ref[item, 1]
    num_splits = work_ref[item, 2]
    table_row = num_tiers * group + tier
    length = lengths_ref[table_row]
    heads = k_refs[0].shape[1]
    head_dim = q_ref.shape[-1]
    pages_per_block = max(1, block_tokens // page_size)
    compute_dtype = q_ref.dtype
    # Operand dtype, code exponent E and other-operand exponent S of the key and value codes
    # (`code_operand`): a product of codes comes out 2^(E + S) times the codes' own.
    k_dtype, k_exp, q_exp = (code_operand(key_bits, compute_dtype, compiled=compiled)
                             if key_bits else (compute_dtype, 0, 0))
    v_dtype, v_exp, w_exp = (code_operand(value_bits, compute_dtype, values=True,
                                          compiled=compiled)
                             if value_bits else (compute_dtype, 0, 0))
    log2_scale = scale * backend.LOG2E

    # The item's blocks (the cut of the docstring). Lengths past the block table (a caller's
    # bug) are cut there rather than read out of bounds.
    total_blocks = pl.cdiv(jnp.minimum(pl.cdiv(length, page_size), max_pages), pages_per_block)
    n = jnp.maximum(num_splits, 1)
    first_block = jnp.minimum(split * total_blocks // n, total_blocks)
    last_block = jnp.where(num_splits > 0,
                           jnp.minimum((split + 1) * total_blocks // n, total_blocks),
                           first_block)
    start_token = 0
    if starts_ref is not None:
        start_token = starts_ref[table_row]
        first_block = jnp.maximum(first_block, _div(start_token, block_tokens))
    num_blocks = jnp.maximum(last_block - first_block, 0)
    # Tokens of this share that exist: the last page may be partly filled.
    end_token = jnp.minimum(length, jnp.minimum(last_block * pages_per_block, max_pages)
                            * page_size)

    # The program's H KV heads share one tile (`heads_per_program`): head h's q_per_kv query
    # rows are rows h q_per_kv .. of the [rows, .] tiles, and each plane's columns are the H
    # heads' slices side by side ([tokens, H d/n] code tiles, gathered in one load). Head h's
    # query rows are zero outside its own columns, so one product per plane gives every row its
    # own head's logits, and the value product's columns of other heads are never stored: the
    # softmax, masks and scales run once on one tile for all H heads.
    rows = q_ref.shape[-2]
    row_ids = jnp.arange(rows)[:, None]
    row_head = jnp.minimum(jnp.arange(rows) // q_per_kv, heads - 1)          # [rows]
    row_in_head = jnp.arange(rows) - row_head * q_per_kv
    row_real = jnp.arange(rows) < heads * q_per_kv
    # head_dim as the planes the keys / values are packed in (one plane when not quantised):
    # the planes a token's code unit holds (a byte, or a uint16; slot-pair uint16 hold a byte
    # of each of two tokens); plane p's codes come c 2^(bits (p mod 8/bits)) from the unpack
    # (`unpack_planes`).
    k_planes, v_planes = (1 if bits is None else kv_quant.codes_per_unit(
        bits, kv_quant.unit_of(refs_[0].dtype, slot_pairs))
        for bits, refs_ in ((key_bits, k_refs), (value_bits, v_refs)))
    k_shift = [0 if key_bits is None else key_bits * (p % (8 // key_bits))
               for p in range(k_planes)]
    v_shift = [0 if value_bits is None else value_bits * (p % (8 // value_bits))
               for p in range(v_planes)]
    k_width, v_width = head_dim // k_planes, head_dim // v_planes     # a plane's dims a head

    # Python ints as ref indices trip the interpreter's discharge rule: index with int32 arrays.
    head_ids = [jnp.int32(j) for j in range(heads)]

    def columns(width):
        """(head, dim of the head's plane) of a plane's [1, H * width] columns (one head: head
        0 as a scalar index, so the gathers are those of a one-head kernel)."""
        if heads == 1:
            return head_ids[0], jnp.arange(width)[None, :]
        c = jnp.arange(heads * width)[None, :]
        return lax.div(c, jnp.int32(width)), lax.rem(c, jnp.int32(width))

    def store_rows(col_head):
        """[rows, H w] output rows of a tile's entries in head `col_head`'s block of the output:
        a row's own head's entries its row of that head; every other entry (masked off) a
        distinct row past the real ones, so no two entries of a store share an address (an
        interpreted masked store writes every address)."""
        r = jnp.arange(rows)[:, None]
        first = col_head * q_per_kv
        own = (r >= first) & (r < first + q_per_kv)
        return jnp.where(own, r - first, q_per_kv + jnp.where(r < first, r, r - q_per_kv))

    def per_row(vectors):
        """[rows, tokens] tile of per-head [tokens] vectors: each row its own head's."""
        tile = vectors[-1][None, :]
        for h in range(heads - 2, -1, -1):
            tile = jnp.where((row_head == h)[:, None], vectors[h][None, :], tile)
        return tile

    # Scale / zero groups of a value row: a trailing axis of the scale ref when above 1.
    value_groups = v_refs[1].shape[-1] if value_bits and len(v_refs[1].shape) == 4 else 1
    if v_planes % value_groups:
        raise ValueError(f"value scale groups ({value_groups}) must divide the value planes "
                         f"({v_planes}): a plane's dims lie in one group")
    if heads == 1 and k_planes == 1:  # the whole head (a block load, as before quantised pages)
        q_raw = [plgpu.load(q_ref.at[group, head_ids[0]], mask=row_real[:, None], other=0)]
    else:                           # planes [rows, H d/n], zero outside a row's head
        col_head, col_dim = columns(k_width)
        q_rows, q_mask = (row_ids, row_real[:, None]) if heads == 1 else \
            (row_in_head[:, None], row_real[:, None] & (row_head[:, None] == col_head))
        q_raw = [plgpu.load(q_ref.at[group, col_head, q_rows, p * k_width + col_dim],
                            mask=q_mask, other=0) for p in range(k_planes)]
    # sum(q) per query row, what a key's zero point adds to its logit.
    q_sums = sum(x.astype(jnp.float32).sum(axis=-1) for x in q_raw) \
        if key_bits is not None else None
    # Key plane p's operands are c * 2^(key_bits p + E): its q plane is scaled by
    # 2^(S - key_bits p) (exact: powers of two), so every plane's product is 2^(E + S) q.c.
    qs = [x.astype(k_dtype) if key_bits is None else
          (x.astype(jnp.float32) * 2.0 ** (q_exp - k_shift[p])).astype(k_dtype)
          for p, x in enumerate(q_raw)]
    key_code_scale = 2.0 ** -(k_exp + q_exp)
    # Tokens are never negative, so page and slot are a truncating division and remainder
    # (`_div` / `_rem`: a shift and a mask for a power of two): jnp's floor `//` and `%` add sign
    # fix-ups per token that hide from Triton's axis analysis that a page id is constant (and a
    # slot contiguous) over a page's tokens: on an H100 the fix-ups cost K4V2 14-20% of its time
    # and the other formats up to 7% (outputs bit for bit the same either way). (Signed
    # `lax.div` by a power of two still costs a fix-up per index, hence the shift.)

    # Token sets: a unit row of a slot-pair pool (`kv_quant.PageFormat.slot_pairs`) holds two
    # adjacent slots, so a block is gathered as block_tokens / 2 unit rows (its even tokens) and
    # each row unpacks into an even-token plane and an odd-token plane of full width: the block
    # is two token sets (even, odd), with products, scales and masks per set and one max and one
    # sum over both. Other pools: one set, a row a token. Pairs keep 16-bit operand layouts
    # for K4V2's full-width planes (see `kv_quant`: operands from 8-bit loads cost copies).
    sets = 2 if slot_pairs else 1
    row_offsets = jnp.arange(block_tokens) if sets == 1 else 2 * jnp.arange(block_tokens // 2)

    def first_tokens(block):
        """The first token of each of the block's unit rows [unit rows]."""
        return (first_block + block) * block_tokens + row_offsets

    def set_tokens(block):
        """Per token set: (slot of each unit row's token in its page, whether the token is in
        the share) [unit rows]."""
        first = first_tokens(block)
        tokens = [first] + [first + s for s in range(1, sets)]
        if starts_ref is not None:
            return [(_rem(token, page_size), (token < end_token) & (token >= start_token))
                    for token in tokens]
        return [(_rem(token, page_size), token < end_token) for token in tokens]

    def page_ids(block):                                                  # [unit rows]
        first = first_tokens(block)
        # Clamped: the prefetch reads one block past the share; those ids are never used.
        ids = block_tables_ref[table_row, jnp.minimum(_div(first, page_size), max_pages - 1)]
        # Quantised codes are read unmasked (`load_tile`): entries past a group's pages may hold
        # anything, so the ids are clamped into the pool.
        return ids if key_bits is None else jnp.clip(ids, 0, k_refs[0].shape[0] - 1)

    def per_slot(ref, page, tokens, masked=True):
        """A per-slot ref's (scale, zero) [unit rows] vectors: per token set, per scale group
        (a trailing groups axis is read a group at a time), per head; unmasked (`masked`
        False) slots past the share are read as they are."""
        groups = [()] if len(ref.shape) == 3 else \
            [(jnp.int32(g),) for g in range(ref.shape[-1])]
        return [[[plgpu.load(ref.at[(page, j, slot, *g)], mask=valid if masked else None,
                             other=0 if masked else None)
                  for j in head_ids] for g in groups] for slot, valid in tokens]

    def load_tile(refs, bits, operand, page, tokens, zeros=None):
        """Per token set: ([unit rows, H d/n] planes, scales, zeros); quantised planes are
        operands of the codes (`operand`: their (dtype, exponent), `unpack_planes`); scales and
        zeros are per scale group of the row (one, or one a plane with value groups:
        `kv_quant.scale_shape`) lists of per-head vectors (`per_row` makes the tiles), None
        unquantised; `zeros` given (loaded a block ahead) are used as they are."""
        slot, valid = tokens[0]
        unit_slot = slot if sets == 1 else _div(slot, sets)
        # Every index of a gather is an array (the interpreter cannot mix arrays and slices).
        head, dims = columns(refs[0].shape[-1])
        if bits is None:
            raw = plgpu.load(refs[0].at[page[:, None], head, unit_slot[:, None], dims],
                             mask=valid[:, None], other=0)
            return [([raw], None, None)]
        # Codes, and the key scales and zeros, are read unmasked: codes are integers, so a slot
        # past the share unpacks into finite operands, and its logit (whatever the key scale
        # and zero, NaN included) is replaced by the mask value, so its weight is exactly 0
        # (a slot pair's odd slot was always read so). Value scales and zeros stay masked: a
        # NaN there times a weight of 0 would be NaN. No masks is fewer instructions a copy (the
        # cp.async's zero-fill size).
        raw = plgpu.load(refs[0].at[page[:, None], head, unit_slot[:, None], dims])
        # The unpack is per element of every tile, the kernel's main work besides the
        # products: compiled, a few 32-bit instructions per 4 bytes (`unpack_planes`). With
        # slot pairs the low bytes' planes are the even tokens', the high bytes' the odd's.
        planes = unpack_planes(raw, bits, *operand)
        n = len(planes) // sets
        keys = refs is k_refs
        scales = per_slot(refs[1], page, tokens, masked=not keys)
        zeros = per_slot(refs[2], page, tokens, masked=not keys) if zeros is None else zeros
        return [(planes[s * n:(s + 1) * n], scales[s], zeros[s]) for s in range(sets)]

    def attend(block, page, state, v_zeros=None):
        tokens = set_tokens(block)
        # The K/V tile is gathered as [unit rows, H head_dim] rows (one page id per row, each
        # page a contiguous run of rows), so it lands in shared memory in the layout the
        # matrix unit reads, with no reshape. Slots past the length may hold anything, NaN
        # included: unquantised ones are not loaded (masked, read as 0); quantised codes are
        # loaded and their logits masked (`load_tile`).
        k_sets = load_tile(k_refs, key_bits, (k_dtype, k_exp), page, tokens)
        v_sets = load_tile(v_refs, value_bits, (v_dtype, v_exp), page, tokens, v_zeros)
        o_prev, o_zero_prev, m_prev, l_prev = state
        logits = []
        for (_, valid), (k_tile, k_scales, k_zeros) in zip(tokens, k_sets):
            lg = _dot(qs[0], k_tile[0].astype(qs[0].dtype), trans_b=True)
            for qp, kp in zip(qs[1:], k_tile[1:]):
                lg = lg + _dot(qp, kp, trans_b=True)
            # Logits in base 2 (the softmax's exp is then one ex2): scale * log2(e) is folded
            # into the per-token key scale and zero, and the scale also takes the products'
            # 2^-(E + S) (`key_code_scale`), per token not per code.
            if key_bits is not None:
                (k_scale,), (k_zero,) = k_scales, k_zeros              # keys: one group a row
                lg = (lg * per_row([s * (log2_scale * key_code_scale) for s in k_scale])
                      + q_sums[:, None] * per_row([z * log2_scale for z in k_zero]))
            else:
                lg = lg * log2_scale
            logits.append(jnp.where(valid[None, :], lg, _MASK_VALUE))
        m_next = jnp.maximum(m_prev, functools.reduce(jnp.maximum, logits).max(axis=-1))
        correction = backend.exp2(m_prev - m_next, fast=compiled)
        p = [backend.exp2(lg - m_next[:, None], fast=compiled) for lg in logits]
        l_next = correction * l_prev + functools.reduce(jnp.add, p).sum(axis=-1)
        o_next = [correction[:, None] * o for o in o_prev]
        for p_set, (v_tile, v_scales, _) in zip(p, v_sets):
            # One scale a row, or one a plane (value groups).
            weights = [p_set.astype(v_tile[0].dtype)] if value_bits is None else \
                [(p_set * per_row([s * 2.0 ** w_exp for s in sc])).astype(v_dtype)
                 for sc in v_scales]
            o_next = [o + _dot(weights[i * len(weights) // v_planes], vp)
                      for i, (o, vp) in enumerate(zip(o_next, v_tile))]
        o_zero_next = o_zero_prev if value_bits is None else tuple(
            correction * oz + functools.reduce(
                jnp.add, [p_set * per_row(v_zeros_set[g])
                          for p_set, (_, _, v_zeros_set) in zip(p, v_sets)]).sum(axis=-1)
            for g, oz in enumerate(o_zero_prev))
        return tuple(o_next), o_zero_next, m_next, l_next

    init = (tuple(jnp.zeros((rows, heads * v_width), jnp.float32) for _ in range(v_planes)),
            tuple(jnp.zeros((rows,), jnp.float32) for _ in range(value_groups)),
            jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    if prefetch_page_ids:
        # Page ids of the next block travel in the loop carry, so the K/V gathers do not
        # depend on a load of their own iteration and Triton's pipeliner can keep
        # num_stages - 1 blocks in flight (without this it single-buffers them). With slot
        # pairs the value zeros travel with them: they feed no product (only p . z), so the
        # pipeliner leaves their load in its own iteration, where in the slot-pair kernel's
        # schedule its latency is exposed: on an H100 a quarter of K4V2's time at 32 x 32k
        # (tiers -10%), while K8V4 and K8V8 are a little slower with their zeros ahead, so other
        # formats load them in their iteration (None in the carry).
        def ahead(block):
            page = page_ids(block)
            return page, (per_slot(v_refs[2], page, set_tokens(block)) if slot_pairs else None)

        def body(block, carry):
            page, zeros, state = carry
            return (*ahead(block + 1), attend(block, page, state, zeros))
        _, _, final = lax.fori_loop(0, num_blocks, body, (*ahead(0), init))
    else:
        final = lax.fori_loop(0, num_blocks,
                              lambda block, state: attend(block, page_ids(block), state), init)
    o_planes, o_zero, m, l = final
    has_tokens = l > 0.0
    denominator = jnp.where(has_tokens, l, 1.0)[:, None]
    lse = jnp.where(has_tokens, m * backend.LN2 + jnp.log(jnp.where(has_tokens, l, 1.0)),
                    -jnp.inf)
    # Plane i's products are 2^(v_shift[i] + E + S) times p s c (`unpack_planes`).
    plane_scale = [2.0 ** -(v_shift[i] + v_exp + w_exp) for i in range(v_planes)]
    # Each row's own head's columns (`store_rows`: the other entries, masked, at distinct rows).
    col_head, col_dim = columns(v_width)
    out_rows, out_mask = (row_ids, row_real[:, None]) if heads == 1 else \
        (store_rows(col_head), row_real[:, None] & (row_head[:, None] == col_head))
    store = functools.partial(plgpu.store, eviction_policy=_PARTIAL_EVICTION)
    for i, o in enumerate(o_planes):
        out = o if value_bits is None else \
            o * plane_scale[i] + o_zero[i * len(o_zero) // v_planes][:, None]
        out = out / denominator
        if heads == 1 and value_bits is None:   # the whole head (a block store)
            store(o_ref.at[head_ids[0]], out, mask=row_real[:, None])
        else:
            store(o_ref.at[col_head, out_rows, i * v_width + col_dim], out, mask=out_mask)
    if heads == 1:
        store(lse_ref.at[head_ids[0]], lse, mask=row_real)
    else:
        store(lse_ref.at[row_head, row_in_head], lse, mask=row_real)


_STATIC = ("interpret", "block_tokens", "num_warps", "num_stages", "heads_per_program")



@functools.partial(jax.jit, static_argnames=(*_STATIC, "tier", "num_tiers"))
def decode_partials(q, k_pages, v_pages, block_tables, lengths, work, starts=None, *,
                    interpret: bool, block_tokens, num_warps: int, num_stages: int,
                    heads_per_program: int = 1, tier: int = 0, num_tiers: int = 1):
    """The kernel alone (one launch): per work item normalised partial outputs and
    log-sum-exps. Inputs as for `ragged_paged_decode_attention` with one pool, unchecked;
    with precision tiers the pool of tier `tier` of `num_tiers`, whose block-table rows and
    lengths are ``num_tiers * g + tier`` of `block_tables` [batch, num_tiers * groups,
    max_pages] and `lengths` [batch, num_tiers * groups].

    One launch over both tiers: `kv_quant.TieredPages` pools, `work` the (high, low) pair of
    work lists and `block_tokens` an int or a (high, low) pair: the grid's items are the high
    list's then the low list's, each program reads its item's tier in that tier's format
    (one body a tier, `_parts_kernel`), and the returned work is the two lists concatenated.

    Returns (o_part f32 [batch, items, G, q_per_kv, d], lse f32 [batch, items, G, q_per_kv],
    work). `ragged_paged_decode_attention` merges them. starts: None, or int32 [batch, groups]
    the first slot each (row, group) attends (a local layer's window)."""
    if kv_quant.is_tiered(k_pages, v_pages):
        pools = kv_quant.tier_pools(k_pages, v_pages)
        works = tuple(work)
        tiers, num_tiers = tuple(range(len(pools))), len(pools)
    else:
        pools, works, tiers = [(k_pages, v_pages)], (work,), (tier,)
    block_tokens = block_tokens if isinstance(block_tokens, (tuple, list)) else \
        (block_tokens,) * len(pools)
    batch, num_groups, q_rows, head_dim = q.shape
    _, group_size, page_size, _ = pools[0][0].shape
    q_per_kv = q_rows // group_size
    heads = heads_per_program
    # The kernel's tiles: the H heads' query rows, a power of two >= 16 for the matrix unit.
    rows = max(_MIN_DOT_ROWS, backend.next_power_of_2(heads * q_per_kv))
    max_pages = block_tables.shape[-1]
    if group_size % heads:
        raise ValueError(f"heads_per_program {heads} must divide G={group_size}")
    if len({w.ndim for w in works}) > 1:   # a shared list beside a planned one: per row too
        works = tuple(jnp.broadcast_to(w, (batch, *w.shape[-2:])) for w in works)
    work = works[0] if len(works) == 1 else jnp.concatenate(works, axis=-2)
    num_items = work.shape[-2]

    parts, page_arrays, first = [], [], 0
    for (k, v), w, t, tokens in zip(pools, works, tiers, block_tokens):
        # A block is whole pages; with slot pairs at least 32 tokens, so each token set's
        # products have the 16 rows along k the matrix unit needs.
        slot_pairs = _slot_pairs(k, v)
        min_tokens = 32 if slot_pairs else 1
        pages_per_block = max(tokens // page_size, -(-min_tokens // page_size))
        kernel = functools.partial(_decode_kernel, page_size=page_size,
                                   block_tokens=pages_per_block * page_size,
                                   q_per_kv=q_per_kv, scale=1.0 / math.sqrt(head_dim),
                                   max_pages=max_pages, prefetch_page_ids=num_stages >= 3,
                                   key_bits=_bits(k), value_bits=_bits(v),
                                   slot_pairs=slot_pairs, tier=t, num_tiers=num_tiers,
                                   compiled=not interpret)
        arrays = (*_page_inputs(k), *_page_inputs(v))
        parts.append((first, first + w.shape[-2], len(arrays), kernel))
        page_arrays += arrays
        first += w.shape[-2]
    # Each pool array's slab of these KV heads: pages [num_pages, H, page_size, d'] or per-slot
    # scales [num_pages, H, page_size].
    page_specs = [pl.BlockSpec((a.shape[0], heads, *a.shape[2:]),
                               lambda b, i, j, nd=a.ndim: (0, j) + (0,) * (nd - 2))
                  for a in page_arrays]
    # q and the partials keep their q_per_kv real rows; the kernel's blocks have `rows` (a
    # power of two, >= 16 for the matrix unit) and mask the rest on load and store.
    q = q.reshape(batch, num_groups, group_size, q_per_kv, head_dim)
    extra = () if starts is None else (starts,)
    return *pl.pallas_call(
        functools.partial(_parts_kernel, parts=tuple(parts), windowed=starts is not None),
        grid=(batch, num_items, group_size // heads),
        in_specs=[
            _work_spec(work),
            pl.BlockSpec((None, lengths.shape[1]), lambda b, i, j: (b, 0)),
            pl.BlockSpec((None, *block_tables.shape[1:]), lambda b, i, j: (b, 0, 0)),
            pl.BlockSpec((None, num_groups, heads, rows, head_dim),
                         lambda b, i, j: (b, 0, j, 0, 0)),
            *page_specs,
            *(pl.BlockSpec((None, lengths.shape[1]), lambda b, i, j: (b, 0)) for _ in extra),
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
    )(work, lengths, block_tables, q, *page_arrays, *extra), work



@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(q, k_pages, v_pages, block_tables, lengths, works, starts, sinks, *, block_tokens,
            num_warps, **kwargs):
    """The decode launch (over both tiers' pools with precision tiers; tuning not given: the
    pools' `decode_tuning`), then the merge launch of its partials."""
    tuned = (block_tokens, num_warps)
    if block_tokens is None or num_warps is None:
        tuned = decode_tuning(k_pages, v_pages)
    o_part, lse, work = decode_partials(q, k_pages, v_pages, block_tables, lengths,
                                        works[0] if len(works) == 1 else works, starts,
                                        block_tokens=block_tokens or tuned[0],
                                        num_warps=num_warps or tuned[1], **kwargs)
    return merge_partials_pallas(o_part, lse, work, sinks, num_groups=q.shape[1],
                                 out_dtype=q.dtype, interpret=kwargs["interpret"])


def ragged_paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, work_list,
                                  interpret: bool | None = None,
                                  block_tokens: int | None = None,
                                  num_warps: int | None = None, num_stages: int = 3,
                                  heads_per_program: int = 1, window=None,
                                  sinks=None) -> jax.Array:
    """Decode attention of one layer for all its head groups: a decode launch over the pool
    (with precision tiers over both tiers' pools), then the merge launch.

    Args:
      q: [batch, groups, G * q_per_kv, head_dim] (query heads of group g contiguous).
      k_pages, v_pages: [num_pages, G, page_size, head_dim], the whole pool: arrays in q's
        dtype, or `kv_quant.QuantPages` of that logical shape (keys and values may have
        different bits), dequantised on the fly; or precision tiers, `kv_quant.TieredPages`
        (a pool per tier; one launch over both tiers' items, each item reading its tier in
        that tier's format).
      block_tables: int32 [batch, groups, max_pages], this layer's; with tiers [batch,
        2 * groups, max_pages] of tier groups (``2 g`` group g's high tier, ``2 g + 1`` its
        low tier, entries ids of that tier's pool).
      lengths: int32 [batch, groups] retained tokens (0 allowed: that group's output is 0),
        [batch, 2 * groups] with tiers; must be <= max_pages * page_size.
      work_list: int32 [items, 3] rows (group, split, num_splits), shared by every batch row (a
        numpy array from a `SplitMap` becomes a constant of the trace), or [batch, items, 3] per
        row (runtime planned). Rows with num_splits 0 are no-ops. With tiers a (high, low)
        pair of such lists, rows of the base groups (`SplitMap.tier_work_lists`): item
        (g, s, n) of the high list covers share s of n of group g's high tier. The merge
        combines a group's items of both tiers.
      block_tokens, num_warps, num_stages, heads_per_program: Triton tuning (tokens per inner
        step = block_tokens // page_size pages; KV heads of the group one program streams);
        block_tokens / num_warps None: the pool's page format's `DECODE_TUNING`; with tiers
        block_tokens may be a (high, low) pair.
      window: None, or an int32 scalar (traced): a local layer's window (the query at slot
        length - 1 sees slots > length - 1 - window; 0: a global layer); not with tiers.
      sinks: None or [groups * G * q_per_kv] sink logits (`attention_terms`).
    Returns [batch, groups, G * q_per_kv, head_dim] in q's dtype; softmax in float32, scale
    1/sqrt(head_dim).
    """
    tier_pools = kv_quant.tier_pools(k_pages, v_pages)
    works = _work_lists(work_list, len(tier_pools))
    _check_inputs(q, tier_pools, block_tables, lengths, works)
    starts = None
    if window is not None:
        if len(tier_pools) > 1:
            raise ValueError("a sliding window needs slots that are positions; precision tiers "
                             "split a group's tokens over two pools")
        starts = first_visible_slot(lengths - 1, window).astype(jnp.int32)
    return _decode(q, k_pages, v_pages, block_tables, lengths, works, starts, sinks,
                   interpret=backend.resolve_interpret(interpret), block_tokens=block_tokens,
                   num_warps=num_warps, num_stages=num_stages,
                   heads_per_program=heads_per_program)


@jax.jit
def ragged_paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *,
                                            window=None, sinks=None):
    """Gather every group's pages (dequantised: `kv_quant`) and run a masked softmax in jnp
    (float32); a local layer's `window` masks slots before length - window, `sinks` [Hq] join
    the denominator (`attention_terms`). Precision tiers (`kv_quant.TieredPages`, tables and
    lengths of tier groups): both tiers of a group as one dense history
    (`kv_quant.tiered_dense_history`)."""
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
    slot = jnp.arange(max_pages * page_size)
    valid = slot < lengths[:, :, None, None, None]
    if window is not None:
        valid = valid & (slot >= first_visible_slot(lengths - 1, window)[:, :, None, None, None])
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:   # a zero-valued key of logit s per query head
        sink = sinks.astype(jnp.float32).reshape(qg.shape[1:4])[None, ..., None]
        m = jnp.maximum(m, sink)
    p = jnp.where(valid, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sink - m)
    v = jnp.where(valid[..., 0, :, None], v, 0.0)
    out = jnp.einsum("bngqt,bngtd->bngqd", p / jnp.where(den > 0, den, 1.0), v,
                     precision=lax.Precision.HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
