"""Chunked-prefill attention: one chunk's queries over the group's paged history plus the chunk.

Flash-attention style: each program keeps an online softmax for a block of query rows of one
query head, first over the retained history of that head's KV head (pages of its group; all of it
is in the past, so only the length masks it), then over the chunk's keys up to the causal limit.
It writes the output and the row's log-sum-exp. The scorers need the softmax of the last
`obs_window` valid queries over the chunk's keys (normalised over history + chunk): with the
log-sum-exp in hand those rows are ``exp(q . k * scale - lse)``, an [heads, obs_window, T] product
computed beside the kernel; no [T, T] matrix is built for the other queries.

Grid: ``(num_q_heads, T_padded // block_q)``. Query head h reads KV head ``h // q_per_kv``, which
is head ``(h // q_per_kv) % G`` of group ``(h // q_per_kv) // G`` in the pool.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.backend import dot_f32 as _dot

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _online_softmax_step(q, k, v, valid, key_valid, carry, scale):
    """One block of keys: valid [rows, keys] bool, key_valid [keys] (the keys any row may see);
    k, v [keys, d]. Returns the new carry."""
    o_prev, m_prev, l_prev = carry
    logits = _dot(q, k, trans_b=True) * scale
    logits = jnp.where(valid, logits, _MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = correction * l_prev + p.sum(axis=-1)
    v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))      # unowned slots may hold NaN
    o_next = correction[:, None] * o_prev + _dot(p.astype(v.dtype), v)
    return o_next, m_next, l_next


def _prefill_kernel(hist_ref, chunk_len_ref, block_table_ref, q_ref, k_chunk_ref, v_chunk_ref,
                    k_pages_ref, v_pages_ref, o_ref, lse_ref, *, page_size: int,
                    pages_per_block: int, block_k: int, q_per_kv: int, group_size: int,
                    scale: float, table_pages: int):
    """hist_ref [groups]; chunk_len_ref [1]; block_table_ref [groups, max_pages];
    q_ref [block_q, d]; k/v_chunk_ref [T_padded, d] (this KV head's); k/v_pages_ref
    [num_pages, page_size, d] (this KV head's slab); o_ref [block_q, d]; lse_ref [block_q]."""
    head = pl.program_id(0)
    q_block = pl.program_id(1)
    group = (head // q_per_kv) // group_size
    # History past the block table (a caller's bug) is cut there rather than read out of bounds.
    hist = jnp.minimum(hist_ref[group], table_pages * page_size)
    chunk_len = chunk_len_ref[0]
    q = q_ref[...]
    block_q = q.shape[0]
    rows = q_block * block_q + jnp.arange(block_q)

    hist_tokens = pages_per_block * page_size

    def history_body(block, carry):
        first_page = block * pages_per_block
        page_ids = block_table_ref[group, pl.ds(first_page, pages_per_block)]
        page_ids = jnp.where(first_page + jnp.arange(pages_per_block) < pl.cdiv(hist, page_size),
                             page_ids, 0)
        k = k_pages_ref[page_ids].reshape(hist_tokens, -1)
        v = v_pages_ref[page_ids].reshape(hist_tokens, -1)
        key_valid = first_page * page_size + jnp.arange(hist_tokens) < hist
        valid = jnp.broadcast_to(key_valid[None, :], (block_q, hist_tokens))
        return _online_softmax_step(q, k, v, valid, key_valid, carry, scale)

    def chunk_body(block, carry):
        keys = block * block_k + jnp.arange(block_k)
        k = k_chunk_ref[pl.ds(block * block_k, block_k), :]
        v = v_chunk_ref[pl.ds(block * block_k, block_k), :]
        key_valid = keys < chunk_len
        valid = (keys[None, :] <= rows[:, None]) & key_valid[None, :]
        return _online_softmax_step(q, k, v, valid, key_valid, carry, scale)

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), _MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, pl.cdiv(hist, hist_tokens), history_body, carry)
    last_key = jnp.minimum((q_block + 1) * block_q, chunk_len)
    carry = lax.fori_loop(0, pl.cdiv(last_key, block_k), chunk_body, carry)
    o, m, l = carry
    has_keys = l > 0.0
    safe_l = jnp.where(has_keys, l, 1.0)
    o_ref[...] = (o / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, m + jnp.log(safe_l), -jnp.inf)


def _observation_probs(q, k_chunk, lse, chunk_len, obs_window, scale):
    """[num_q_heads, obs_window, T] softmax rows of queries chunk_len - obs_window + i over the
    chunk's keys (0 for rows before the chunk start and for masked keys)."""
    chunk, num_q_heads, _ = q.shape
    q_per_kv = num_q_heads // k_chunk.shape[1]
    rows = chunk_len - obs_window + jnp.arange(obs_window)
    row_ok = rows >= 0
    safe_rows = jnp.clip(rows, 0, chunk - 1)
    q_obs = q[safe_rows].astype(jnp.float32)                                 # [W, Hq, d]
    k = jnp.repeat(k_chunk.astype(jnp.float32), q_per_kv, axis=1)            # [T, Hq, d]
    logits = jnp.einsum("whd,thd->hwt", q_obs, k, precision=lax.Precision.HIGHEST) * scale
    keys = jnp.arange(chunk)
    valid = (keys[None, :] <= rows[:, None]) & (keys[None, :] < chunk_len) & row_ok[:, None]
    row_lse = lse[:, safe_rows]                                              # [Hq, W]
    probs = jnp.exp(jnp.where(valid[None], logits - row_lse[..., None], -jnp.inf))
    return jnp.where(valid[None], probs, 0.0)


@functools.partial(jax.jit, static_argnames=("obs_window", "interpret", "block"))
def _prefill(q, k_chunk, v_chunk, k_pages, v_pages, block_table, hist_len, chunk_len, *,
             obs_window: int, interpret: bool, block: int):
    chunk, num_q_heads, head_dim = q.shape
    num_kv_heads = k_chunk.shape[1]
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = num_q_heads // num_kv_heads
    pages_per_block = max(1, block // page_size)
    padded = -(-chunk // block) * block
    pad_rows = ((0, padded - chunk), (0, 0), (0, 0))
    q_p, k_p, v_p = (jnp.pad(x, pad_rows) for x in (q, k_chunk, v_chunk))
    max_pages = block_table.shape[1]
    block_table = jnp.pad(block_table, ((0, 0), (0, -max_pages % pages_per_block)))
    chunk_len_arr = jnp.reshape(chunk_len, (1,)).astype(jnp.int32)

    kv_head = lambda h: h // q_per_kv  # noqa: E731
    chunk_spec = pl.BlockSpec((padded, None, head_dim), lambda h, b: (0, kv_head(h), 0))
    pool_spec = pl.BlockSpec((num_pages, None, page_size, head_dim),
                             lambda h, b: (0, kv_head(h) % group_size, 0, 0))
    kernel = functools.partial(_prefill_kernel, page_size=page_size,
                               pages_per_block=pages_per_block, block_k=block,
                               q_per_kv=q_per_kv, group_size=group_size,
                               scale=1.0 / math.sqrt(head_dim), table_pages=max_pages)
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_q_heads, padded // block),
        in_specs=[
            pl.BlockSpec(hist_len.shape, lambda h, b: (0,)),
            pl.BlockSpec((1,), lambda h, b: (0,)),
            pl.BlockSpec(block_table.shape, lambda h, b: (0, 0)),
            pl.BlockSpec((block, None, head_dim), lambda h, b: (b, h, 0)),
            chunk_spec, chunk_spec, pool_spec, pool_spec,
        ],
        out_specs=[pl.BlockSpec((block, None, head_dim), lambda h, b: (b, h, 0)),
                   pl.BlockSpec((None, block), lambda h, b: (h, b))],
        out_shape=[jax.ShapeDtypeStruct((padded, num_q_heads, head_dim), q.dtype),
                   jax.ShapeDtypeStruct((num_q_heads, padded), jnp.float32)],
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=4, num_stages=2),
        name="chunk_prefill_attention",
    )(hist_len, chunk_len_arr, block_table, q_p, k_p, v_p, k_pages, v_pages)
    obs = _observation_probs(q, k_chunk, lse[:, :chunk], chunk_len, obs_window,
                             1.0 / math.sqrt(head_dim))
    return out[:chunk], obs


def chunk_prefill_attention(q, k_chunk, v_chunk, k_pages, v_pages, block_table, hist_len,
                            chunk_len, *, obs_window: int, interpret: bool | None = None,
                            block: int = 64):
    """Attention of one sequence's prefill chunk over its retained history and itself (causal).

    Args:
      q: [T, num_q_heads, head_dim]; k_chunk, v_chunk: [T, num_kv_heads, head_dim] (RoPE applied,
        heads in permuted order); T is the static chunk size, rows >= chunk_len are padding.
      k_pages, v_pages: [num_pages, G, page_size, head_dim]; block_table: int32 [groups,
        max_pages]; hist_len: int32 [groups] retained history tokens.
      chunk_len: int32 scalar, valid rows.
      obs_window: rows of the observation window (static).
      block: query/key block (a power of two; history steps cover block // page_size pages).
    Returns (out [T, num_q_heads, head_dim] in q's dtype, finite on padding rows;
      obs_probs float32 [num_q_heads, obs_window, T]: row i is query chunk_len - obs_window + i,
      its softmax over history + chunk restricted to the chunk's keys; rows before the chunk
      start are 0).
    """
    if q.ndim != 3 or k_chunk.ndim != 3 or k_chunk.shape != v_chunk.shape:
        raise ValueError(f"q must be [T, Hq, d] and k_chunk/v_chunk [T, Hkv, d]; got {q.shape}, "
                         f"{k_chunk.shape}, {v_chunk.shape}")
    if q.shape[0] != k_chunk.shape[0] or q.shape[2] != k_chunk.shape[2]:
        raise ValueError(f"q {q.shape} and k_chunk {k_chunk.shape} disagree on T or head_dim")
    if q.shape[1] % k_chunk.shape[1]:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads "
                         f"{k_chunk.shape[1]}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != q.shape[2]:
        raise ValueError(f"k_pages/v_pages must be [num_pages, G, page_size, {q.shape[2]}], got "
                         f"{k_pages.shape}, {v_pages.shape}")
    num_groups = k_chunk.shape[1] // k_pages.shape[1]
    if k_chunk.shape[1] % k_pages.shape[1] or hist_len.shape != (num_groups,) or \
            block_table.ndim != 2 or block_table.shape[0] != num_groups:
        raise ValueError(f"expected {num_groups} groups of G={k_pages.shape[1]}: block_table "
                         f"{block_table.shape}, hist_len {hist_len.shape}")
    if block_table.dtype != jnp.int32 or hist_len.dtype != jnp.int32:
        raise TypeError("block_table and hist_len must be int32")
    if obs_window < 1 or obs_window > q.shape[0]:
        raise ValueError(f"obs_window must be in [1, T={q.shape[0]}], got {obs_window}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return _prefill(q, k_chunk, v_chunk, k_pages, v_pages, block_table, hist_len,
                    jnp.asarray(chunk_len, jnp.int32), obs_window=obs_window,
                    interpret=backend.resolve_interpret(interpret), block=block)


@functools.partial(jax.jit, static_argnames=("obs_window",))
def chunk_prefill_attention_reference(q, k_chunk, v_chunk, k_pages, v_pages, block_table,
                                      hist_len, chunk_len, *, obs_window: int):
    """Full softmax over [gathered history ; chunk] in float32 jnp (builds the T x keys matrix)."""
    chunk, num_q_heads, head_dim = q.shape
    num_kv_heads = k_chunk.shape[1]
    num_pages, group_size, page_size, _ = k_pages.shape
    q_per_kv = num_q_heads // num_kv_heads
    max_pages = block_table.shape[1]
    tables = jnp.clip(block_table, 0, num_pages - 1)

    def history(pages):   # -> [num_kv_heads, max_pages * page_size, d]
        x = pages[tables]                                    # [groups, max_pages, G, ps, d]
        x = jnp.moveaxis(x, 2, 1).reshape(num_kv_heads, max_pages * page_size, head_dim)
        return x.astype(jnp.float32)

    keys = jnp.concatenate([history(k_pages), jnp.moveaxis(k_chunk, 0, 1).astype(jnp.float32)],
                           axis=1)
    vals = jnp.concatenate([history(v_pages), jnp.moveaxis(v_chunk, 0, 1).astype(jnp.float32)],
                           axis=1)
    keys = jnp.repeat(keys, q_per_kv, axis=0)                # [Hq, S, d]
    vals = jnp.repeat(vals, q_per_kv, axis=0)
    hist_per_head = jnp.repeat(jnp.repeat(hist_len, group_size), q_per_kv)  # [Hq]
    num_hist = max_pages * page_size
    rows = jnp.arange(chunk)
    s = jnp.arange(num_hist + chunk)
    hist_ok = (s[None, None, :] < num_hist) & (s[None, None, :] < hist_per_head[:, None, None])
    c = s - num_hist
    chunk_ok = (c >= 0)[None, None, :] & (c[None, None, :] <= rows[None, :, None]) & \
        (c[None, None, :] < chunk_len)
    valid = hist_ok | chunk_ok                                # [Hq, T, S]
    logits = jnp.einsum("thd,hsd->hts", q.astype(jnp.float32), keys,
                        precision=lax.Precision.HIGHEST) / math.sqrt(head_dim)
    logits = jnp.where(valid, logits, -jnp.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(valid, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("hts,hsd->thd", p, jnp.where(valid.any(axis=1)[..., None], vals, 0.0),
                     precision=lax.Precision.HIGHEST)
    obs_rows = chunk_len - obs_window + jnp.arange(obs_window)
    obs = p[:, jnp.clip(obs_rows, 0, chunk - 1), num_hist:]
    obs = jnp.where((obs_rows >= 0)[None, :, None], obs, 0.0)
    return out.astype(q.dtype), obs
