"""Packed K/V codes as matrix-unit operands, without a conversion instruction.

The decode kernel (`decode_attention.py`) reads quantised pools (`kv_quant`: K8V8 / K8V4 /
K4V2) as packed codes; these helpers turn a tile of codes into bit planes that the matrix unit
multiplies directly (compiled: subnormal operands, inline PTX; interpreted: the codes cast).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu



# Codes become matrix-unit operands without a conversion instruction. A plane's code c of a byte
# (bits ``b*p .. b*p + b - 1``), masked in place, is the integer N = c * 2^(b p) < 256; placed
# in the low byte of a 16-bit float's pattern (the high byte 0) it is the float N * 2^E exactly,
# E = -133 for bfloat16 and -24 for float16: patterns below 2^11 (float16) or 2^8 (bfloat16) are
# subnormal or in the lowest normal binade, where a pattern's value is linear in its bits. So a
# compiled kernel spreads each 4 bytes into two registers' 16-bit halves once (two ``prmt``) and
# takes every plane from them with one ``and`` a code pair; the per-plane power of two 2^(b p)
# goes into q's planes (keys) or the output's (values), and 2^E is lifted by scaling the other
# operand by 2^S (q and bfloat16 value weights by 2^100, float16 value weights by 2^12) so the
# float32 products are normal numbers: exact powers of two, so the products are those of the codes
# themselves, scaled. Interpreted kernels (the CPU tests: XLA on the CPU flushes subnormal
# operands to zero) cast N itself (E = 0), the same products up to the same powers of two. Against
# magic-number operands (OR a code into the mantissa of M = 128 or 1024, then subtract M: a shift
# and a packed subtract a code pair per plane, the two prmt repeated per plane) this is fewer
# instructions a code, faster for K4V2 on an H100 and equal for the others, with no M in the
# 8-bit keys' products.
# Operand dtypes: keys in the compute dtype (any width: N < 256 is exact in bfloat16); 8-bit value
# codes in float16, whose weights (p * s, cast to the operand dtype) keep 11 significant bits,
# narrower ones in the compute dtype.
_SUBNORMAL_EXPONENT = {jnp.dtype(jnp.bfloat16): -133, jnp.dtype(jnp.float16): -24}
# log2 of the factor q (keys) or the value weights are scaled by, by operand dtype, compiled:
# bfloat16 q and weights keep float32's range (2^100 leaves |x| up to 2^27); float16 value
# weights p * s span [0, s] with s ~ range / 255, and float16's normal range starts at 6e-5, so
# unscaled the small weights of flat attention over tens of thousands of tokens (p ~ 3e-5, s ~
# 0.01) would be subnormal (a few significant bits); scaled by 2^12 they are normal down to p s =
# 1.5e-8 and the largest stays below float16's 65504 for value scales up to 16 (ranges of 4000).
_OTHER_OPERAND_EXPONENT = {jnp.dtype(jnp.bfloat16): 100, jnp.dtype(jnp.float16): 12}


def code_operand(bits: int, compute_dtype, *, values: bool = False,
                 compiled: bool = True) -> tuple:
    """(operand dtype, E, S) of `bits`-bit key (or `values`) codes in a kernel computing in
    `compute_dtype`: a plane's operand is N * 2^E (N the code's byte masked to its bits), and
    the other operand of its product (q, or the value weights) is scaled by 2^S; E = 0 where the
    kernel is interpreted or computes in float32 (the codes are cast)."""
    compute_dtype = jnp.dtype(compute_dtype)
    if compute_dtype == jnp.float32:
        return compute_dtype, 0, 0
    dtype = jnp.dtype(jnp.float16) if values and bits == 8 else compute_dtype
    other = _OTHER_OPERAND_EXPONENT[dtype]
    if not compiled:   # interpreted: only float16 weights keep their scale (CPU subnormals)
        return dtype, 0, (other if dtype == jnp.float16 else 0)
    return dtype, _SUBNORMAL_EXPONENT[dtype], other


def plane_masks(bits: int) -> list[int]:
    """Each plane's bits of a byte (plane p: bits ``p*bits .. (p+1)*bits - 1``)."""
    return [((1 << bits) - 1) << (p * bits) for p in range(8 // bits)]


def unpack_planes(raw, bits: int, dtype, exponent: int) -> list:
    """Packed codes [tokens, d/n] -> the n planes [tokens, d/n] as `dtype` operands N * 2^E,
    E = `exponent` (`code_operand`: N = c * 2^(bits p) for plane p's code c of a byte). uint8
    codes: n = 8 / bits; uint16 codes (`kv_quant`'s 16-bit units): `_unpack_planes16`.

    E != 0 (compiled kernels' 16-bit operands; inline PTX cannot be interpreted): a ``prmt`` pair
    spreads each 32-bit word of 4 bytes into the low bytes of two registers' 16-bit halves (one
    asm for all planes), and each plane is one ``and`` a register (two codes) of those: the
    patterns are the subnormal operands N * 2^E. E = 0 (interpreted, or float32 operands): the
    masked bytes cast to `dtype`."""
    if raw.dtype == jnp.uint16:
        return _unpack_planes16(raw, bits, dtype, exponent)
    if exponent == 0:
        return [(raw & jnp.uint8(mask)).astype(dtype) for mask in plane_masks(bits)]
    if jnp.dtype(dtype).itemsize != 2 or exponent != _SUBNORMAL_EXPONENT[jnp.dtype(dtype)]:
        raise ValueError(f"exponent must be 0 or the subnormal exponent of {dtype} "
                         f"({_SUBNORMAL_EXPONENT.get(jnp.dtype(dtype))}), got {exponent}")
    # One asm a result: Pallas lowers only single-result inline asm (jax 0.11.2: "multiple
    # results, but 2 outvars do not match 1 outvals"), so the spread is its own asm.
    # int16, not uint16: Triton's integers are signless (it rejects an unsigned result type).
    spread_dtype = dtype if bits == 8 else jnp.int16
    spread = plgpu.elementwise_inline_asm(
        "prmt.b32 $0, $2, 0, 0x4140;\nprmt.b32 $1, $2, 0, 0x4342;", args=[raw],
        constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(raw.shape, spread_dtype)])[0]
    if bits == 8:
        return [spread]
    return [plgpu.elementwise_inline_asm(
        f"and.b32 $0, $1, 0x{mask:04X}{mask:04X};", args=[spread], constraints="=r,r",
        pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(raw.shape, dtype)])[0]
        for mask in plane_masks(bits)]


def _unpack_planes16(raw, bits: int, dtype, exponent: int) -> list:
    """`unpack_planes` of 16-bit code units [tokens, d/n] (n = 16 / bits planes, plane p at bits
    ``bits p`` of the unit): the low byte's planes masked in place, the high byte's moved to the
    low byte first (one ``prmt`` a register), so plane p's operand is N = c 2^(bits (p mod
    8/bits)) * 2^E, as in a byte."""
    if exponent == 0:
        per_byte = 8 // bits
        return [((raw >> (8 * (p // per_byte))) & plane_masks(bits)[p % per_byte]).astype(dtype)
                for p in range(16 // bits)]
    def asm(code, x, out_dtype):
        return plgpu.elementwise_inline_asm(
            code, args=[x], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, out_dtype)])[0]
    high = asm("prmt.b32 $0, $1, 0, 0x4341;", raw, dtype if bits == 8 else jnp.int16)
    if bits == 8:
        return [asm("and.b32 $0, $1, 0x00FF00FF;", raw, dtype), high]
    return [asm(f"and.b32 $0, $1, 0x{mask:04X}{mask:04X};", half, dtype)
            for half in (raw, high) for mask in plane_masks(bits)]
