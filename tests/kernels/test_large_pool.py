"""The Pallas kernels on a pool of more than 2**31 elements, reading and writing its last pages.

An 80 GB card holds pools of ~440k full-KV tokens of the 8B shape: one pool array is then ~14.5 G
elements, so any int32 element offset computed inside a kernel (page id x page stride) wraps.
These checks put every page a sequence owns at the top of such a pool (random data there, zeros
below) and compare decode attention, chunk prefill attention and the fused chunk compression with
their jnp references. They need ~10 GB of device memory, so they run only with
TANGRAM_KERNEL_SCALE=gpu (benchmarks/gpu_check.sh); on the CPU they are skipped.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.pallas_kernels import split_map as sm
from tangram_jax.pallas_kernels.chunk_compress import (compress_chunk_into_pages,
                                                       compress_chunk_into_pages_reference)
from tangram_jax.pallas_kernels.decode_attention import (ragged_paged_decode_attention,
                                                         ragged_paged_decode_attention_reference)
from tangram_jax.pallas_kernels.prefill_attention import (chunk_prefill_attention,
                                                          chunk_prefill_attention_reference)

pytestmark = pytest.mark.skipif(os.environ.get("TANGRAM_KERNEL_SCALE") != "gpu",
                                reason="needs ~10 GB of device memory (TANGRAM_KERNEL_SCALE=gpu)")

G, PAGE, D, GROUPS, MAX_PAGES = 8, 16, 128, 1, 64      # the engine's full layout of the 8B shape
NUM_PAGES = 2 ** 31 // (G * PAGE * D) + 8192           # one pool array > 2**31 elements


def _top_pool(rng):
    """K and V pools whose last GROUPS * MAX_PAGES pages hold random bf16 data; the tables."""
    assert NUM_PAGES * G * PAGE * D > 2 ** 31
    top = NUM_PAGES - GROUPS * MAX_PAGES
    tables = (top + rng.permutation(GROUPS * MAX_PAGES)).reshape(GROUPS, MAX_PAGES)
    shape = (GROUPS * MAX_PAGES, G, PAGE, D)
    pools = []
    for _ in range(2):
        pool = jnp.zeros((NUM_PAGES, G, PAGE, D), jnp.bfloat16)
        pools.append(pool.at[top:].set(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)))
    return pools[0], pools[1], jnp.asarray(tables.astype(np.int32))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def test_decode_reads_the_top_of_a_large_pool():
    rng = np.random.default_rng()
    k_pages, v_pages, tables = _top_pool(rng)
    batch, q_rows = 2, G * 4
    lengths = jnp.asarray([[MAX_PAGES * PAGE], [MAX_PAGES * PAGE - 5]], jnp.int32)
    block_tables = jnp.broadcast_to(tables, (batch, GROUPS, MAX_PAGES))
    q = jnp.asarray(rng.standard_normal((batch, GROUPS, q_rows, D)), jnp.bfloat16)
    work = sm.build_split_map(np.array([[1.0]]), 16, batch, group_size=G).work_list(0)
    out = ragged_paged_decode_attention(q, k_pages, v_pages, block_tables, lengths,
                                        work_list=work)
    ref = ragged_paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths)
    assert _rel_err(out, ref) < 1.5e-2


def test_prefill_reads_the_top_of_a_large_pool():
    rng = np.random.default_rng()
    k_pages, v_pages, tables = _top_pool(rng)
    chunk, hq, obs = 256, 4 * G * GROUPS, 32
    q = jnp.asarray(rng.standard_normal((chunk, hq, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((chunk, G * GROUPS, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((chunk, G * GROUPS, D)), jnp.bfloat16)
    hist = jnp.asarray([MAX_PAGES * PAGE - 3], jnp.int32)
    args = (q, k, v, k_pages, v_pages, tables, hist, np.int32(chunk))
    out, _ = chunk_prefill_attention(*args, obs_window=obs)
    ref, _ = chunk_prefill_attention_reference(*args, obs_window=obs)
    assert _rel_err(out, ref) < 1.5e-2


def test_compress_writes_the_top_of_a_large_pool():
    rng = np.random.default_rng()
    k_pages, v_pages, tables = _top_pool(rng)
    chunk = 256
    k = jnp.asarray(rng.standard_normal((chunk, G * GROUPS, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((chunk, G * GROUPS, D)), jnp.bfloat16)
    scores = jnp.asarray(rng.random((G * GROUPS, chunk)), jnp.float32)
    keep = jnp.asarray([chunk // 4], jnp.int32)
    hist = jnp.asarray([MAX_PAGES * PAGE - chunk // 4 - 5], jnp.int32)  # ends in the last page
    ref_k, ref_v = compress_chunk_into_pages_reference(k, v, scores, keep, np.int32(chunk),
                                                       k_pages, v_pages, tables, hist)
    top = NUM_PAGES - GROUPS * MAX_PAGES
    ref_k, ref_v = np.asarray(ref_k[top:]), np.asarray(ref_v[top:])
    out_k, out_v = compress_chunk_into_pages(k, v, scores, keep, np.int32(chunk), k_pages,
                                             v_pages, tables, hist)
    jax.block_until_ready(out_k)
    np.testing.assert_array_equal(np.asarray(out_k[top:]), ref_k)
    np.testing.assert_array_equal(np.asarray(out_v[top:]), ref_v)
    assert not np.asarray(out_k[:top:1024]).any()          # nothing written below the top
