"""Ragged paged decode attention over K4V2 pages as a Hopper (Mosaic GPU) kernel: a PROTOTYPE
(correct on an H100, 2.6x slower than the Triton kernel: benchmarks/NOTES_kv_precision.md, session
18); not used by the engine. The tokens are the matrix unit's M, the query rows its N.

The Triton kernel (`decode_attention`) multiplies [16 query rows (4 real) x tokens] tiles and
gathers every element through its own address; over K4V2 pages that leaves it issue-bound at
0.56-0.68 of the byte ideal (benchmarks/NOTES_kv_precision.md, session 17). Here a program
(one warpgroup) streams its work item's pages into shared memory by TMA, one copy a page and
array (no per-element addresses), unpacks each block's codes once into bfloat16 operands in
shared memory, and runs the two products with the block's tokens as wgmma's M (64):

    scores^T [tokens, rows] = sum_p codes_p [tokens, d/n] . q_p^T [d/n, rows]     (keys)
    out^T    [d, rows]     += values^T [d, tokens] . (p * scale)^T [tokens, rows]   (values)

so the query rows (q_per_kv of them, padded to `_ROWS`) are N, whose 16 columns hold 4 real
ones (the Triton tile holds 4 of 16 rows too, but its softmax and scale work runs on [16 x
tokens] tiles per 16 tokens; here each thread holds 8 of a [64 x 16] tile's elements).

Grid and work list as the Triton kernel's: ``(batch, item, G)``, item i of the work list
``(group, split, num_splits)``; the program cuts the group's pages into blocks of `_BLOCK`
tokens, takes its split's contiguous run, and writes a normalised partial output and its
log-sum-exp (base e) per query row, merged by `decode_attention.merge_partials_pallas` as
the Triton kernel's are. Pipeline: `stages` blocks in flight; block i + stages - 1's copies are
issued after block i - 1's operands left shared memory (a warpgroup barrier, `commit_smem`).

Formats: K4V2 (4-bit keys in 2 planes, 2-bit values in 4 planes, one scale and zero a token
and head each, `kv_quant`). Codes are masked in place and become subnormal bfloat16 operands by
a zero-extension and a bitcast (`SUBNORMAL`; no conversion); the per-token key
scale and zero are applied to the [tokens, rows] scores, the value scale to the weights and
the value zero as ``sum_t p_t z_t`` per row, as in the Triton kernel.

GPU only: Mosaic GPU's interpreter (jax 0.10) runs no wgmma on a transposed operand, which both
products need. `tests/test_mgpu_prototype.py` lowers it for an H100 on the CPU (layout
inference and the dialect lowering run in Python there); `mgpu_ab.py` beside it checks it
against `ragged_paged_decode_attention_reference` on the GPU and times it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tangram_jax import kv_quant
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.decode_attention import _MASK_VALUE, code_operand, plane_masks

# Codes as subnormal operands (session 19 A/B; the Triton kernel's `unpack_planes` idea): a
# masked code byte zero-extended to 16 bits and bitcast is the bfloat16 N * 2^-133, so no
# int -> float conversion; q and the value weights are scaled by 2^100 and the scores and
# the output by 2^33. False: the codes are converted (`astype`), as built in session 18.
SUBNORMAL = True
_, _OPERAND_EXP, _OTHER_EXP = code_operand(4, jnp.bfloat16)   # (bf16, -133, 100)

_BLOCK = 64          # tokens a block: wgmma's M
_ROWS = 16           # query rows as wgmma's N (q_per_kv real ones)


def _swizzled(minor_bytes: int, itemsize: int) -> tuple:
    """Tiling and swizzle transforms of a shared-memory operand whose rows are `minor_bytes`."""
    swizzle = min(128, minor_bytes)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(work_ref, lengths_ref, tables_ref, q_ref, qsum_ref, kc_ref, ks_ref, kz_ref,
            vc_ref, vs_ref, vz_ref, o_ref, lse_ref, *scratch, page_size: int, max_pages: int,
            num_pages: int, key_bits: int, value_bits: int, stages: int, scale: float):
    (q_smem, qsum_smem, kc_smem, vc_smem, ks_smem, kz_smem, vs_smem, vz_smem, kb_smem, vb_smem,
     w_smem, o_smem, lse_smem, bars, q_bar) = scratch
    b = lax.axis_index("b")
    item = lax.axis_index("i")
    j = lax.axis_index("j")
    group = work_ref[item, 0]
    split = work_ref[item, 1]
    num_splits = work_ref[item, 2]
    length = lengths_ref[b, group]
    pages_per_block = _BLOCK // page_size
    k_planes, v_planes = 8 // key_bits, 8 // value_bits
    head_dim = q_smem.shape[-1] * k_planes
    v_width = head_dim // v_planes

    total_blocks = lax.div(jnp.minimum(lax.div(length + page_size - 1, page_size), max_pages)
                           + pages_per_block - 1, pages_per_block)
    n = jnp.maximum(num_splits, 1)
    first_block = jnp.minimum(lax.div(split * total_blocks, n), total_blocks)
    last_block = jnp.where(num_splits > 0,
                           jnp.minimum(lax.div((split + 1) * total_blocks, n), total_blocks),
                           first_block)
    num_blocks = jnp.maximum(last_block - first_block, 0)
    end_token = jnp.minimum(length, jnp.minimum(last_block * pages_per_block, max_pages)
                            * page_size)

    plgpu.copy_gmem_to_smem(q_ref.at[b, group, j], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(qsum_ref.at[b, group, j], qsum_smem, q_bar)

    def issue(block, slot):
        """The block's pages into stage `slot`: 6 copies a page (codes, scale, zero of K, V).
        A copy's shared-memory address must be aligned to 128 bytes (16-slot pages' 64-byte
        scale rows fault at odd pages, H100): pages of 32 slots or more."""
        for i in range(pages_per_block):
            page_index = jnp.minimum((first_block + block) * pages_per_block + i, max_pages - 1)
            page = jnp.clip(tables_ref[b, group, page_index], 0, num_pages - 1)
            rows = pl.ds(i * page_size, page_size)
            for src, dst in ((kc_ref, kc_smem), (vc_ref, vc_smem), (ks_ref, ks_smem),
                             (kz_ref, kz_smem), (vs_ref, vs_smem), (vz_ref, vz_smem)):
                plgpu.copy_gmem_to_smem(src.at[page, j], dst.at[slot, rows], bars.at[slot])

    for s in range(stages - 1):
        @pl.when(s < num_blocks)
        def _():
            issue(s, s)

    plgpu.barrier_wait(q_bar)
    qsum = qsum_smem[...]                                              # [rows]
    log2_scale = scale * backend.LOG2E
    # Products of subnormal operands come out 2^(E + S) = 2^-33 times the codes' own.
    code_scale = 2.0 ** -(_OPERAND_EXP + _OTHER_EXP) if SUBNORMAL else 1.0
    other_scale = 2.0 ** _OTHER_EXP if SUBNORMAL else 1.0

    def body(block, carry):
        acc, oz, m, l = carry
        slot = lax.rem(block, stages)
        # The block stages - 1 ahead goes into the stage block - 1 used: every thread is past
        # it (the previous iteration ended in `commit_smem`, a warpgroup barrier).
        ahead = block + stages - 1

        @pl.when(ahead < num_blocks)
        def _():
            issue(ahead, lax.rem(ahead, stages))

        plgpu.barrier_wait(bars.at[slot])
        # Pointwise work on 8-bit values is only bitwise in Mosaic GPU: a plane's codes are
        # masked in place (c * 2^(bits p), exact in bfloat16: < 256) and the power of two goes
        # into q's plane (keys, `prepare_queries`) or the output's dims (values, below).
        def operand(codes, mask):
            masked = codes & jnp.uint8(mask)
            if SUBNORMAL:
                return lax.bitcast_convert_type(masked.astype(jnp.uint16), jnp.bfloat16)
            return masked.astype(jnp.bfloat16)
        kc = kc_smem[slot]                                             # uint8 [T, d/2]
        for p, mask in enumerate(plane_masks(key_bits)):
            kb_smem[p] = operand(kc, mask)
        vc = vc_smem[slot]                                             # uint8 [T, d/4]
        for p, mask in enumerate(plane_masks(value_bits)):
            vb_smem[:, pl.ds(p * v_width, v_width)] = operand(vc, mask)
        plgpu.commit_smem()

        def scores(acc_ref):
            for p in range(k_planes):
                plgpu.wgmma(acc_ref, kb_smem.at[p], plgpu.transpose_ref(q_smem.at[p], (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref[...]
        s = pl.run_scoped(scores, plgpu.ACC((_BLOCK, _ROWS), jnp.float32))   # [T, rows]
        ks = ks_smem[slot] * (log2_scale * code_scale)                 # [T]
        kz = kz_smem[slot] * log2_scale
        logits = (s * lax.broadcast_in_dim(ks, s.shape, [0])
                  + lax.broadcast_in_dim(kz, s.shape, [0])
                  * lax.broadcast_in_dim(qsum, s.shape, [1]))
        token = (first_block + block) * _BLOCK + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        valid = token < end_token
        logits = jnp.where(valid, logits, _MASK_VALUE)
        m_next = jnp.maximum(m, logits.max(axis=0))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(logits - lax.broadcast_in_dim(m_next, s.shape, [1]))
        l_next = correction * l + p.sum(axis=0)
        vs = lax.broadcast_in_dim(vs_smem[slot], s.shape, [0])
        vz = lax.broadcast_in_dim(vz_smem[slot], s.shape, [0])
        w_smem[...] = jnp.where(valid, p * (vs * other_scale), 0.0).astype(jnp.bfloat16)
        oz_next = correction * oz + jnp.where(valid, p * vz, 0.0).sum(axis=0)
        plgpu.commit_smem()
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1])

        def values(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(vb_smem, (1, 0)), w_smem)
            plgpu.wgmma_wait(0)
        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.commit_smem()   # w and the operands are read: the next issue may overwrite
        return acc, oz_next, m_next, l_next

    acc = plgpu.layout_cast(jnp.zeros((head_dim, _ROWS), jnp.float32), plgpu.Layout.WGMMA)
    row_vec = lambda v: plgpu.layout_cast(jnp.full((_ROWS,), v, jnp.float32),
                                          plgpu.Layout.WGMMA.reduce(0))
    acc, oz, m, l = lax.fori_loop(0, num_blocks, body,
                                  (acc, row_vec(0.0), row_vec(_MASK_VALUE), row_vec(0.0)))
    has_tokens = l > 0.0
    den = jnp.where(has_tokens, l, 1.0)
    # Value plane p's dims carry its codes' 2^(value_bits p).
    dim = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
    plane_scale = jnp.exp2(-(value_bits * lax.div(dim, v_width)).astype(jnp.float32)) * code_scale
    out = (acc * plane_scale + lax.broadcast_in_dim(oz, acc.shape, [1])) / \
        lax.broadcast_in_dim(den, acc.shape, [1])
    o_smem[...] = out
    lse_smem[...] = jnp.where(has_tokens, m * backend.LN2 + jnp.log(den), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, item, j])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, item, j])
    plgpu.wait_smem_to_gmem(0)


def prepare_queries(q, group_size: int, key_bits: int):
    """q [batch, groups, G * q_per_kv, d] -> (q planes bf16 [batch, groups, G, planes, _ROWS,
    d / planes] (rows past q_per_kv zero), sum(q) f32 [batch, groups, G, _ROWS])."""
    batch, groups, q_rows, d = q.shape
    q_per_kv = q_rows // group_size
    planes = 8 // key_bits
    qg = q.reshape(batch, groups, group_size, q_per_kv, d).astype(jnp.float32)
    qg = jnp.pad(qg, ((0, 0),) * 3 + ((0, _ROWS - q_per_kv), (0, 0)))
    qsum = qg.sum(axis=-1)
    qp = qg.reshape(batch, groups, group_size, _ROWS, planes, d // planes)
    # Plane p's key operands are c * 2^(key_bits p) (masked in place): q's plane takes it back,
    # and with SUBNORMAL is scaled by 2^100 so the products of the 2^-133 operands stay normal.
    qp = qp * (2.0 ** ((_OTHER_EXP if SUBNORMAL else 0)
                       - key_bits * jnp.arange(planes, dtype=jnp.float32)))[:, None]
    return jnp.moveaxis(qp, 4, 3).astype(jnp.bfloat16), qsum


@functools.partial(jax.jit, static_argnames=("stages",))
def decode_partials_mgpu(q, k_pages, v_pages, block_tables, lengths, work, *, stages: int = 3):
    """`decode_attention.decode_partials` for K4V2 pools with pages of 32 or 64 slots on Hopper:
    (o_part f32 [batch, items, G, q_per_kv, d], lse f32 [batch, items, G, q_per_kv], work)."""
    batch, num_groups, q_rows, head_dim = q.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = q_rows // group_size
    key_bits, value_bits = k_pages.bits, v_pages.bits
    if (key_bits, value_bits) != (4, 2) or v_pages.scale.ndim != 3:
        raise ValueError(f"the Mosaic GPU decode kernel reads K4V2 pools, got K{key_bits}"
                         f"V{value_bits}")
    if page_size not in (32, 64) or q_per_kv > _ROWS or head_dim != 128:
        raise ValueError(f"page_size must be 32 or 64, q_per_kv <= {_ROWS} and head_dim 128; "
                         f"got {page_size}, {q_per_kv}, {head_dim}")
    num_items = work.shape[0]
    qp, qsum = prepare_queries(q, group_size, key_bits)
    k_planes, v_planes = 8 // key_bits, 8 // value_bits
    kernel = functools.partial(
        _kernel, page_size=page_size, max_pages=block_tables.shape[-1], num_pages=num_pages,
        key_bits=key_bits, value_bits=value_bits, stages=stages,
        scale=1.0 / math.sqrt(head_dim))
    kc_bytes, vc_bytes = head_dim // k_planes, head_dim // v_planes
    o_part, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((batch, num_items, group_size, head_dim, _ROWS),
                                       jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_items, group_size, _ROWS), jnp.float32)),
        grid=(batch, num_items, group_size), grid_names=("b", "i", "j"),
        scratch_types=(
            plgpu.SMEM((k_planes, _ROWS, kc_bytes), jnp.bfloat16,
                       transforms=_swizzled(kc_bytes * 2, 2)),                 # q planes
            plgpu.SMEM((_ROWS,), jnp.float32),                                 # sum(q)
            plgpu.SMEM((stages, _BLOCK, kc_bytes), jnp.uint8,
                       transforms=_swizzled(kc_bytes, 1)),                      # key codes
            plgpu.SMEM((stages, _BLOCK, vc_bytes), jnp.uint8,
                       transforms=_swizzled(vc_bytes, 1)),                      # value codes
            *(plgpu.SMEM((stages, _BLOCK), jnp.float32) for _ in range(4)),   # scales, zeros
            plgpu.SMEM((k_planes, _BLOCK, kc_bytes), jnp.bfloat16,
                       transforms=_swizzled(kc_bytes * 2, 2)),                 # key operands
            # The values' product reads both operands with one swizzle (Mosaic GPU's wgmma):
            # the weights' rows are _ROWS bf16 (32 bytes), so the value operands take 32 too.
            plgpu.SMEM((_BLOCK, head_dim), jnp.bfloat16,
                       transforms=_swizzled(_ROWS * 2, 2)),                    # value operands
            plgpu.SMEM((_BLOCK, _ROWS), jnp.bfloat16,
                       transforms=_swizzled(_ROWS * 2, 2)),                    # weights
            plgpu.SMEM((head_dim, _ROWS), jnp.float32),                        # output
            plgpu.SMEM((_ROWS,), jnp.float32),                                 # lse
            plgpu.Barrier(num_arrivals=6 * (_BLOCK // page_size), num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(work, lengths, block_tables, qp, qsum, k_pages.codes, k_pages.scale, k_pages.zero,
      v_pages.codes, v_pages.scale, v_pages.zero)
    o_part = jnp.swapaxes(o_part, -1, -2)[..., :q_per_kv, :]
    return o_part, lse[..., :q_per_kv], work
