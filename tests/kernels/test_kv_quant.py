"""Quantised KV rows and pages (`tangram_jax.kv_quant`): round trips within each format's bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax import kv_quant


def _rows(seed, shape, offset=0.0):
    rng = np.random.default_rng(seed)
    # Heavy-tailed rows with a per-row offset (keys after RoPE are not centred), a constant row
    # and a row of one outlier: the cases a scale/zero pair must get right.
    x = rng.standard_t(3, size=shape).astype(np.float32) * rng.uniform(0.01, 30, shape[:-1])[..., None]
    x += offset * rng.standard_normal(shape[:-1]).astype(np.float32)[..., None]
    flat = x.reshape(-1, shape[-1])
    flat[0] = 1.25
    flat[1] = 0.0
    flat[1, 3] = 1e4
    return flat.reshape(shape)


@pytest.mark.parametrize("unit", [8, 16])
@pytest.mark.parametrize("bits", kv_quant.QUANT_BITS)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_round_trip_within_bound(bits, head_dim, unit):
    x = _rows(bits * head_dim, (5, 3, 7, head_dim), offset=4.0)
    codes, scale, zero = kv_quant.quantise(jnp.asarray(x), bits, unit=unit)
    assert codes.dtype == kv_quant.CODE_UNITS[unit]
    assert codes.shape == (5, 3, 7, head_dim * bits // unit)
    assert scale.shape == zero.shape == x.shape[:-1]
    back = np.asarray(kv_quant.dequantise(codes, scale, zero, bits))
    err = np.abs(back - x).max(axis=-1)
    bound = np.asarray(kv_quant.error_bound(x, bits))
    assert (err <= bound).all(), (err / bound).max()
    # The bound is the format's, not a loose one: the worst row uses most of it.
    assert (err / bound).max() > 0.4
    # Constant rows come back exactly.
    assert back.reshape(-1, head_dim)[0].tolist() == [1.25] * head_dim


@pytest.mark.parametrize("unit", [8, 16])
@pytest.mark.parametrize("bits", kv_quant.QUANT_BITS)
def test_packing_is_planes_of_contiguous_dims(bits, unit):
    """Unit i (a byte or a uint16) holds dims i, i + d/n, ...: plane p of the packed row is
    dims [p d/n, (p+1) d/n), n = unit / bits."""
    levels = (1 << bits) - 1
    d = 32
    n = unit // bits
    codes_wanted = np.arange(d) % (levels + 1)
    x = jnp.asarray(codes_wanted[None].astype(np.float32))
    x = x.at[0, 0].set(0.0).at[0, 1].set(float(levels))        # range [0, levels]: scale 1
    want = np.asarray(x[0]).astype(np.int64)
    codes, scale, zero = kv_quant.quantise(x, bits, unit=unit)
    assert float(scale[0]) == 1.0 and float(zero[0]) == 0.0
    packed = np.asarray(codes[0]).astype(np.int64)
    for p in range(n):
        plane = (packed >> (p * bits)) & levels
        assert plane.tolist() == want[p * d // n:(p + 1) * d // n].tolist()
    assert np.asarray(kv_quant.unpack(codes, bits))[0].tolist() == want.tolist()


def test_bad_arguments_name_value_and_choices():
    with pytest.raises(ValueError, match="bits must be one of .*got 3"):
        kv_quant.quantise(jnp.zeros((2, 8)), 3)
    with pytest.raises(ValueError, match="head_dim 6 is not a multiple of 4"):
        kv_quant.quantise(jnp.zeros((2, 6)), 2)
    with pytest.raises(ValueError, match="unit must be one of .*got 32"):
        kv_quant.quantise(jnp.zeros((2, 8)), 4, unit=32)
    with pytest.raises(ValueError, match="kv_precision must be one of .*'k4v4'"):
        kv_quant.page_format("k4v4")


@pytest.mark.parametrize("precision", kv_quant.KV_PRECISIONS)
def test_pool_write_and_take_round_trip(precision):
    fmt = kv_quant.page_format(precision)
    shape = (6, 2, 4, 16)                                   # [num_pages, G, page_size, d]
    rng = np.random.default_rng(1)
    for bits in (fmt.key_bits, fmt.value_bits):
        pool = kv_quant.pool_arrays(shape, jnp.float32, bits, unit=fmt.code_unit,
                                    slot_pairs=fmt.slot_pairs)
        assert pool.shape == shape
        if bits is not None:
            assert pool.codes.dtype == (jnp.uint16 if fmt.slot_pairs else
                                        kv_quant.CODE_UNITS[fmt.code_unit])
        # Both slots of a pair (page 3 head 0, page 5 head 1) and lone ones, in one call.
        page = jnp.array([[3, 3, 3], [5, 5, 5]])
        head = jnp.array([[0, 1, 0], [0, 1, 1]])
        slot = jnp.array([[2, 2, 3], [0, 0, 1]])
        vals = rng.standard_normal((2, 3, 16)).astype(np.float32) * 3
        pool = jax.jit(kv_quant.write_slots)(pool, (page, head, slot), jnp.asarray(vals))
        dense = np.array(kv_quant.dequantise_pages(pool))
        got = dense[np.asarray(page), np.asarray(head), np.asarray(slot)]
        if bits is None:
            np.testing.assert_array_equal(got, vals)
        else:
            assert (np.abs(got - vals).max(-1) <= np.asarray(kv_quant.error_bound(vals, bits))).all()
        # Nothing else changed (zeros dequantise to 0).
        dense[np.asarray(page), np.asarray(head), np.asarray(slot)] = 0
        assert not dense.any()


def test_page_bytes_fall_with_bits():
    b = {p: kv_quant.page_bytes(kv_quant.page_format(p), 2, 16, 128, jnp.bfloat16)
         for p in kv_quant.KV_PRECISIONS}
    slots = 2 * 16
    assert b["bf16"] == slots * 128 * 2 * 2
    assert b["k8v8"] == slots * (128 + 8) * 2
    assert b["k8v4"] == slots * (128 + 8 + 64 + 2 * 8)     # values: a scale / zero a plane
    assert b["k4v2"] == slots * (64 + 8 + 32 + 8)
    # The pool's own arrays agree with the formula.
    for p in kv_quant.KV_PRECISIONS:
        fmt = kv_quant.page_format(p)
        pools = [kv_quant.pool_arrays((3, 2, 16, 128), jnp.bfloat16, bits, groups=groups,
                                      unit=fmt.code_unit, slot_pairs=fmt.slot_pairs)
                 for bits, groups in ((fmt.key_bits, 1), (fmt.value_bits, fmt.value_groups))]
        assert sum(x.nbytes for x in pools) == 3 * b[p]


@pytest.mark.parametrize("bits", [4, 2])
def test_value_groups_quantise_each_plane_on_its_own_range(bits):
    """With a scale and zero per plane (K8V4's values) each half (plane) of a row is coded on
    its own range: within the tighter per-plane bound, and exact where a plane is constant;
    `quantise_pages` / `take_pages` carry the groups; a plane whose range is tenfold smaller
    than the other's comes back far closer than with one scale a row."""
    rng = np.random.default_rng(0)
    planes = 8 // bits
    d = 16 * planes
    x = rng.normal(size=(6, 3, d)).astype(np.float32)
    x[..., : d // planes] *= 0.1                                 # plane 0: a tenth of the range
    codes, scale, zero = kv_quant.quantise(jnp.asarray(x), bits, groups=planes)
    assert scale.shape == zero.shape == (6, 3, planes)
    back = np.asarray(kv_quant.dequantise(codes, scale, zero, bits))
    for p in range(planes):
        cols = slice(p * d // planes, (p + 1) * d // planes)
        bound = np.asarray(kv_quant.error_bound(x[..., cols], bits))
        assert (np.abs(back[..., cols] - x[..., cols]).max(-1) <= bound).all()
    one = np.asarray(kv_quant.dequantise(*kv_quant.quantise(jnp.asarray(x), bits), bits))
    first = slice(0, d // planes)
    assert np.abs(back[..., first] - x[..., first]).mean() < \
        0.3 * np.abs(one[..., first] - x[..., first]).mean()
    pages = kv_quant.quantise_pages(jnp.asarray(x.reshape(6, 3, 1, d)), bits, jnp.float32,
                                    groups=planes)
    assert pages.groups == planes and pages.scale.shape == (6, 3, 1, planes)
    np.testing.assert_allclose(np.asarray(kv_quant.take_pages(pages, jnp.arange(6)))[:, :, 0],
                               back, rtol=0, atol=1e-6)
    x[..., first] = 0.5                                          # a constant plane is exact
    codes, scale, zero = kv_quant.quantise(jnp.asarray(x), bits, groups=planes)
    assert np.array_equal(np.asarray(kv_quant.dequantise(codes, scale, zero, bits))[..., first],
                          x[..., first])
    with pytest.raises(ValueError, match="groups"):
        kv_quant.quantise(jnp.asarray(x), bits, groups=3)


def test_slot_pairs_round_trip_and_errors():
    """`pair_slots` puts slot 2i's byte low and 2i + 1's high; `unpair_slots` undoes it; a
    paired pool needs byte rows and an even page_size."""
    rows = np.random.default_rng(2).integers(0, 256, (3, 6, 5), dtype=np.uint8)
    units = np.asarray(kv_quant.pair_slots(jnp.asarray(rows)))
    assert units.shape == (3, 3, 5) and units.dtype == np.uint16
    np.testing.assert_array_equal(units & 0xFF, rows[:, 0::2])
    np.testing.assert_array_equal(units >> 8, rows[:, 1::2])
    np.testing.assert_array_equal(np.asarray(kv_quant.unpair_slots(jnp.asarray(units))), rows)
    with pytest.raises(ValueError, match="even page_size, got unit 8 and page_size 5"):
        kv_quant.pool_arrays((2, 1, 5, 16), jnp.float32, 4, slot_pairs=True)
    with pytest.raises(ValueError, match="unit 16"):
        kv_quant.pool_arrays((2, 1, 4, 16), jnp.float32, 4, unit=16, slot_pairs=True)
