"""The pools a decode launch reads (`decode_attention.py`), around its kernel body: a pool's
kernel inputs and page format, the format's tuning and program target (`decode_tuning`,
`decode_programs`), the checks of a call's pools, block tables, lengths and work lists, and the
program of a launch over several pools (precision tiers in one launch) that runs the kernel
body of its item's pool (`_parts_kernel`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tangram_jax import kv_quant
from tangram_jax.pallas_kernels.tuning import DECODE_PROGRAM_SCALE, DECODE_TUNING


def _page_inputs(pages) -> tuple:
    """The arrays a pool passes to the kernel: (pages,) or (codes, scale, zero)."""
    if isinstance(pages, kv_quant.QuantPages):
        return pages.codes, pages.scale, pages.zero
    return (pages,)


def _bits(pages) -> int | None:
    return pages.bits if isinstance(pages, kv_quant.QuantPages) else None


def _slot_pairs(k_pages, v_pages) -> bool:
    """Whether a pool's codes are slot pairs (`kv_quant.PageFormat.slot_pairs`): K and V
    alike, as a page format has them."""
    pairs = [isinstance(p, kv_quant.QuantPages) and p.slot_pairs for p in (k_pages, v_pages)]
    if pairs[0] != pairs[1]:
        raise ValueError(f"k_pages and v_pages must both or neither be slot pairs, got "
                         f"{pairs[0]} and {pairs[1]}")
    return pairs[0]


def decode_programs(kv_precision: str, num_programs: int) -> int:
    """The program target of `kv_precision`'s decode split maps: `num_programs` (the engine's
    setting) times the format's `DECODE_PROGRAM_SCALE` (1 for precision tiers)."""
    return num_programs * DECODE_PROGRAM_SCALE.get(kv_precision, 1)


def _format_name(k_pages, v_pages) -> str:
    """The page format of a pool ("bf16" unquantised, else the name its `QuantPages` carry), or
    "high-low" of precision tiers."""
    if kv_quant.is_tiered(k_pages, v_pages):
        return "-".join(_format_name(k, v) for k, v in kv_quant.tier_pools(k_pages, v_pages))
    quantised = [isinstance(p, kv_quant.QuantPages) for p in (k_pages, v_pages)]
    if not any(quantised):
        return "bf16"
    names = {p.page_format if q else None for p, q in zip((k_pages, v_pages), quantised)}
    if len(names) != 1 or None in names:
        raise ValueError(
            f"a quantised pool without block_tokens and num_warps must be made from its page "
            f"format (kv_quant.allocate_pools, or page_format= of pool_arrays / "
            f"quantise_pages) so its tuning can be found; got k_pages and v_pages of page "
            f"formats {[getattr(p, 'page_format', 'bf16') for p in (k_pages, v_pages)]}")
    return names.pop()


def decode_tuning(k_pages, v_pages) -> tuple:
    """(block_tokens, num_warps) of `DECODE_TUNING` for a pool's page format; of precision
    tiers in one launch ((high, low) block tokens, num_warps)."""
    return DECODE_TUNING[_format_name(k_pages, v_pages)]


def _work_lists(work_list, tiers: int) -> tuple:
    """`work_list` as one int32 list per pool (a numpy list becomes a constant of the
    trace): the list itself, or with precision tiers the (high, low) pair."""
    lists = (work_list,) if tiers == 1 else work_list
    if tiers > 1 and (not isinstance(work_list, (tuple, list)) or len(work_list) != tiers):
        raise ValueError(f"with precision tiers work_list must be a (high, low) pair of work "
                         f"lists, got {type(work_list).__name__}")
    return tuple(jnp.asarray(w, dtype=jnp.int32) if isinstance(w, np.ndarray) else w
                 for w in lists)


def _check_inputs(q, tier_pools, block_tables, lengths, works):
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, groups, G*q_per_kv, head_dim], got {q.shape}")
    for k, v in tier_pools:
        if k.ndim != 4 or k.shape[1:] != v.shape[1:] or k.shape[0] != v.shape[0] or \
                k.shape[1:] != tier_pools[0][0].shape[1:]:
            raise ValueError(f"k_pages/v_pages (each tier's) must be [num_pages, G, page_size, "
                             f"head_dim] of one G, page_size and head_dim, got {k.shape} and "
                             f"{v.shape}")
    batch, num_groups, q_rows, head_dim = q.shape
    _, group_size, _, kv_dim = tier_pools[0][0].shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and pages ({kv_dim}) differ")
    if q_rows % group_size:
        raise ValueError(f"q has {q_rows} heads per group, not a multiple of G={group_size}")
    table_groups = len(tier_pools) * num_groups     # tier groups with tiers
    if block_tables.ndim != 3 or block_tables.shape[:2] != (batch, table_groups):
        raise ValueError(f"block_tables must be [batch={batch}, groups x tiers={table_groups}, "
                         f"max_pages], got {block_tables.shape}")
    if lengths.shape != (batch, table_groups):
        raise ValueError(f"lengths must be [batch={batch}, groups x tiers={table_groups}], got "
                         f"{lengths.shape}")
    for name, a in (("block_tables", block_tables), ("lengths", lengths),
                    *(("work_list", w) for w in works)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    for work in works:
        if work.shape[-1] != 3 or work.ndim not in (2, 3) or (work.ndim == 3 and
                                                              work.shape[0] != batch):
            raise ValueError(f"work_list must be [items, 3] or [batch={batch}, items, 3], got "
                             f"{work.shape}")


def _parts_kernel(work_ref, lengths_ref, block_tables_ref, q_ref, *refs, parts: tuple,
                  windowed: bool):
    """One program of a launch over several pools (`decode_partials` with precision tiers in
    one launch): parts[p] = (first item, end item, page refs, kernel) in item order; the
    program runs the part its item falls in (`_decode_kernel` over that part's page refs; the
    work list is the parts' lists one after another, so the kernel reads its own row).
    One part: its kernel, with no branch. `windowed`: the last input is the starts ref
    (`_decode_kernel`)."""
    o_ref, lse_ref = refs[-2:]
    starts = dict(starts_ref=refs[-3]) if windowed else {}
    # Read here, not in a branch: the interpreter substitutes program ids at the top level only.
    item = pl.program_id(1)
    if len(parts) == 1:
        _, _, n, kernel = parts[0]
        kernel(work_ref, lengths_ref, block_tables_ref, q_ref, *refs[:n], o_ref, lse_ref,
               item=item, **starts)
        return
    offset = 0
    for first, end, n, kernel in parts:
        page_refs = refs[offset:offset + n]
        offset += n

        @pl.when((item >= first) & (item < end))
        def _(kernel=kernel, page_refs=page_refs):
            kernel(work_ref, lengths_ref, block_tables_ref, q_ref, *page_refs, o_ref, lse_ref,
                   item=item, **starts)
