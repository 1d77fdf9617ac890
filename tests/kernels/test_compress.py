"""Fused chunk compression (interpret mode on CPU): exact against the jnp scatter and an
independent numpy top-k, on a NaN-filled pool (no slot outside the kept range may change)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.kv_layout import chunk_keep_count
from tangram_jax.pallas_kernels.chunk_compress import (
    compress_chunk_into_pages, compress_chunk_into_pages_reference)

GPU_SCALE = os.environ.get("TANGRAM_KERNEL_SCALE") == "gpu"
# (T, num_kv_heads, head_dim, G, page_size, max_pages)
SHAPE = (512, 8, 128, 2, 16, 80) if GPU_SCALE else (24, 4, 16, 2, 8, 6)


def _numpy_expected(k_chunk, scores, keep, chunk_len, pool, tables, hist, group_size):
    """Loop-by-loop numpy: per head, top-`keep` valid tokens by score, written in time order."""
    out = pool.copy()
    page_size = pool.shape[2]
    for h in range(k_chunk.shape[1]):
        g, j = divmod(h, group_size)
        count = min(int(keep[g]), chunk_len)
        order = sorted(range(chunk_len), key=lambda t: (-scores[h, t], t))[:count]
        for c, t in enumerate(sorted(order)):
            slot = int(hist[g]) + c
            out[tables[g, slot // page_size], j, slot % page_size] = k_chunk[t, h]
    return out


def _case(rng, chunk_len, budgets, dtype):
    chunk, heads, d, g, ps, max_pages = SHAPE
    groups = heads // g
    keep = chunk_keep_count(np.asarray(budgets), chunk_len).astype(np.int32)
    hist = rng.integers(0, (max_pages * ps - chunk) // 2, size=groups).astype(np.int32)
    hist[0] = 0
    if groups > 1:
        hist[1] = 2 * ps                                   # a page boundary
    num_pages = groups * max_pages + 3
    tables = rng.permutation(num_pages)[:groups * max_pages].reshape(groups, max_pages)
    k_chunk = rng.standard_normal((chunk, heads, d)).astype(np.float32)
    v_chunk = rng.standard_normal((chunk, heads, d)).astype(np.float32)
    scores = rng.standard_normal((heads, chunk)).astype(np.float32)
    scores[:, chunk_len:] = 1e9                            # padding must never be chosen
    pool = np.full((num_pages, g, ps, d), np.nan, np.float32)
    return (jnp.asarray(k_chunk, dtype), jnp.asarray(v_chunk, dtype), jnp.asarray(scores),
            jnp.asarray(keep), np.int32(chunk_len), jnp.asarray(pool, dtype),
            jnp.asarray(pool, dtype), jnp.asarray(tables.astype(np.int32)), jnp.asarray(hist))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk_frac,budgets", [(1.0, [1.0, 1.0]), (0.8, [0.1, 0.45]),
                                                (0.0, [0.5, 0.5])],
                         ids=["keep_all", "ragged", "empty"])
def test_compress_exact(dtype, chunk_frac, budgets):
    rng = np.random.default_rng()
    chunk, heads, _, g, _, _ = SHAPE
    budgets = (budgets * heads)[:heads // g]
    chunk_len = max(int(chunk * chunk_frac) - 1, 0) if chunk_frac < 1 else chunk
    args = _case(rng, chunk_len, budgets, dtype)
    k_ref, v_ref = compress_chunk_into_pages_reference(*args)
    k_out, v_out = compress_chunk_into_pages(*args)
    for out, ref in ((k_out, k_ref), (v_out, v_ref)):
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert np.array_equal(np.isnan(out), np.isnan(ref))      # untouched slots stay NaN
        assert np.array_equal(out[~np.isnan(out)], ref[~np.isnan(ref)])
    expected = _numpy_expected(np.asarray(args[0], np.float32), np.asarray(args[2]),
                               np.asarray(args[3]), chunk_len,
                               np.full(args[5].shape, np.nan, np.float32), np.asarray(args[7]),
                               np.asarray(args[8]), g)
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), expected)
    if chunk_frac == 1.0:   # rho = 1: every token, in order
        assert (~np.isnan(expected)).sum() == chunk * heads * SHAPE[2]


def test_compress_rejects_bad_inputs():
    rng = np.random.default_rng()
    args = list(_case(rng, 5, [0.5] * (SHAPE[1] // SHAPE[3]), jnp.float32))
    bad = list(args)
    bad[3] = args[3].astype(jnp.float32)
    with pytest.raises(TypeError, match="keep_counts"):
        compress_chunk_into_pages(*bad)
    bad = list(args)
    bad[2] = args[2][:, :3]
    with pytest.raises(ValueError, match="scores"):
        compress_chunk_into_pages(*bad)


@pytest.mark.parametrize("precision", ["k8v4", "k4v2"])
def test_compress_quantises_kept_tokens(precision):
    """A quantised pool: the kernel writes the kept tokens' codes, scales and zeros exactly as
    the jnp scatter does, leaves every other slot alone (NaN scales stay NaN), and the kept
    values dequantise to the numpy top-k within the format's bound."""
    from tangram_jax import kv_quant
    fmt = kv_quant.page_format(precision)
    rng = np.random.default_rng()
    chunk, heads, d, g, _, _ = SHAPE
    args = list(_case(rng, chunk - 3, np.resize([0.3, 0.6], heads // g), jnp.float32))
    shape = args[5].shape

    def nan_pool(bits):
        """The format's pool with random codes (so a slot-pair store must keep the other
        slot's byte of each unit it writes) and NaN scales."""
        pool = kv_quant.pool_arrays(shape, jnp.float32, bits, unit=fmt.code_unit,
                                    slot_pairs=fmt.slot_pairs)
        codes = rng.integers(0, np.iinfo(pool.codes.dtype).max, pool.codes.shape,
                             dtype=pool.codes.dtype)
        return kv_quant.QuantPages(codes=jnp.asarray(codes), scale=jnp.full(shape[:-1], jnp.nan),
                                   zero=jnp.full(shape[:-1], jnp.nan), bits=bits,
                                   dtype=jnp.dtype(jnp.float32), slot_pairs=fmt.slot_pairs)

    args[5], args[6] = nan_pool(fmt.key_bits), nan_pool(fmt.value_bits)
    refs = compress_chunk_into_pages_reference(*args)
    outs = compress_chunk_into_pages(*args)
    for out, ref, bits in zip(outs, refs, (fmt.key_bits, fmt.value_bits)):
        assert isinstance(out, kv_quant.QuantPages) and out.bits == bits
        assert out.slot_pairs == fmt.slot_pairs and out.shape == shape
        for a, b in ((out.codes, ref.codes), (out.scale, ref.scale), (out.zero, ref.zero)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for out, chunk_values, bits in ((outs[0], args[0], fmt.key_bits),
                                    (outs[1], args[1], fmt.value_bits)):
        expected = _numpy_expected(np.asarray(chunk_values), np.asarray(args[2]),
                                   np.asarray(args[3]), chunk - 3,
                                   np.full(shape, np.nan, np.float32), np.asarray(args[7]),
                                   np.asarray(args[8]), g)
        got = np.asarray(kv_quant.dequantise_pages(out))
        written = ~np.isnan(expected)
        assert np.array_equal(~np.isnan(got), written)
        bound = np.asarray(kv_quant.error_bound(np.nan_to_num(expected), bits))[..., None]
        assert (np.abs(np.nan_to_num(got - expected)) <= bound).all()
