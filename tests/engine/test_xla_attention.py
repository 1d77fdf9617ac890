"""The CPU serving path of attention (`engine/xla_attention.py`) against the kernels' jnp
references, on ragged cases: several rows of different lengths, padding tokens, an empty row,
per-group history lengths, pages scattered over the pool."""

import numpy as np
import pytest
import jax.numpy as jnp

from tangram_jax.engine.xla_attention import (ragged_paged_decode_attention_xla,
                                              ragged_prefill_attention_xla)
from tangram_jax.pallas_kernels.decode_attention import ragged_paged_decode_attention_reference
from tangram_jax.pallas_kernels.prefill_attention import ragged_prefill_attention_reference

PAGE, D = 4, 8


def _pool(rng, rows, groups, group_size, width):
    num_pages = rows * groups * width + 1
    tables = rng.permutation(np.arange(1, num_pages)).reshape(rows, groups, width)
    k_pages = rng.normal(size=(num_pages, group_size, PAGE, D)).astype(np.float32)
    v_pages = rng.normal(size=(num_pages, group_size, PAGE, D)).astype(np.float32)
    return jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables, jnp.int32)


def _check_prefill(rng, group_size, q_per_kv, row_lens, starts, n, width, tuning=None):
    """The XLA prefill against the reference on random rows at `starts` of a flat axis of n."""
    kv_heads = 3 * group_size
    groups, rows = kv_heads // group_size, len(row_lens)
    hist = rng.integers(0, width * PAGE + 1, size=(rows, groups)).astype(np.int32)
    hist[0, 0] = 0                                         # a group with no history
    k_pages, v_pages, tables = _pool(rng, rows, groups, group_size, width)
    q = jnp.asarray(rng.normal(size=(n, kv_heads * q_per_kv, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(n, kv_heads, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(n, kv_heads, D)), jnp.float32)
    args = (q, k, v, k_pages, v_pages, tables, jnp.asarray(hist), jnp.asarray(starts),
            jnp.asarray(row_lens, jnp.int32))
    out, lse = ragged_prefill_attention_xla(*args, tuning=tuning)
    ref, ref_lse = ragged_prefill_attention_reference(*args)
    inside = np.zeros(n, bool)
    for s, ln in zip(starts, row_lens):
        inside[s:s + ln] = True
    np.testing.assert_allclose(np.asarray(out)[inside], np.asarray(ref)[inside], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[:, inside], np.asarray(ref_lse)[:, inside],
                               rtol=1e-4, atol=1e-5)
    assert np.isneginf(np.asarray(lse)[:, ~inside]).all()     # tokens of no row
    assert (np.asarray(out)[~inside] == 0).all()


@pytest.mark.parametrize("group_size,q_per_kv,row_lens", [(1, 3, [5, 0, 7]), (2, 2, [9]),
                                                         (3, 1, [3, 6])])
def test_prefill_matches_reference(group_size, q_per_kv, row_lens):
    """Rows at any offsets (one-token tiles)."""
    starts = np.cumsum([0] + row_lens[:-1]).astype(np.int32)
    _check_prefill(np.random.default_rng(len(row_lens) * 10 + group_size), group_size, q_per_kv,
                   row_lens, starts, sum(row_lens) + 3, width=3)   # 3 padding tokens at the end


def test_prefill_of_aligned_rows_reads_each_rows_history_per_tile():
    """Rows packed at the row alignment (as the runner packs them): each query tile reads its
    own row's history; a row of several tiles, a one-token row and a padding tile."""
    from tangram_jax.pallas_kernels.prefill_attention import PrefillTuning, pack_rows
    row_lens = [37, 1, 16]                                 # 3 tiles, 1 tile, exactly 1 tile
    starts, used = pack_rows(row_lens, 16)
    _check_prefill(np.random.default_rng(7), 1, 3, row_lens, starts, used + 16, width=5,
                   tuning=PrefillTuning(block_q=16, block_k=16))


def _check_decode(rng, group_size, q_per_kv, lengths, width):
    """The XLA decode against the reference for rows of `lengths` [batch, groups]; rows of
    length 0 (padding) give 0."""
    batch, groups = lengths.shape
    k_pages, v_pages, tables = _pool(rng, batch, groups, group_size, width)
    q = jnp.asarray(rng.normal(size=(batch, groups, group_size * q_per_kv, D)), jnp.float32)
    args = (q, k_pages, v_pages, tables, jnp.asarray(lengths))
    out = np.asarray(ragged_paged_decode_attention_xla(*args))
    ref = np.asarray(ragged_paged_decode_attention_reference(*args))
    padded = (lengths == 0).all(axis=1)
    np.testing.assert_allclose(out[~padded], ref[~padded], rtol=1e-4, atol=1e-5)
    assert (out[padded] == 0).all()


@pytest.mark.parametrize("group_size,q_per_kv", [(1, 3), (2, 2), (4, 1)])
def test_decode_matches_reference(group_size, q_per_kv):
    rng = np.random.default_rng(group_size)
    width = 3
    lengths = rng.integers(1, width * PAGE + 1, size=(3, 2)).astype(np.int32)
    lengths[2] = 0                                           # a padded row
    _check_decode(rng, group_size, q_per_kv, lengths, width)


def test_history_longer_than_a_block_is_read_block_by_block():
    """Tables wider than `HISTORY_BLOCK_PAGES`: histories ending in the first, second and third
    block, merged by their maxima (online softmax), equal the reference's one softmax; a padded
    decode row (length 0) reads no block and gives 0."""
    from tangram_jax.engine.xla_attention import HISTORY_BLOCK_PAGES
    width = 2 * HISTORY_BLOCK_PAGES + 3
    rng = np.random.default_rng(11)
    _check_prefill(rng, 1, 3, [6, 4], np.array([0, 6], np.int32), 12, width=width)
    block = HISTORY_BLOCK_PAGES * PAGE
    _check_decode(rng, 2, 3, np.array([[5, block + 3], [2 * block + 7, width * PAGE],
                                       [block, 1], [0, 0]], np.int32), width)


def test_own_tokens_longer_than_a_query_block_skip_the_upper_blocks():
    """Rows longer than `OWN_BLOCK`: each query block attends to the keys up to its end (the
    blocks above the diagonal are not computed), equal to the reference's full causal square;
    a second row starts inside a block of the first's tail."""
    from tangram_jax.engine.xla_attention import OWN_BLOCK
    row_lens = [OWN_BLOCK + 37, OWN_BLOCK // 2 + 3]
    starts = np.array([0, OWN_BLOCK + 40], np.int32)
    _check_prefill(np.random.default_rng(13), 1, 3, row_lens, starts,
                   int(starts[1]) + row_lens[1] + 5, width=3)
