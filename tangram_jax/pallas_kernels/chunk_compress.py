"""Fused chunk compression: write each head's kept tokens of one prefill chunk into its pages.

Where each token goes is decided first (jnp, before the kernel), as a destination slot per
(head, chunk token), -1 for a token not kept:

- `chunk_destinations` (retention ``"chunk"``): head h of group g = h // G keeps its
  ``keep_counts[g]`` highest-scoring valid tokens (ties: the earlier token) in temporal order in
  slots ``hist_len[g] .. hist_len[g] + count - 1`` (`kept_token_sources` lists them);
- a turn compaction (retention ``"turn"``, `ModelRunner._turn_compaction`): the whole turn's
  kept tokens, held slots and the last chunk's, in temporal order from the turn's first slot.

`page_writes` turns the destinations into a list of *dirty pages* per head (the pages a write
lands in, at most `max_dirty` of them) and, per dirty page, the chunk row each of its slots
receives. The kernel then gathers those rows from the chunk and stores them into the pages,
never materialising more than the chunk.

Grid: ``(num_kv_heads, max_dirty)``. Program (h, i) owns the i-th dirty page of head h (logical
page ``dirty[h, i]`` of its group's block table; -1: nothing to do): it fills the slots of that
page that receive a row and leaves every other slot untouched (masked store), so programs never
write the same slot and no other slot of the pool changes. The pool is updated in place
(`input_output_aliases`; donate it in the caller).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tangram_jax import kv_quant
from tangram_jax.pallas_kernels import backend


def _kept(scores: jax.Array, keep_counts: jax.Array, chunk_len: jax.Array,
          group_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(kept bool [heads, T]: each head's top min(keep_counts[h // G], chunk_len) valid tokens by
    score, ties to the earlier token; place int32 [heads, T]: a kept token's index among the kept
    ones in temporal order; counts int32 [heads])."""
    num_heads, chunk = scores.shape
    t = jnp.arange(chunk, dtype=jnp.int32)
    valid = t < chunk_len
    counts = jnp.minimum(jnp.repeat(keep_counts.astype(jnp.int32), group_size), chunk_len)
    masked = jnp.where(valid[None, :], scores.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(-masked, axis=1, stable=True)                   # best first
    # The rank of each token: the inverse permutation of `order`, by a scatter (not a sort).
    rank = jnp.zeros((num_heads, chunk), jnp.int32).at[jnp.arange(num_heads)[:, None], order].set(
        jnp.broadcast_to(t, (num_heads, chunk)))
    kept = (rank < counts[:, None]) & valid[None, :]
    return kept, jnp.cumsum(kept, axis=1, dtype=jnp.int32) - 1, counts.astype(jnp.int32)


def kept_token_sources(scores: jax.Array, keep_counts: jax.Array, chunk_len: jax.Array,
                       group_size: int) -> tuple[jax.Array, jax.Array]:
    """Per head, the chunk indices of its kept tokens in temporal order.

    scores: float32 [num_kv_heads, T]; keep_counts: int32 [num_groups]; chunk_len: int32 scalar.
    Returns (sources int32 [num_kv_heads, T] whose first counts[h] entries are the kept tokens in
    increasing order (the rest: 0), counts int32 [num_kv_heads] = min(keep_counts[h // G],
    chunk_len)).
    """
    num_heads, chunk = scores.shape
    kept, place, counts = _kept(scores, keep_counts, chunk_len, group_size)
    sources = jnp.zeros((num_heads, chunk), jnp.int32).at[
        jnp.arange(num_heads)[:, None], jnp.where(kept, place, chunk)].set(
        jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (num_heads, chunk)), mode="drop")
    return sources, counts


def chunk_destinations(scores: jax.Array, keep_counts: jax.Array, chunk_len: jax.Array,
                       hist_len: jax.Array, group_size: int) -> jax.Array:
    """Retention ``"chunk"``: int32 [num_kv_heads, T], the slot of each chunk token (each head's
    top ``keep_counts[g]`` in temporal order from slot ``hist_len[g]``), -1 where not kept.
    scores float32 [heads, T]; keep_counts, hist_len int32 [groups]; chunk_len int32 scalar."""
    kept, place, _ = _kept(scores, keep_counts, chunk_len, group_size)
    first = jnp.repeat(hist_len.astype(jnp.int32), group_size)[:, None]
    return jnp.where(kept, first + place, -1)


def contiguous_dirty_pages(chunk: int, page_size: int) -> int:
    """Dirty pages a head can have when its writes (at most `chunk` rows) are consecutive
    slots, as every writer's are."""
    return pl.cdiv(chunk, page_size) + 1


def page_writes(dest: jax.Array, page_size: int, max_dirty: int) -> tuple[jax.Array, jax.Array]:
    """Destinations [heads, T] (slot or -1) as per-page writes: (dirty int32 [heads, max_dirty],
    the logical pages written in increasing order, -1 past the last; rows int32 [heads,
    max_dirty, page_size], the chunk row each slot of each dirty page receives, -1 for none).
    `max_dirty` must be at least the number of distinct pages of any head's destinations."""
    heads, chunk = dest.shape
    none = jnp.iinfo(jnp.int32).max
    page = jnp.where(dest >= 0, dest // page_size, none)
    order = jnp.argsort(page, axis=1, stable=True)
    by_page = jnp.take_along_axis(page, order, axis=1)
    first = jnp.concatenate([jnp.ones((heads, 1), bool), by_page[:, 1:] != by_page[:, :-1]], 1)
    index = jnp.cumsum(first, axis=1) - 1                          # dirty index, page order
    h = jnp.arange(heads)[:, None]
    dirty = jnp.full((heads, max_dirty), -1, jnp.int32).at[
        h, jnp.where(first & (by_page != none), index, max_dirty)].set(
        by_page.astype(jnp.int32), mode="drop")
    token = order                                                  # chunk row, page order
    slot = jnp.take_along_axis(dest, order, axis=1) % page_size
    rows = jnp.full((heads, max_dirty, page_size), -1, jnp.int32).at[
        h, jnp.where(by_page != none, index, max_dirty), slot].set(
        token.astype(jnp.int32), mode="drop")
    return dirty, rows


def _write_kernel(block_table_ref, dirty_ref, rows_ref, *refs, page_size: int, group_size: int,
                  paired: tuple):
    """block_table_ref [groups, max_pages]; dirty_ref [max_dirty] (this head's); rows_ref
    [page_size] (this program's page: the chunk row of each slot, -1 none); then n chunk refs
    [T, ...] (this head's rows of each pool array: K and V values, or K codes, scales and zeros
    and the same of V), n pool refs (the same buffers as the outputs; read only
    by slot-pair streams) and n pool out refs [num_pages, page_size, ...] (this head's slab of
    each pool array, aliased; a slot-pair stream's, `paired[i]`, [num_pages, page_size / 2, w]
    uint16 of its uint8 chunk rows, `kv_quant.pair_slots`)."""
    n = len(refs) // 3
    chunk_refs, pool_refs, out_refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    group = pl.program_id(0) // group_size
    chunk = chunk_refs[0].shape[0]
    max_pages = block_table_ref.shape[1]
    page_index = dirty_ref[pl.program_id(1)]
    live = (page_index >= 0) & (page_index < max_pages)
    page = block_table_ref[group, jnp.clip(page_index, 0, max_pages - 1)]

    def source(slots):
        """(written, chunk row) of the page's `slots`."""
        row = rows_ref[slots]
        return (row >= 0) & live, jnp.clip(row, 0, chunk - 1)

    write, src = source(jnp.arange(page_size))
    if any(paired):
        even, odd = (source(2 * jnp.arange(page_size // 2) + s) for s in (0, 1))
    for chunk_ref, pool_ref, out_ref, pairs in zip(chunk_refs, pool_refs, out_refs, paired):
        if pairs:   # each unit: the even slot's byte low, the odd slot's high (either kept)
            old = plgpu.load(pool_ref.at[page])                    # [page_size / 2, w]
            low = jnp.where(even[0][:, None], chunk_ref[even[1]].astype(jnp.uint16), old & 0xFF)
            high = jnp.where(odd[0][:, None], chunk_ref[odd[1]].astype(jnp.uint16), old >> 8)
            rows, written = low | (high << 8), even[0] | odd[0]
        else:
            rows, written = chunk_ref[src], write                  # [page_size, ...]
        mask = written.reshape(written.shape + (1,) * (rows.ndim - 1))
        plgpu.store(out_ref.at[page], rows, mask=jnp.broadcast_to(mask, rows.shape))


def _pool_streams(chunk, pages):
    """The (chunk rows, pool array, slot pairs) triples one of K or V writes: its values cast
    to the pool dtype, or, for a quantised pool, the chunk quantised per (token, head)
    (`kv_quant`) as codes, scales and zeros. Quantising the whole chunk before the selection
    gives the kept tokens the same codes as quantising them after it: the code of a row depends
    on that row alone."""
    if isinstance(pages, kv_quant.QuantPages):
        codes, scale, zero = kv_quant.quantise(chunk, pages.bits, pages.groups, pages.unit)
        return [(codes, pages.codes, pages.slot_pairs), (scale, pages.scale, False),
                (zero, pages.zero, False)]
    return [(chunk.astype(pages.dtype), pages, False)]


@functools.partial(jax.jit, static_argnames=("max_dirty", "interpret"), donate_argnums=(3, 4))
def _write(k_chunk, v_chunk, dest, k_pages, v_pages, block_table, *, max_dirty: int,
           interpret: bool):
    chunk, num_heads, head_dim = k_chunk.shape
    num_pages, group_size, page_size, _ = k_pages.shape
    num_groups, max_pages = block_table.shape
    dirty, rows = page_writes(dest, page_size, max_dirty)
    streams = _pool_streams(k_chunk, k_pages) + _pool_streams(v_chunk, v_pages)
    chunks = [c for c, _, _ in streams]
    pools = [a for _, a, _ in streams]
    kernel = functools.partial(_write_kernel, page_size=page_size, group_size=group_size,
                               paired=tuple(p for _, _, p in streams))
    pool_specs = [pl.BlockSpec((num_pages, None, *a.shape[2:]),
                               lambda h, k, nd=a.ndim: (0, h % group_size) + (0,) * (nd - 2))
                  for a in pools]
    chunk_specs = [pl.BlockSpec((chunk, None, *c.shape[2:]),
                                lambda h, k, nd=c.ndim: (0, h) + (0,) * (nd - 2))
                   for c in chunks]
    n = len(streams)
    written = pl.pallas_call(
        kernel,
        grid=(num_heads, max_dirty),
        in_specs=[
            pl.BlockSpec((num_groups, max_pages), lambda h, k: (0, 0)),
            pl.BlockSpec((None, max_dirty), lambda h, k: (h, 0)),
            pl.BlockSpec((None, None, page_size), lambda h, k: (h, k, 0)),
            *chunk_specs, *pool_specs,
        ],
        out_specs=pool_specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pools],
        input_output_aliases={3 + n + i: i for i in range(n)},
        interpret=interpret,
        compiler_params=backend.compiler_params(num_warps=4, num_stages=1),
        name="compress_chunk_into_pages",
    )(block_table, dirty, rows, *chunks, *pools)
    n_k = len(jax.tree.leaves(k_pages))            # arrays of the K pool (1, or 3 quantised)
    return _rebuild(k_pages, written[:n_k]), _rebuild(v_pages, written[n_k:])


def _rebuild(pages, arrays):
    """The pool `pages` with its arrays replaced by `arrays` (as `_pool_streams` listed them)."""
    if isinstance(pages, kv_quant.QuantPages):
        codes, scale, zero = arrays
        return dataclasses.replace(pages, codes=codes, scale=scale, zero=zero)
    return arrays[0]


def _check(k_chunk, v_chunk, dest, k_pages, v_pages, block_table):
    if k_chunk.ndim != 3 or k_chunk.shape != v_chunk.shape:
        raise ValueError(f"k_chunk/v_chunk must both be [T, num_kv_heads, head_dim], got "
                         f"{k_chunk.shape} and {v_chunk.shape}")
    chunk, num_heads, head_dim = k_chunk.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
        raise ValueError(f"k_pages/v_pages must both be [num_pages, G, page_size, {head_dim}], "
                         f"got {k_pages.shape} and {v_pages.shape}")
    group_size = k_pages.shape[1]
    if num_heads % group_size:
        raise ValueError(f"num_kv_heads {num_heads} is not a multiple of G={group_size}")
    num_groups = num_heads // group_size
    if dest.shape != (num_heads, chunk):
        raise ValueError(f"destinations must be [num_kv_heads={num_heads}, T={chunk}], got "
                         f"{dest.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != num_groups:
        raise ValueError(f"block_table must be [groups={num_groups}, max_pages], got "
                         f"{block_table.shape}")
    for name, a in (("destinations", dest), ("block_table", block_table)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")


def write_chunk_into_pages(k_chunk, v_chunk, dest, k_pages, v_pages, block_table, *,
                           max_dirty: int, interpret: bool | None = None):
    """Write chunk rows into the slots `dest` gives (the Pallas kernel).

    Args:
      k_chunk, v_chunk: [T, num_kv_heads, head_dim], RoPE applied, heads in permuted order
        (group g = heads g*G .. g*G + G - 1); T is the padded static chunk size.
      dest: int32 [num_kv_heads, T], each token's slot in its head's pages, -1: not written
        (`chunk_destinations`); no two tokens of a head share a slot.
      k_pages, v_pages: [num_pages, G, page_size, head_dim] (or `kv_quant.QuantPages`);
        donated and updated in place.
      block_table: int32 [groups, max_pages].
      max_dirty: static, at least the distinct pages any head writes
        (`contiguous_dirty_pages`).
    Returns (k_pages, v_pages): only the destination slots changed.
    """
    _check(k_chunk, v_chunk, dest, k_pages, v_pages, block_table)
    return _write(k_chunk, v_chunk, dest, k_pages, v_pages, block_table, max_dirty=max_dirty,
                  interpret=backend.resolve_interpret(interpret))


@jax.jit
def write_chunk_into_pages_reference(k_chunk, v_chunk, dest, k_pages, v_pages, block_table):
    """Pure-jnp scatter of the same writes (out-of-range slots are dropped)."""
    where, (k_rows, v_rows) = plan_destination_writes(
        k_chunk, v_chunk, dest, k_pages.shape[0], k_pages.shape[2], k_pages.shape[1],
        block_table)
    return (kv_quant.write_slots(k_pages, where, k_rows, mode="drop"),
            kv_quant.write_slots(v_pages, where, v_rows, mode="drop"))


def plan_destination_writes(k_chunk, v_chunk, dest, num_pages: int, page_size: int,
                            group_size: int, block_table):
    """The scatter of `dest` without performing it: ((page, head_in_page, offset) int32
    [heads, T], the page `num_pages` (out of range: dropped) for a token not written;
    (k_rows, v_rows) [heads, T, d])."""
    chunk, num_heads, _ = k_chunk.shape
    width = block_table.shape[1]
    heads = jnp.arange(num_heads)
    group = heads // group_size
    slot = jnp.maximum(dest, 0)
    page_index = jnp.clip(slot // page_size, 0, width - 1)
    page = jnp.where(dest >= 0, block_table[group[:, None], page_index], num_pages)
    head_in_page = jnp.broadcast_to((heads % group_size)[:, None], dest.shape)
    rows = (jnp.swapaxes(k_chunk, 0, 1), jnp.swapaxes(v_chunk, 0, 1))
    return ((page.astype(jnp.int32), head_in_page.astype(jnp.int32),
             (slot % page_size).astype(jnp.int32)), rows)


def compress_chunk_into_pages(k_chunk, v_chunk, scores, keep_counts, chunk_len, k_pages, v_pages,
                              block_table, hist_len, *, interpret: bool | None = None):
    """Keep each head's top tokens of one chunk and write them into its group's pages
    (retention ``"chunk"``: `chunk_destinations`, then the kernel).

    Args:
      k_chunk, v_chunk: [T, num_kv_heads, head_dim] (see `write_chunk_into_pages`).
      scores: float32 [num_kv_heads, T] (only the first chunk_len count).
      keep_counts: int32 [groups] (from `kv_layout.chunk_keep_count`); chunk_len: int32 scalar.
      k_pages, v_pages: [num_pages, G, page_size, head_dim]; donated and updated in place.
      block_table: int32 [groups, max_pages]; hist_len: int32 [groups] slots already used.
    Returns the updated (k_pages, v_pages): slots hist_len[g] .. hist_len[g] + count - 1 hold the
    kept tokens in temporal order; no other slot changes.
    """
    _check_counts(scores, keep_counts, hist_len, k_chunk, k_pages)
    dest = chunk_destinations(scores, keep_counts, jnp.asarray(chunk_len, jnp.int32), hist_len,
                              k_pages.shape[1])
    return write_chunk_into_pages(
        k_chunk, v_chunk, dest, k_pages, v_pages, block_table,
        max_dirty=contiguous_dirty_pages(k_chunk.shape[0], k_pages.shape[2]), interpret=interpret)


def compress_chunk_into_pages_reference(k_chunk, v_chunk, scores, keep_counts, chunk_len,
                                        k_pages, v_pages, block_table, hist_len):
    """`compress_chunk_into_pages` through the pure-jnp scatter."""
    _check_counts(scores, keep_counts, hist_len, k_chunk, k_pages)
    dest = chunk_destinations(scores, keep_counts, jnp.asarray(chunk_len, jnp.int32), hist_len,
                              k_pages.shape[1])
    return write_chunk_into_pages_reference(k_chunk, v_chunk, dest, k_pages, v_pages,
                                            block_table)


def _check_counts(scores, keep_counts, hist_len, k_chunk, k_pages):
    chunk, num_heads, _ = k_chunk.shape
    group_size = k_pages.shape[1]
    if k_pages.ndim != 4 or num_heads % group_size:
        raise ValueError(f"k_pages must be [num_pages, G, page_size, head_dim] with G dividing "
                         f"num_kv_heads {num_heads}, got {k_pages.shape}")
    num_groups = num_heads // group_size
    if scores.shape != (num_heads, chunk):
        raise ValueError(f"scores must be [num_kv_heads={num_heads}, T={chunk}], got "
                         f"{scores.shape}")
    if keep_counts.shape != (num_groups,) or hist_len.shape != (num_groups,):
        raise ValueError(f"keep_counts and hist_len must be [groups={num_groups}], got "
                         f"{keep_counts.shape} and {hist_len.shape}")
    for name, a in (("keep_counts", keep_counts), ("hist_len", hist_len)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")


# ----- precision tiers (`kv_layout.TieredLayout`, `kv_quant.TieredPages`) --------------------

def low_tier_scores(scores: jax.Array, keep_high: jax.Array, chunk_len: jax.Array,
                    group_size: int) -> jax.Array:
    """Scores that make `kept_token_sources` pick, per head, the tokens ranked just below its
    group's top ``keep_high[g]`` (the high tier's): those get -inf, the others a finite score
    falling with their rank, so a count k selects ranks ``keep_high .. keep_high + k - 1`` of the
    original scores (the same rank `kept_token_sources` computes, ties to the earlier token).

    scores float32 [num_kv_heads, T]; keep_high int32 [groups]; chunk_len int32 scalar.
    Returns float32 [num_kv_heads, T]."""
    num_heads, chunk = scores.shape
    valid = jnp.arange(chunk) < chunk_len
    masked = jnp.where(valid[None, :], scores.astype(jnp.float32), -jnp.inf)
    rank = jnp.argsort(jnp.argsort(-masked, axis=1, stable=True), axis=1, stable=True)
    high = jnp.repeat(keep_high.astype(jnp.int32), group_size)[:, None]
    return jnp.where(rank < high, -jnp.inf, (chunk - rank).astype(jnp.float32))


def compress_chunk_into_tiers(compress, k_chunk, v_chunk, scores, keep_counts, chunk_len,
                              k_pages, v_pages, block_table, hist_len):
    """`compress_chunk_into_pages` for a tiered pool: of each head's kept tokens the top
    ``keep_counts[2 g]`` by score go to the high tier, the next ``keep_counts[2 g + 1]`` to the
    low tier (`kv_layout.TieredLayout.chunk_keep_counts`), each into its tier group's pages.

    compress: `compress_chunk_into_pages` or its reference (one format per call). keep_counts,
    hist_len int32 [2 * groups] and block_table int32 [2 * groups, max_pages] of tier groups;
    k_pages, v_pages `kv_quant.TieredPages`. Returns the updated (k_pages, v_pages)."""
    group_size = k_pages.shape[1]
    keep_high = keep_counts[0::2]
    k_high, v_high = compress(k_chunk, v_chunk, scores, keep_high, chunk_len, k_pages.high,
                              v_pages.high, block_table[0::2], hist_len[0::2])
    k_low, v_low = compress(k_chunk, v_chunk,
                            low_tier_scores(scores, keep_high, chunk_len, group_size),
                            keep_counts[1::2], chunk_len, k_pages.low, v_pages.low,
                            block_table[1::2], hist_len[1::2])
    return kv_quant.TieredPages(k_high, k_low), kv_quant.TieredPages(v_high, v_low)
