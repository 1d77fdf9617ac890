"""Chunked-prefill attention (interpret mode on CPU) against the full-matrix jnp reference.

History slots a group does not own and the chunk's padding rows are NaN; the output and the
observation-window probabilities must match the reference on valid rows and be finite on all."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.pallas_kernels.prefill_attention import (
    chunk_prefill_attention, chunk_prefill_attention_reference)

GPU_SCALE = os.environ.get("TANGRAM_KERNEL_SCALE") == "gpu"
# (T, Hq, Hkv, head_dim, G, page_size, max_pages, obs_window, block)
SHAPE = (512, 32, 8, 128, 2, 16, 96, 32, 64) if GPU_SCALE else (40, 4, 2, 16, 2, 8, 7, 8, 16)
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}


def _case(rng, chunk_len, hist, dtype):
    chunk, hq, hkv, d, g, ps, max_pages, _, _ = SHAPE
    groups = hkv // g
    num_pages = groups * max_pages + 2
    tables = rng.permutation(num_pages)[:groups * max_pages].reshape(groups, max_pages)
    k_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, g, ps, d)).astype(np.float32)
    owned = np.zeros((num_pages, ps), bool)
    for grp in range(groups):
        t = np.arange(hist[grp])
        owned[tables[grp, t // ps], t % ps] = True
    k_pages[~owned[:, None, :, None].repeat(g, 1).repeat(d, 3)] = np.nan
    v_pages[np.isnan(k_pages)] = np.nan
    q = rng.standard_normal((chunk, hq, d)).astype(np.float32)
    k = rng.standard_normal((chunk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((chunk, hkv, d)).astype(np.float32)
    k[chunk_len:] = np.nan
    v[chunk_len:] = np.nan
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, k_pages, v_pages)) + (
        jnp.asarray(tables.astype(np.int32)), jnp.asarray(np.asarray(hist, np.int32)),
        np.int32(chunk_len))


def _hists(rng):
    chunk, _, hkv, _, g, ps, max_pages, _, _ = SHAPE
    groups = hkv // g
    cap = max_pages * ps
    h = rng.integers(0, cap // 4, size=groups)
    h[0] = cap                                      # one group far longer
    if groups > 1:
        h[1] = 0
    if groups > 2:
        h[2] = ps                                   # exact page boundary
    return h


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_prefill_matches_reference(dtype):
    rng = np.random.default_rng()
    chunk, _, _, _, _, _, _, obs_window, block = SHAPE
    for chunk_len in (chunk, chunk - 7, obs_window // 2, 1):
        args = _case(rng, chunk_len, _hists(rng), dtype)
        out, obs = chunk_prefill_attention(*args, obs_window=obs_window, block=block)
        ref, ref_obs = chunk_prefill_attention_reference(*args, obs_window=obs_window)
        out = np.asarray(out, np.float64)
        assert out.shape == args[0].shape and obs.shape == (args[0].shape[1], obs_window, chunk)
        assert np.isfinite(out).all() and np.isfinite(np.asarray(obs)).all()
        ref = np.asarray(ref, np.float64)[:chunk_len]
        err = np.linalg.norm(out[:chunk_len] - ref) / np.linalg.norm(ref)
        assert err < RTOL[dtype], f"chunk_len {chunk_len}: out relative error {err:.2e}"
        ref_obs = np.asarray(ref_obs, np.float64)
        obs_err = np.abs(np.asarray(obs, np.float64) - ref_obs).max()
        assert obs_err < 10 * RTOL[dtype] * max(ref_obs.max(), 1e-3), obs_err
        assert not np.asarray(obs)[:, :obs_window - chunk_len].any()   # rows before the chunk


def test_prefill_without_any_key_is_zero():
    rng = np.random.default_rng()
    chunk, _, hkv, _, g, _, _, obs_window, block = SHAPE
    args = _case(rng, 0, np.zeros(hkv // g, np.int64), jnp.float32)
    out, obs = chunk_prefill_attention(*args, obs_window=obs_window, block=block)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(obs).any()


def test_prefill_rejects_bad_inputs():
    rng = np.random.default_rng()
    args = _case(rng, 4, _hists(rng), jnp.float32)
    with pytest.raises(ValueError, match="obs_window"):
        chunk_prefill_attention(*args, obs_window=0)
    with pytest.raises(ValueError, match="block"):
        chunk_prefill_attention(*args, obs_window=2, block=24)
