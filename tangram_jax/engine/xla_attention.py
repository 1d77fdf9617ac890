"""The CPU serving path of attention: XLA programs with the signatures of the Pallas kernels
(`pallas_kernels.prefill_attention.ragged_prefill_attention`,
`pallas_kernels.decode_attention.ragged_paged_decode_attention`), written for speed where the
kernels do not compile, unlike the kernels' test references beside them (which build one
N x keys matrix per row with every mask materialised, in HIGHEST precision).

What they read: a row's block table in blocks of `HISTORY_BLOCK_PAGES` pages, skipping the
blocks past its longest group (`lax.cond`), so the runner passes the whole table (one compiled
width, `ModelRunner._table_width`) and a step still reads only the pages its rows hold. Masks are
additive biases built from small index vectors, so XLA fuses them into the softmax
instead of materialising [N, heads, keys] booleans. The history and the new tokens of a prefill
row are two softmax blocks merged by their maxima (no concatenation of keys); a row's history is
read per query tile of that row, so a call of several rows costs N x keys, not rows x N x keys.

Pool contents are finite by construction (zeros, or K/V the model wrote), so keys outside a
row's length get probability exactly 0 and their values need no masking.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import kv_quant
from ..pallas_kernels.attention_terms import apply_sinks, first_visible_slot


def _gather_history(pages: kv_quant.Pages, tables: jax.Array) -> jax.Array:
    """pages [num_pages, G, ps, d] (an array or `kv_quant.QuantPages`, dequantised here), tables
    int [..., groups, W] (clipped) -> [..., groups * G, W * ps, d] float32: each head's retained
    tokens in order."""
    x = kv_quant.take_pages(pages, tables, jnp.float32)  # [..., groups, W, G, ps, d]
    x = jnp.moveaxis(x, -3, -4)                         # [..., groups, G, W, ps, d]
    *lead, groups, g, w, ps, d = x.shape
    return x.reshape(*lead, groups * g, w * ps, d)


# Query tokens of one block of a prefill's own causal attention: each block attends to the keys
# up to its end only, so the upper half of the N x N square (blocks above the diagonal) is not
# computed (one block of N tokens when N <= OWN_BLOCK).
OWN_BLOCK = 128

# Pages of one history block: attention walks a row's block table in blocks of this many pages
# and skips the blocks past the row's longest group, so a step can take the whole table (one
# compiled shape) and still read only what its rows hold.
HISTORY_BLOCK_PAGES = 32


def _history_attention(q, k_pages, v_pages, table, seen, query_valid=None, lower=None):
    """Unnormalised softmax attention of one row's queries over its history.

    q [heads, M, d] float32 (scaled; heads = groups * G, head-major); k_pages, v_pages
    [num_pages, G, ps, d]; table int [groups, W] (clipped); seen int [heads]: each head attends
    to its first `seen` history tokens; query_valid bool [M] (default all); lower int [heads,
    M] (a local layer's window, `attention_terms`): the first slot each query sees (default 0).
    Returns (m [heads, M] the running maximum, -inf where nothing was seen; denom [heads, M];
    acc [heads, M, d]). The table is read in blocks of `HISTORY_BLOCK_PAGES` pages merged by
    their maxima (online softmax); a block past every head's `seen`, or before every query's
    `lower`, is skipped (`lax.cond`: no gather, no dot), so a padded row (seen 0) costs nothing,
    a local layer reads its window's blocks only, and the width given is only an upper bound."""
    heads, rows, head_dim = q.shape
    width, page_size = table.shape[-1], k_pages.shape[2]
    carry = (jnp.full((heads, rows), -jnp.inf, jnp.float32),
             jnp.zeros((heads, rows), jnp.float32), jnp.zeros((heads, rows, head_dim), jnp.float32))
    most = seen.max()
    least = 0 if lower is None else lower.min()
    for first in range(0, width, HISTORY_BLOCK_PAGES):
        last = min(width, first + HISTORY_BLOCK_PAGES)

        def block(carry, first=first, last=last):
            m, denom, acc = carry
            keys = _gather_history(k_pages, table[:, first:last])       # [heads, S, d]
            vals = _gather_history(v_pages, table[:, first:last])
            slot = first * page_size + jnp.arange((last - first) * page_size)
            mask = (slot[None, None, :] < seen[:, None, None])          # [heads, 1, S]
            if query_valid is not None:
                mask = mask & query_valid[None, :, None]
            if lower is not None:
                mask = mask & (slot[None, None, :] >= lower[:, :, None])
            logits = jnp.einsum("hmd,hsd->hms", q, keys) + jnp.where(mask, 0.0, -jnp.inf)
            new_m = jnp.maximum(m, logits.max(axis=-1))
            safe_m = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
            p = jnp.exp(logits - safe_m[..., None])
            scale = jnp.where(jnp.isfinite(m), jnp.exp(m - safe_m), 0.0)
            return (new_m, denom * scale + p.sum(axis=-1),
                    acc * scale[..., None] + jnp.einsum("hms,hsd->hmd", p, vals))

        carry = jax.lax.cond((most > first * page_size) & (least < last * page_size), block,
                             lambda c: c, carry)
    return carry


def ragged_prefill_attention_xla(q, k, v, k_pages, v_pages, block_tables, hist_len, row_starts,
                                 row_lens, work_items=None, tuning=None, *, window=None,
                                 sinks=None):
    """Ragged prefill attention (signature and result of `ragged_prefill_attention`, window
    and sinks included: `attention_terms`).

    q [N, Hq, d]; k, v [N, Hkv, d] (flat rows at `row_starts`, lengths `row_lens` [rows]);
    k_pages, v_pages [num_pages, G, ps, d]; block_tables [rows, groups, W]; hist_len [rows,
    groups] (precision tiers, `kv_quant.TieredPages`: tables and lengths of tier groups, both
    tiers of a group read as one dense float32 history). Every token of a row attends to its
    row's history (the first hist_len tokens of each group) and causally to its row's earlier
    tokens. Returns (out [N, Hq, d] in q's dtype, lse [Hq, N] float32; tokens outside every row:
    out 0, lse -inf). `work_items` are ignored;
    `tuning` (default `PREFILL_TUNING`) gives the row alignment.

    The history is read per query tile of `row_alignment(tuning)` tokens (`lax.map`): row starts
    are multiples of it, so each tile belongs to one row and attends to that row's history only
    (its pages gathered once per tile, then in cache for its two dots), where computing every
    row's history against all N queries cost rows x N x keys.
    """
    from tangram_jax.pallas_kernels.prefill_attention import PREFILL_TUNING, row_alignment
    del work_items
    if kv_quant.is_tiered(k_pages, v_pages):   # computed in float32, as everything here
        k_pages, v_pages, block_tables, hist_len = kv_quant.tiered_dense_history(
            k_pages, v_pages, block_tables, hist_len, jnp.float32)
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_pages, group_size, page_size, _ = k_pages.shape
    rows, _, width = block_tables.shape
    q_per_kv = num_q_heads // num_kv_heads
    # Row starts are multiples of the row alignment (the kernel's contract; `pack_rows`). A flat
    # axis that is not (the runner never builds one) takes one-token tiles: exact, slower.
    tile = row_alignment(tuning or PREFILL_TUNING)
    if n % tile:
        tile = 1
    qg = (q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))).reshape(
        n, num_kv_heads, q_per_kv, head_dim)
    token = jnp.arange(n)
    local = token[None, :] - row_starts[:, None]                            # [rows, N]
    member = (local >= 0) & (local < row_lens[:, None])
    row_of = jnp.where(member.any(axis=0), jnp.argmax(member, axis=0), -1)  # [N]
    neg = jnp.float32(-jnp.inf)

    # The rows' own tokens: a block-diagonal causal softmax over all rows, computed per query
    # block of `OWN_BLOCK` tokens against the keys up to that block's end only (the blocks
    # above the diagonal are never anyone's: a token sees no later token).
    own = ((row_of[:, None] == row_of[None, :]) & (row_of[None, :] >= 0)
           & (token[None, :] <= token[:, None]))                            # [N(q), N(k)]
    if window is not None:   # a row's tokens are consecutive slots: the window is by token
        own = own & (token[None, :] >= first_visible_slot(token, window)[:, None])
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    parts = []
    for first in range(0, n, OWN_BLOCK):
        last = min(n, first + OWN_BLOCK)
        logits = jnp.einsum("nkjd,mkd->nkjm", qg[first:last], k32[:last]) \
            + jnp.where(own[first:last, :last], 0.0, neg)[:, None, None, :]
        m_blk = logits.max(axis=-1)                                        # [b, Hkv, qpk]
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m_blk), m_blk, 0.0)[..., None])
        parts.append((m_blk, p.sum(axis=-1), jnp.einsum("nkjm,mkd->nkjd", p, v32[:last])))
    own_m, own_denom, own_acc = (jnp.concatenate(x) for x in zip(*parts))

    # Each tile's row history: the first hist_len tokens of every head of that row, in blocks of
    # pages (blocks past the row's history skipped).
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    tiles = n // tile
    tile_row = row_of[::tile]                                              # [tiles]

    def history(xs):
        q_tile, row, valid, first_token = xs    # [tile, Hkv, qpk, d], scalar, [tile], scalar
        r = jnp.maximum(row, 0)
        seen = jnp.where(row >= 0, jnp.repeat(hist_len[r], group_size), 0)    # [Hkv]
        heads_major = jnp.moveaxis(q_tile, 0, 1).reshape(num_kv_heads, tile * q_per_kv, head_dim)
        lower = None
        if window is not None:   # query i of the row sits at slot hist + i of its group
            slots = seen[:, None] + (first_token - row_starts[r] + jnp.arange(tile))[None, :]
            lower = jnp.repeat(first_visible_slot(slots, window), q_per_kv, axis=1)
        m, denom, acc = _history_attention(heads_major, k_pages, v_pages, tables[r], seen,
                                           jnp.repeat(valid, q_per_kv), lower)
        back = lambda x: jnp.moveaxis(x.reshape(num_kv_heads, tile, q_per_kv, *x.shape[2:]), 1, 0)
        return back(m), back(denom), back(acc)

    hist_m, hist_denom, hist_acc = jax.lax.map(history, (
        qg.reshape(tiles, tile, num_kv_heads, q_per_kv, head_dim), tile_row,
        (row_of >= 0).reshape(tiles, tile), jnp.arange(tiles) * tile))
    hist_m, hist_denom = hist_m.reshape(own_m.shape), hist_denom.reshape(own_m.shape)
    hist_acc = hist_acc.reshape(own_acc.shape)

    # Merge the two blocks by their maxima.
    m = jnp.maximum(own_m, hist_m)
    safe_m = jnp.where(jnp.isfinite(m), m, 0.0)
    own_scale = jnp.where(jnp.isfinite(own_m), jnp.exp(own_m - safe_m), 0.0)
    hist_scale = jnp.where(jnp.isfinite(hist_m), jnp.exp(hist_m - safe_m), 0.0)
    denom = own_denom * own_scale + hist_denom * hist_scale
    acc = own_acc * own_scale[..., None] + hist_acc * hist_scale[..., None]
    found = denom > 0
    out = acc / jnp.where(found, denom, 1.0)[..., None]
    lse = jnp.where(found, safe_m + jnp.log(jnp.where(found, denom, 1.0)), neg)
    return apply_sinks(out.reshape(n, num_q_heads, head_dim).astype(q.dtype),
                       jnp.moveaxis(lse.reshape(n, num_q_heads), 0, 1), sinks)


def ragged_paged_decode_attention_xla(q, k_pages, v_pages, block_tables, lengths,
                                      work_list=None, *, window=None, sinks=None):
    """Decode attention of one query token per row (signature and result of
    `ragged_paged_decode_attention`): q [B, groups, G * q_per_kv, d]; block_tables [B, groups,
    W]; lengths [B, groups] retained tokens (the new one included); window, sinks:
    `attention_terms` (the query sits at slot length - 1). Returns [B, groups, G * q_per_kv,
    d] in q's dtype (rows of length 0: 0). `work_list` is ignored.

    One row at a time (`lax.map`): a row's gathered keys and values (2 x groups x W pages) stay
    in the CPU's cache for its two dots, where gathering the whole batch first wrote them all
    out to memory and read them back (SmolLM2, 8 rows of 1,100 tokens: 3.7 against 6.7 ms a
    layer on a 2-core CPU)."""
    del work_list
    batch, num_groups, q_rows, head_dim = q.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    qg = (q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))).reshape(
        batch, num_groups * group_size, q_rows // group_size, head_dim)
    sink = None if sinks is None else \
        sinks.astype(jnp.float32).reshape(num_groups * group_size, q_rows // group_size)

    def one_row(row):
        q_row, table, length = row                  # [heads, j, d], [groups, W], [groups]
        seen = jnp.repeat(length, group_size)
        lower = None if window is None else jnp.broadcast_to(
            first_visible_slot(seen - 1, window)[:, None], q_row.shape[:2])
        m, denom, acc = _history_attention(q_row, k_pages, v_pages, table, seen, lower=lower)
        if sink is not None:   # the sink's term of the denominator (`attention_terms`)
            denom = denom + jnp.exp(sink - jnp.where(jnp.isfinite(m), m, sink))
        return acc / jnp.where(denom > 0, denom, 1.0)[..., None]

    out = jax.lax.map(one_row, (qg, tables, lengths))
    return out.reshape(q.shape).astype(q.dtype)


# ----- prefill writes, planned in the layer loop and applied after it ---------------------------
# XLA (CPU) cannot update the pool in place where one layer step both reads it (the history) and
# writes it (the chunk): it copies the whole pool every layer, so a prefill call's time grew with
# the pool (2.5x from a 2k- to a 24k-token pool). The CPU path therefore only plans each layer's
# writes inside the loop (the slots and rows of `chunk_compress.plan_destination_writes`: the pages
# of one layer are no other layer's, so nothing in the call reads them) and scatters them all
# once after it, in place.

def apply_chunk_writes(k_pages, v_pages, where, rows):
    """Scatter planned writes (`chunk_compress.plan_destination_writes` outputs stacked over
    any leading axes) into the pool; returns the new (k_pages, v_pages)."""
    page, head_in_page, offset = (x.reshape(-1) for x in where)
    k_rows, v_rows = (x.reshape(-1, x.shape[-1]) for x in rows)
    k_pages = k_pages.at[page, head_in_page, offset].set(k_rows.astype(k_pages.dtype),
                                                         mode="drop")
    v_pages = v_pages.at[page, head_in_page, offset].set(v_rows.astype(v_pages.dtype),
                                                         mode="drop")
    return k_pages, v_pages
