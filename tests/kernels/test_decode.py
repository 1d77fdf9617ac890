"""Ragged paged decode attention (interpret mode on CPU) against its jnp reference.

Fresh random inputs per test; every pool slot a sequence does not own is NaN, so a kernel that
reads past a length, or a wrong page, shows up. With TANGRAM_KERNEL_SCALE=gpu the same checks run
at Llama-3.1-8B shapes (32 query / 8 KV heads, head_dim 128, G=2) on the GPU.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.pallas_kernels import split_map as sm
from tangram_jax.pallas_kernels.backend import default_interpret
from tangram_jax.pallas_kernels.decode_attention import (
    ragged_paged_decode_attention, ragged_paged_decode_attention_reference)
from tangram_jax.pallas_kernels.decode_merge import merge_partials, merge_partials_pallas

GPU_SCALE = os.environ.get("TANGRAM_KERNEL_SCALE") == "gpu"
# (batch, groups, G, q_per_kv, head_dim, page_size, max_pages, block_tokens, num_programs)
SHAPE = (8, 4, 2, 4, 128, 16, 161, 32, 528) if GPU_SCALE else (3, 4, 2, 2, 32, 8, 9, 16, 48)
# The embedded model's shape: 9 query / 3 KV heads, G = 1, so 3 query rows per KV head (not a
# power of two: the kernel's padded rows are masked).
SHAPE_3_ROWS = (4, 3, 1, 3, 64, 16, 41, 32, 132) if GPU_SCALE else (3, 3, 1, 3, 16, 8, 7, 16, 24)
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}


def _ragged_lengths(rng, batch, groups, page_size, max_pages):
    """Lengths with 0, 1, exact page boundaries and one group far longer than the others."""
    cap = page_size * max_pages
    lengths = rng.integers(0, cap // 6, size=(batch, groups))
    special = [0, 1, page_size, 2 * page_size, page_size - 1, cap, cap - 1]
    flat = lengths.reshape(-1)
    flat[:len(special)] = special[:flat.size]
    lengths[rng.integers(batch), rng.integers(groups)] = cap     # one far longer group
    return lengths.astype(np.int32)


def _poisoned_pool(rng, lengths, group_size, page_size, max_pages, head_dim, dtype):
    """A shuffled pool whose owned slots are random and every other slot NaN."""
    batch, groups = lengths.shape
    num_pages = batch * groups * max_pages + 5
    tables = rng.permutation(num_pages)[:batch * groups * max_pages]
    tables = tables.reshape(batch, groups, max_pages).astype(np.int32)
    k = rng.standard_normal((num_pages, group_size, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    slot = np.arange(max_pages * page_size)
    owned = np.zeros((num_pages, page_size), bool)
    rows = slot[None, None, :] < lengths[..., None]
    owned[tables[..., slot // page_size][rows], (slot % page_size)[None, None, :].repeat(
        batch, 0).repeat(groups, 1)[rows]] = True
    k[~owned[:, None, :, None].repeat(group_size, 1).repeat(head_dim, 3)] = np.nan
    v[np.isnan(k)] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), tables


def _case(rng, dtype, shape=SHAPE):
    batch, groups, g, qpk, d, ps, max_pages, _, _ = shape
    lengths = _ragged_lengths(rng, batch, groups, ps, max_pages)
    k, v, tables = _poisoned_pool(rng, lengths, g, ps, max_pages, d, dtype)
    q = jnp.asarray(rng.standard_normal((batch, groups, g * qpk, d)), dtype)
    return q, k, v, tables, lengths


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def _work_lists(lengths, groups, shape=SHAPE):
    batch, _, g, _, _, ps, _, _, programs = shape
    budgets = np.array([[0.05, 0.1, 0.25, 0.85][-groups:]])
    return {
        "aot": sm.build_split_map(budgets, programs, batch, group_size=g).work_list(0),
        "uniform": sm.uniform_split_map(1, groups, 3).work_list(0),
        "runtime_planned": sm.plan_runtime_work(lengths, programs, ps, group_size=g),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPE, SHAPE_3_ROWS], ids=["gqa", "3rows"])
def test_decode_matches_reference_for_every_work_list(dtype, shape):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = _case(rng, dtype, shape)
    ref = ragged_paged_decode_attention_reference(q, k, v, tables, jnp.asarray(lengths))
    block_tokens, q_per_kv = shape[7], shape[3]
    # Every kernel path: one KV head per program (2 stages: page ids loaded in the loop; 3
    # stages: page ids one block ahead), and all G heads of the group in one program.
    paths = {"aot": dict(num_stages=2), "uniform": dict(num_stages=3),
             "runtime_planned": dict(heads_per_program=q.shape[2] // q_per_kv)}
    for name, work in _work_lists(lengths, q.shape[1], shape).items():
        out = ragged_paged_decode_attention(q, k, v, tables, jnp.asarray(lengths),
                                            work_list=work, block_tokens=block_tokens,
                                            **paths[name])
        assert out.shape == q.shape and out.dtype == q.dtype
        err = _rel_err(out, ref)
        assert err < RTOL[dtype], f"{name}: relative error {err:.2e}"
        # Groups of length 0 give exactly zero.
        assert not np.asarray(out, np.float32)[lengths == 0].any(), name


@pytest.mark.parametrize("items, d", [(37, 32), (300, 64)], ids=["one_chunk", "chunks_dim_split"])
def test_merge_kernel_matches_jnp_merge(items, d):
    """The Pallas merge against the jnp one on random partials: items of every group in a
    shuffled order, empty shares (lse -inf), no-op rows and one group with no items at all;
    long rows are merged in several chunks and over slices of head_dim."""
    rng = np.random.default_rng()
    batch, groups, g, qpk = 3, 4, 2, 3
    work = np.zeros((batch, items, 3), np.int32)
    for b in range(batch):
        owner = rng.integers(0, groups - 1, size=items - 5)      # group groups-1 owns nothing
        rows = [(grp, 0, 1) for grp in owner]
        work[b, :len(rows)] = rng.permutation(np.array(rows))
    o_part = rng.standard_normal((batch, items, g, qpk, d)).astype(np.float32)
    lse = (3 * rng.standard_normal((batch, items, g, qpk))).astype(np.float32)
    lse[rng.random(lse.shape) < 0.2] = -np.inf
    lse[:, -5:] = np.nan                                       # no-op rows must not be read
    o_part[:, -5:] = np.nan
    ref = merge_partials(jnp.asarray(np.nan_to_num(o_part)), jnp.asarray(np.where(
        np.isnan(lse), -np.inf, lse)), jnp.asarray(work), groups)
    out = merge_partials_pallas(jnp.asarray(o_part), jnp.asarray(lse), jnp.asarray(work),
                                num_groups=groups, out_dtype=jnp.float32,
                                interpret=default_interpret())
    ref = np.asarray(ref).reshape(out.shape)
    assert _rel_err(out, ref) < 1e-5
    assert not np.asarray(out)[:, groups - 1].any()


def test_merge_kernel_of_two_launches_equals_merge_of_their_concatenation():
    """Partials of two launches (precision tiers: a tier each, different item counts, one work
    list shared by the rows and one planned per row) merged as a tuple give what merging their
    concatenated items gives; an entry count that differs is refused by name."""
    rng = np.random.default_rng()
    batch, groups, g, qpk, d = 2, 3, 2, 3, 32
    parts = []
    for items, per_row in ((7, False), (20, True)):
        rows = np.array([(rng.integers(0, groups), 0, 1) for _ in range(items)], np.int32)
        rows[-1] = 0                                            # a no-op row
        work = np.stack([rng.permutation(rows) for _ in range(batch)]) if per_row else rows
        o = rng.standard_normal((batch, items, g, qpk, d)).astype(np.float32)
        lse = (3 * rng.standard_normal((batch, items, g, qpk))).astype(np.float32)
        parts.append((jnp.asarray(o), jnp.asarray(lse), jnp.asarray(work)))
    together = merge_partials_pallas(*(tuple(p[i] for p in parts) for i in range(3)),
                                     num_groups=groups, out_dtype=jnp.float32,
                                     interpret=default_interpret())
    works = [jnp.broadcast_to(p[2], (batch, *p[2].shape[-2:])) for p in parts]
    ref = merge_partials_pallas(jnp.concatenate([p[0] for p in parts], axis=1),
                                jnp.concatenate([p[1] for p in parts], axis=1),
                                jnp.concatenate(works, axis=1), num_groups=groups,
                                out_dtype=jnp.float32, interpret=default_interpret())
    assert _rel_err(together, ref) < 1e-6
    with pytest.raises(ValueError, match="one entry per launch"):
        merge_partials_pallas((parts[0][0], parts[1][0]), (parts[0][1],), (parts[0][2],),
                              num_groups=groups, out_dtype=jnp.float32,
                              interpret=default_interpret())


def test_decode_all_lengths_zero_gives_zeros():
    rng = np.random.default_rng()
    q, k, v, tables, lengths = _case(rng, jnp.float32)
    zero = jnp.zeros_like(jnp.asarray(lengths))
    work = sm.uniform_split_map(1, q.shape[1], 2).work_list(0)
    out = ragged_paged_decode_attention(q, k, v, tables, zero, work_list=work,
                                        block_tokens=SHAPE[7])
    assert np.array_equal(np.asarray(out), np.zeros(q.shape, np.float32))


def test_decode_rejects_bad_inputs():
    rng = np.random.default_rng()
    q, k, v, tables, lengths = _case(rng, jnp.float32)
    work = sm.uniform_split_map(1, q.shape[1], 1).work_list(0)
    with pytest.raises(TypeError, match="lengths"):
        ragged_paged_decode_attention(q, k, v, tables, jnp.asarray(lengths, jnp.float32),
                                      work_list=work)
    with pytest.raises(ValueError, match="work_list"):
        ragged_paged_decode_attention(q, k, v, tables, jnp.asarray(lengths),
                                      work_list=work[:, :2])
    with pytest.raises(ValueError, match="block_tables"):
        ragged_paged_decode_attention(q, k, v, tables[:, :1], jnp.asarray(lengths),
                                      work_list=work)


@pytest.mark.parametrize("precision, dtype, pairs", [
    ("k8v8", jnp.float32, False), ("k8v8", jnp.bfloat16, False), ("k8v4", jnp.bfloat16, False),
    ("k4v2", jnp.float32, True), ("k4v2", jnp.bfloat16, True), ("k4v2", jnp.bfloat16, False)],
    ids=["k8v8-f32", "k8v8-bf16", "k8v4-bf16", "k4v2-f32", "k4v2-bf16", "k4v2-bytes-bf16"])
def test_quantised_decode_matches_reference(precision, dtype, pairs):
    """Packed pages dequantised on the fly: the kernel against the jnp reference on the same
    quantised pool (every work list), and against attention over the unquantised pool within
    what the format's rounding allows. K4V2 as served (slot pairs: two token sets a block) and
    as plain byte rows."""
    import dataclasses
    from tangram_jax import kv_quant
    fmt = dataclasses.replace(kv_quant.page_format(precision), slot_pairs=pairs)
    rng = np.random.default_rng()
    shape = (3, 4, 2, 2, 32, 8, 9, 16, 48)
    q, k, v, tables, lengths = _case(rng, jnp.float32, shape)
    # Poisoned slots keep NaN scales and zeros.
    # In the format's code unit (bytes, or uint16 units: 16/bits planes a unit), as served.
    kq = kv_quant.quantise_pages(k, fmt.key_bits, dtype, unit=fmt.code_unit,
                                 slot_pairs=fmt.slot_pairs)
    vq = kv_quant.quantise_pages(v, fmt.value_bits, dtype, groups=fmt.value_groups,
                                 unit=fmt.code_unit, slot_pairs=fmt.slot_pairs)
    assert kq.slot_pairs == vq.slot_pairs == pairs
    q = q.astype(dtype)
    lens = jnp.asarray(lengths)
    ref = ragged_paged_decode_attention_reference(q, kq, vq, tables, lens)
    exact = ragged_paged_decode_attention_reference(q, k, v, tables, lens)
    # Table entries past a group's pages hold anything (here ids outside the pool): the
    # kernel, which reads codes unmasked, clamps the ids it loads.
    past = np.arange(shape[6]) >= -(-lengths[..., None] // shape[5])
    tables = np.where(past, rng.choice([-7, kq.shape[0], 2**30], size=tables.shape),
                      tables).astype(np.int32)
    paths = {"aot": dict(num_stages=2), "uniform": dict(num_stages=3),
             "runtime_planned": dict(heads_per_program=2)}
    for name, work in _work_lists(lengths, q.shape[1], shape).items():
        out = ragged_paged_decode_attention(q, kq, vq, tables, lens, work_list=work,
                                            block_tokens=shape[7], num_warps=4, **paths[name])
        assert out.shape == q.shape and out.dtype == q.dtype
        err = _rel_err(out, ref)
        assert err < RTOL[dtype], f"{name}: relative error {err:.2e}"
        assert not np.asarray(out, np.float32)[lengths == 0].any(), name
    # Quantisation error of the output: small at 8 bits, larger at 4/2 (standard normal K/V,
    # head_dim 32), but attention over the dequantised pool, not noise.
    quant_err = _rel_err(ref, exact)
    assert quant_err < {"k8v8": 0.03, "k8v4": 0.12, "k4v2": 0.6}[precision], quant_err
    # A scale and zero per value plane (K8V4's format; here also K8V8's single plane and
    # K4V2's four): the kernel weighs each plane's product by its own scale and zero.
    planes = fmt.code_unit // fmt.value_bits
    vg = kv_quant.quantise_pages(v, fmt.value_bits, dtype, groups=planes, unit=fmt.code_unit,
                                 slot_pairs=fmt.slot_pairs)
    ref_g = ragged_paged_decode_attention_reference(q, kq, vg, tables, lens)
    work = _work_lists(lengths, q.shape[1], shape)["aot"]
    out = ragged_paged_decode_attention(q, kq, vg, tables, lens, work_list=work,
                                        block_tokens=shape[7], num_warps=4)
    assert _rel_err(out, ref_g) < RTOL[dtype]
    if planes > 1:   # the groups are used: the output differs from one scale a row's
        assert _rel_err(ref_g, ragged_paged_decode_attention_reference(
            q, kq, kv_quant.quantise_pages(v, fmt.value_bits, dtype, unit=fmt.code_unit,
                                           slot_pairs=fmt.slot_pairs),
            tables, lens)) > 1e-4


def test_tiered_decode_matches_reference():
    """Precision tiers as served (K8V4 high tier, K4V2 slot-pair low tier, bf16 q, each tier
    group's tokens in its own pool), in one launch over both tiers' items, with the tiered AOT
    map, runtime planning per tier, and each tier format's
    default tuning: against the reference over both tiers. Unowned slots are NaN."""
    from tangram_jax import kv_layout, kv_quant
    rng = np.random.default_rng()
    batch, groups, g, qpk, d, ps, max_pages, _, programs = SHAPE
    # Tier groups 2 j (high) and 2 j + 1 (low) of group j: one poisoned pool of 2 x groups,
    # quantised in both formats; each tier group's table entries index its tier's pool.
    q, k, v, tables, lengths = _case(rng, jnp.bfloat16, (batch, 2 * groups, *SHAPE[2:]))
    q = q[:, :groups]
    pools = {}
    for tier, precision in zip(("high", "low"), kv_layout.PRECISION_TIERS["k8v4-k4v2"]):
        fmt = kv_quant.page_format(precision)
        pools[tier] = [kv_quant.quantise_pages(x, bits, jnp.bfloat16, groups=groups_,
                                               unit=fmt.code_unit, slot_pairs=fmt.slot_pairs,
                                               page_format=fmt.name)
                       for x, bits, groups_ in ((k, fmt.key_bits, 1),
                                                (v, fmt.value_bits, fmt.value_groups))]
    kt, vt = (kv_quant.TieredPages(pools["high"][i], pools["low"][i]) for i in (0, 1))
    lens = jnp.asarray(lengths)
    ref = ragged_paged_decode_attention_reference(q, kt, vt, tables, lens)
    budgets = np.array([[0.05, 0.1, 0.25, 0.85][-groups:]])
    aot = sm.build_tier_split_map(budgets, np.full(budgets.shape, 0.5), (216, 112), programs,
                                  batch, group_size=g)
    work_lists = {
        "aot": tuple(w[0] for w in aot.tier_work_lists()),
        "runtime_planned": tuple(sm.plan_runtime_work(lengths[:, t::2], programs, ps,
                                                      group_size=g) for t in (0, 1)),
    }
    for name, work in work_lists.items():
        out = ragged_paged_decode_attention(q, kt, vt, tables, lens, work_list=work)
        err = _rel_err(out, ref)
        assert err < RTOL[jnp.bfloat16], f"{name}: relative error {err:.2e}"
        assert not np.asarray(out, np.float32)[(lengths[:, 0::2] + lengths[:, 1::2]) == 0].any()


@pytest.mark.parametrize("bits, compute, values", [
    (8, jnp.bfloat16, False), (8, jnp.bfloat16, True), (4, jnp.bfloat16, False),
    (4, jnp.bfloat16, True), (2, jnp.bfloat16, True), (8, jnp.float32, False)])
def test_codes_become_exact_operands_without_conversion(bits, compute, values):
    """Every code of every plane is an exact operand: a masked byte N = c * 2^(bits p) whose
    pattern, in the low byte of the operand dtype, is the float N * 2^E (`code_operand`,
    compiled: subnormal or lowest-binade patterns, linear in their bits); interpreted, N cast."""
    import ml_dtypes
    from tangram_jax.pallas_kernels.packed_codes import (code_operand, plane_masks,
                                                         unpack_planes)
    dtype, exponent, other = code_operand(bits, compute, values=values)
    assert jnp.dtype(dtype) == (jnp.float32 if compute == jnp.float32 else
                                jnp.float16 if values and bits == 8 else compute)
    assert code_operand(bits, compute, values=values, compiled=False)[1] == 0
    every = np.arange(256, dtype=np.uint8)
    planes = unpack_planes(jnp.asarray(every), bits, dtype, 0)
    with pytest.raises(ValueError, match="exponent"):   # only a 16-bit dtype's own exponent
        unpack_planes(jnp.asarray(every), bits, jnp.float32, -133)
    for p, (plane, mask) in enumerate(zip(planes, plane_masks(bits))):
        n = every & mask
        np.testing.assert_array_equal(np.asarray(plane, np.float64), n)
        np.testing.assert_array_equal(n >> (bits * p), (every >> (bits * p)) & ((1 << bits) - 1))
        if exponent:   # the compiled operand: the pattern N is N * 2^E
            np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
            as_float = n.astype(np.uint16).view(np_dtype).astype(np.float64)
            np.testing.assert_array_equal(as_float, n * 2.0 ** exponent)
            # The other operand's scale keeps the products normal float32 numbers.
            assert 2.0 ** (exponent + other) * 1e-8 > np.finfo(np.float32).tiny


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_16_bit_units_unpack_into_the_byte_planes_operands(bits):
    """Codes in 16-bit units (`kv_quant` with unit 16: 16/bits planes a unit) unpack into the
    planes of `kv_quant.unpack`, each plane's N the code shifted by its place in its byte (as a
    byte's planes: the high byte's planes are moved down first)."""
    from tangram_jax import kv_quant
    from tangram_jax.pallas_kernels.packed_codes import unpack_planes
    units = np.arange(0, 65536, 7, dtype=np.uint16)
    planes = unpack_planes(jnp.asarray(units), bits, jnp.float32, 0)
    codes = np.asarray(kv_quant.unpack(jnp.asarray(units)[:, None], bits))  # [n, planes]
    assert len(planes) == 16 // bits
    for p, plane in enumerate(planes):
        shift = bits * (p % (8 // bits))
        np.testing.assert_array_equal(np.asarray(plane),
                                      codes[:, p].astype(np.float64) * 2 ** shift)


@pytest.mark.skipif(default_interpret(), reason="inline PTX runs only in a compiled kernel")
@pytest.mark.parametrize("unit", [8, 16])
@pytest.mark.parametrize("bits, values", [(2, True), (4, False), (4, True), (8, False),
                                          (8, True)])
def test_inline_ptx_unpack_gives_the_subnormal_operands(bits, values, unit):
    """The compiled kernels' unpack (`unpack_planes` at the subnormal exponent, inline PTX on
    32-bit words) gives each plane's masked bytes as the operand's bit patterns, for every byte
    value in every position of a 4-byte word, from bytes and from 16-bit units."""
    import jax
    from jax import lax
    from jax.experimental import pallas as pl
    from tangram_jax.pallas_kernels.backend import compiler_params
    from tangram_jax.pallas_kernels.packed_codes import (code_operand, plane_masks,
                                                         unpack_planes)
    dtype, exponent, _ = code_operand(bits, jnp.bfloat16, values=values)
    planes = 8 // bits
    rng = np.random.default_rng()
    raw = rng.integers(0, 256, size=(64, 16 * bits), dtype=np.uint8)
    # Every byte value in every position of a 4-byte word: 0..255 in order, rolled by 0..3.
    every = np.arange(256, dtype=np.uint8)
    for shift in range(4):
        rows = slice(8 * shift, 8 * shift + 8)
        raw[rows] = np.resize(np.roll(every, shift), raw[rows].size).reshape(8, -1)

    if unit == 16:   # the same bytes as 16-bit units: the high byte's planes follow
        raw = raw.view(np.uint16)
        planes *= 2
        expect = np.stack([(raw >> (8 * half)) & mask for half in (0, 1)
                           for mask in plane_masks(bits)]).astype(np.uint16)
    else:
        expect = np.stack([raw & mask for mask in plane_masks(bits)]).astype(np.uint16)

    def kernel(raw_ref, out_ref):
        for p, x in enumerate(unpack_planes(raw_ref[...], bits, dtype, exponent)):
            out_ref[p] = lax.bitcast_convert_type(x, jnp.int16)   # Triton: no unsigned

    shape = jax.ShapeDtypeStruct((planes, *raw.shape), jnp.int16)
    got = pl.pallas_call(kernel, out_shape=shape, compiler_params=compiler_params())(
        jnp.asarray(raw))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), expect)


def test_decode_tuning_is_the_measured_one_of_each_page_format():
    """Without an explicit tuning each launch takes its pool's page format's measured entry
    (`DECODE_TUNING`), and a quantised pool attended that way matches the reference."""
    import jax
    from tangram_jax import kv_layout, kv_quant
    from tangram_jax.pallas_kernels.decode_pools import DECODE_TUNING, decode_tuning
    for name, fmt in kv_quant.PAGE_FORMATS.items():
        k, v = kv_quant.allocate_pools((fmt,), (3,), (2, 8, 32), jnp.bfloat16,
                                       make=jax.ShapeDtypeStruct)
        assert decode_tuning(k, v) == DECODE_TUNING[name]
    # Precision tiers in one launch: their own entry (a block size a tier, one warp count).
    tiers = kv_layout.PRECISION_TIERS["k8v4-k4v2"]
    pools = []
    for precision in tiers:
        fmt = kv_quant.page_format(precision)
        pools.append(fmt)
    k, v = kv_quant.allocate_pools(tuple(pools), (3, 3), (2, 8, 32), jnp.bfloat16,
                                   make=jax.ShapeDtypeStruct)
    assert decode_tuning(k, v) == DECODE_TUNING["k8v4-k4v2"]
    rng = np.random.default_rng()
    shape = (3, 4, 2, 2, 32, 8, 9, 16, 48)
    q, k, v, tables, lengths = _case(rng, jnp.float32, shape)
    kq, vq = kv_quant.quantise_pages(k, 4), kv_quant.quantise_pages(v, 2)
    lens = jnp.asarray(lengths)
    work = _work_lists(lengths, q.shape[1], shape)["aot"]
    # A pool of bare bit widths names no format: the launch asks for its tuning instead of
    # guessing one from the widths.
    with pytest.raises(ValueError, match="must be made from its page format"):
        ragged_paged_decode_attention(q, kq, vq, tables, lens, work_list=work)
    out = ragged_paged_decode_attention(q, kq, vq, tables, lens, work_list=work,
                                        block_tokens=16, num_warps=2)
    ref = ragged_paged_decode_attention_reference(q, kq, vq, tables, lens)
    assert _rel_err(out, ref) < RTOL[jnp.float32]


@pytest.mark.parametrize("window, sinks", [(11, False), (3, True), (0, True)],
                         ids=["window", "window_sinks", "sinks"])
def test_decode_window_and_sinks(window, sinks):
    """A local layer's window (the query at slot length - 1 sees slots > length - 1 - window)
    and attention sinks: the kernel (interpreted, every work list), its reference and the CPU
    serving path equal a numpy oracle; slots before the window are NaN, so a kernel that reads
    them shows up."""
    from tangram_jax.engine.xla_attention import ragged_paged_decode_attention_xla
    rng = np.random.default_rng(11)
    batch, groups, g, qpk, d, ps, max_pages, block_tokens, _ = SHAPE
    q, k, v, tables, lengths = _case(rng, jnp.float32)
    if window:   # poison every slot before each group's window
        k, v = np.array(k), np.array(v)
        for b in range(batch):
            for grp in range(groups):
                for t in range(max(0, lengths[b, grp] - window)):
                    k[tables[b, grp, t // ps], :, t % ps] = np.nan
                    v[tables[b, grp, t // ps], :, t % ps] = np.nan
        k, v = jnp.asarray(k), jnp.asarray(v)
    sink = rng.standard_normal(groups * g * qpk).astype(np.float32) * 2 if sinks else None
    # The oracle: float64 numpy over each (row, query head).
    kk, vv, qq = (np.asarray(x, np.float64) for x in (k, v, q))
    want = np.zeros(qq.shape)
    for b in range(batch):
        for grp in range(groups):
            n = lengths[b, grp]
            first = max(0, n - window) if window else 0
            t = np.arange(first, n)
            for row in range(g * qpk):
                j = row // qpk
                keys = kk[tables[b, grp, t // ps], j, t % ps]
                vals = vv[tables[b, grp, t // ps], j, t % ps]
                logit = keys @ qq[b, grp, row] / np.sqrt(d)
                if sink is not None:
                    logit = np.append(logit, sink[grp * g * qpk + row])
                    vals = np.concatenate([vals, np.zeros((1, d))])
                if len(logit):
                    p = np.exp(logit - logit.max())
                    want[b, grp, row] = p @ vals / p.sum()
    terms = dict(window=jnp.int32(window), sinks=None if sink is None else jnp.asarray(sink))
    lens = jnp.asarray(lengths)
    outs = {"reference": ragged_paged_decode_attention_reference(q, k, v, tables, lens, **terms),
            # (the CPU path reads finite pools only: the engine's are)
            "xla": ragged_paged_decode_attention_xla(q, jnp.nan_to_num(k), jnp.nan_to_num(v),
                                                     tables, lens, **terms)}
    for name, work in _work_lists(lengths, groups).items():
        outs[name] = ragged_paged_decode_attention(q, k, v, tables, lens, work_list=work,
                                                   block_tokens=block_tokens, **terms)
    for name, out in outs.items():
        assert _rel_err(out, want) < 2e-5, name
