"""Hetero-precision KV pages (LeanKV): quantised K and V with a per token-and-head scale and zero.

A KV precision names how many bits keys and values keep (keys matter more than values: LeanKV
kept full accuracy with K8V4 where K4V8 did not)::

    bf16   keys and values in the pool dtype, as before (plain arrays)
    k8v8   8-bit keys, 8-bit values
    k8v4   8-bit keys, 4-bit values
    k4v2   4-bit keys, 2-bit values

Code format (one format for every bit width, so one dequantisation path): each row x of
`head_dim` values (one token of one KV head) is quantised asymmetrically to ``L = 2**bits - 1``
levels::

    zero  = min(x)            scale = (max(x) - min(x)) / L        (float32, one each per row)
    code  = clip(round((x - zero) / scale), 0, L)                   (uint, `bits` bits)
    x_hat = code * scale + zero

Error bound per element (what the tests check): ``|x - x_hat| <= scale / 2 + 4 * eps32 *
max|x|``, i.e. ``(max(x) - min(x)) / (2 L)`` up to float32 rounding: 1/510 of the row's range at
8 bits, 1/30 at 4 bits, 1/6 at 2 bits. A constant row (scale 0) is exact. The zero point costs
4 bytes and halves the error against a symmetric code of the same bits for rows whose values are
not centred on 0 (keys after RoPE rarely are).

Packing (plane layout): codes are packed in units of ``unit`` bits (a byte, or a uint16: the page
format's `code_unit`), ``n = unit // bits`` codes a unit; unit i of a row holds the codes of
dimensions ``i, i + d/n, ..., i + (n-1) d/n`` at bit offsets ``0, bits, ..., (n-1) bits``. Plane
p (``(unit >> p*bits) & L``) is then the contiguous slice ``[p d/n, (p+1) d/n)`` of the head,
so a kernel unpacks with shifts and masks and multiplies plane by plane against the matching
slice of q (or writes the matching slice of the output): no interleaving shuffles. The unit is a
speed choice of the decode kernel, measured per format on an H100: Triton lays out a product
whose operand comes from 8-bit loads with 4 consecutive k a thread for both operands, which
costs the 16-bit operand (q, the softmax weights) register
copies and a shared-memory round trip; from 16-bit units the products keep their native layout
(K8V8 -7 to -10%, K8V4 -5% on an H100), but twice the planes, each half as wide: K4V2's values
in 16-bit units are 8 planes of 16 dims, far slower.

Slot pairs (K4V2, `PageFormat.slot_pairs`): rows are packed in bytes as above, and the bytes
of two adjacent slots of a page share a uint16: unit (i, j) holds byte j of slot 2i in its low
half and byte j of slot 2i + 1 in its high half (`pair_slots`). A kernel's 16-bit loads then
unpack into an even-slot and an odd-slot plane of full width (K4 2 planes of d/2, V2 4 of d/4),
so the products keep 16-bit operand layouts without K4V2's planes narrowing: on an H100 with the
value zeros loaded a block ahead, -18% of K4V2's decode time at 64 x 32k. Pages need an even
page_size.

Value groups (K8V4's values): a row may be quantised as ``groups`` equal slices of head_dim,
each with its own scale and zero (KIVI-style group quantisation); with the plane layout below
at ``groups = 8 // bits`` a group is exactly a plane, so kernels weigh each plane's product by
its own scale. Scale and zero then carry a trailing ``[groups]`` axis. K8V4 stores its 4-bit
values in 2 groups: one scale over the whole head lost 2-3 points of variable tracking
against bf16 on the embedded model (400 samples a task, variable tracking:
benchmarks/results/accuracy_kv_precision_vt_formats.json), K8V8 none.

Pages (`kv_layout`): a quantised pool is a `QuantPages` (a pytree) with ``codes uint8 or uint16
[num_pages, G, page_size, head_dim * bits / unit]`` (slot pairs: ``uint16 [num_pages, G,
page_size / 2, head_dim * bits / 8]``), ``scale, zero float32 [num_pages, G, page_size]``
(`scale_shape`: ``[..., groups]`` with value groups); its `shape` is the logical
``[num_pages, G, page_size, head_dim]`` and its `dtype` the dtype values come back in, so code
that only reads shapes treats both kinds of pool alike.
Within a precision every page has the same bytes (one pool serves every layer and group).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax.kv_layout import PRECISION_TIERS

KV_PRECISIONS = ("bf16", "k8v8", "k8v4", "k4v2")
QUANT_BITS = (8, 4, 2)
_EPS32 = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class PageFormat:
    """Bits of keys and values in the pool (None: stored unquantised in the pool dtype)."""

    name: str
    key_bits: int | None
    value_bits: int | None
    value_groups: int = 1     # scale / zero groups of a value row (module docstring)
    code_unit: int = 8        # bits of the unit codes are packed in, 8 or 16 (module docstring)
    slot_pairs: bool = False  # byte rows of two adjacent slots in one uint16 (module docstring)

    @property
    def quantised(self) -> bool:
        return self.key_bits is not None


PAGE_FORMATS = {
    "bf16": PageFormat("bf16", None, None),
    "k8v8": PageFormat("k8v8", 8, 8, code_unit=16),
    "k8v4": PageFormat("k8v4", 8, 4, value_groups=2, code_unit=16),
    "k4v2": PageFormat("k4v2", 4, 2, slot_pairs=True),
}


def page_format(precision: str) -> PageFormat:
    """The `PageFormat` of a `KV_PRECISIONS` name."""
    if precision not in PAGE_FORMATS:
        raise ValueError(f"kv_precision must be one of {KV_PRECISIONS}, got {precision!r}")
    return PAGE_FORMATS[precision]


# What a pool may store: one page format, or precision tiers (`kv_layout.PRECISION_TIERS`).
SERVED_PRECISIONS = KV_PRECISIONS + tuple(PRECISION_TIERS)


@dataclasses.dataclass(frozen=True)
class PoolFormat:
    """What the KV pool stores, resolved once from `EngineConfig.kv_precision`
    (`EngineConfig.resolve`) and read by the runner, the split map and the pool sizing.

    precision: the served name (`SERVED_PRECISIONS`), also the key of its decode tuning and
    program target (`pallas_kernels.tuning`); page_formats: the page format of each of its
    pools: one, or (high, low) for precision tiers."""

    precision: str
    page_formats: tuple[PageFormat, ...]

    @property
    def tiered(self) -> bool:
        return len(self.page_formats) > 1

    def page_bytes(self, group_size: int, page_size: int, head_dim: int,
                   dtype) -> tuple[int, ...]:
        """Bytes of one page (K and V) of each of its pools."""
        return tuple(page_bytes(f, group_size, page_size, head_dim, dtype)
                     for f in self.page_formats)


def pool_format(precision: str) -> PoolFormat:
    """The `PoolFormat` of a `SERVED_PRECISIONS` name (ValueError for another name)."""
    if precision not in SERVED_PRECISIONS:
        raise ValueError(f"kv_precision must be one of {', '.join(SERVED_PRECISIONS)}, got "
                         f"{precision!r}")
    return PoolFormat(precision, tuple(page_format(name) for name in
                                       PRECISION_TIERS.get(precision, (precision,))))


def _check_bits(bits) -> int:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits!r}")
    return int(bits)


CODE_UNITS = {8: jnp.uint8, 16: jnp.uint16}


def _check_unit(unit) -> int:
    if unit not in CODE_UNITS:
        raise ValueError(f"unit must be one of {tuple(CODE_UNITS)} (bits of a code unit), got "
                         f"{unit!r}")
    return int(unit)


def codes_per_unit(bits: int, unit: int = 8) -> int:
    return _check_unit(unit) // _check_bits(bits)


def unit_of(codes_dtype, slot_pairs: bool = False) -> int:
    """Bits of the unit a row's codes are packed in (8 or 16) for codes of `codes_dtype`: the
    dtype's bits, or 8 with `slot_pairs` (whose uint16 hold a byte of each of two rows)."""
    return 8 if slot_pairs else _check_unit(jnp.dtype(codes_dtype).itemsize * 8)


def packed_dim(head_dim: int, bits: int, unit: int = 8) -> int:
    """Code units (of `unit` bits) of one packed row of `head_dim` values (head_dim must split
    into whole units)."""
    n = codes_per_unit(bits, unit)
    if head_dim % n:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {n} (codes per {unit}-bit "
                         f"unit at {bits} bits)")
    return head_dim // n


def _check_groups(groups, head_dim: int) -> int:
    if int(groups) != groups or groups < 1 or head_dim % groups:
        raise ValueError(f"groups must be a positive divisor of head_dim {head_dim}, got "
                         f"{groups!r}")
    return int(groups)


def scale_shape(rows: tuple, groups: int) -> tuple:
    """Shape of the scale (and zero) of rows of shape `rows` (a row's leading axes) quantised
    in `groups` groups: `rows`, with a trailing ``[groups]`` axis only when groups > 1 (so
    pools without value groups keep their shapes)."""
    return tuple(rows) + ((groups,) if groups > 1 else ())


def _grouped(x: jax.Array, groups: int) -> jax.Array:
    """[..., d] -> [..., groups, d / groups]."""
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def quantise(x: jax.Array, bits: int, groups: int = 1,
             unit: int = 8) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantise rows of the last axis, each in `groups` equal slices with their own scale and
    zero.

    x: float [..., d]. Returns (codes [..., d * bits / unit] in `unit`-bit units, uint8 or
    uint16 (plane layout), scale float32 [...], zero float32 [...]; scale and zero [...,
    groups] when groups > 1).
    """
    bits = _check_bits(bits)
    levels = (1 << bits) - 1
    n = codes_per_unit(bits, unit)
    d = x.shape[-1]
    packed_dim(d, bits, unit)
    groups = _check_groups(groups, d)
    x = _grouped(x.astype(jnp.float32), groups)                        # [..., groups, d/g]
    lo = x.min(axis=-1)
    hi = x.max(axis=-1)
    scale = (hi - lo) / levels
    safe = jnp.where(scale > 0, scale, 1.0)
    unit_dtype = CODE_UNITS[unit]
    codes = jnp.clip(jnp.round((x - lo[..., None]) / safe[..., None]), 0, levels).astype(unit_dtype)
    codes = codes.reshape(*codes.shape[:-2], d)
    if groups == 1:
        scale, lo = scale[..., 0], lo[..., 0]
    planes = codes.reshape(*codes.shape[:-1], n, d // n)              # [..., plane, d/n]
    shifts = (jnp.arange(n, dtype=unit_dtype) * bits)[:, None]
    # The planes' bits do not overlap, so their sum is their bitwise or.
    packed = (planes << shifts).sum(axis=-2, dtype=unit_dtype)
    return packed.astype(unit_dtype), scale, lo


def unpack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes [..., d * bits / unit] (uint8 or uint16 units) -> the integer codes [..., d] (in
    the units' dtype, plane layout undone)."""
    n = codes_per_unit(bits, unit_of(codes.dtype))
    if n == 1:
        return codes
    shifts = (jnp.arange(n, dtype=codes.dtype) * bits)[:, None]
    planes = (codes[..., None, :] >> shifts) & codes.dtype.type((1 << bits) - 1)  # [..., n, d/n]
    return planes.reshape(*codes.shape[:-1], n * codes.shape[-1])


def pair_slots(codes: jax.Array) -> jax.Array:
    """Byte rows [..., page_size, w] uint8 -> slot pairs [..., page_size / 2, w] uint16: unit
    (i, j) holds byte j of slot 2i (low half) and of slot 2i + 1 (high half)."""
    if codes.dtype != jnp.uint8 or codes.shape[-2] % 2:
        raise ValueError(f"slot pairs take uint8 rows of an even slot count, got {codes.dtype} "
                         f"{codes.shape}")
    even, odd = codes[..., 0::2, :], codes[..., 1::2, :]
    return even.astype(jnp.uint16) | (odd.astype(jnp.uint16) << 8)


def unpair_slots(units: jax.Array) -> jax.Array:
    """`pair_slots` undone: [..., page_size / 2, w] uint16 -> [..., page_size, w] uint8."""
    halves = jnp.stack([units & 0xFF, units >> 8], axis=-2).astype(jnp.uint8)
    return halves.reshape(*units.shape[:-2], 2 * units.shape[-2], units.shape[-1])


def dequantise(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int,
               dtype=jnp.float32) -> jax.Array:
    """codes [..., d*bits/unit] (uint8 or uint16), scale/zero [...] (or [..., groups]: one more
    axis than the codes' leading ones) -> values [..., d] in `dtype` (computed in float32)."""
    values = unpack(codes, bits).astype(jnp.float32)
    if scale.ndim == codes.ndim:                                        # value groups
        grouped = _grouped(values, scale.shape[-1]) * scale[..., None] + zero[..., None]
        return grouped.reshape(values.shape).astype(dtype)
    return (values * scale[..., None] + zero[..., None]).astype(dtype)


def error_bound(x: jax.Array, bits: int, groups: int = 1) -> jax.Array:
    """Largest |x - dequantise(quantise(x, bits, groups))| the format allows per row of x
    [..., d] -> [...] (the module docstring's bound; with groups the largest group's)."""
    levels = (1 << _check_bits(bits)) - 1
    x = _grouped(jnp.asarray(x, jnp.float32), _check_groups(groups, x.shape[-1]))
    spread = x.max(axis=-1) - x.min(axis=-1)
    return (spread / (2 * levels) + 4 * _EPS32 * jnp.abs(x).max(axis=-1)).max(axis=-1)


# ----- pages ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QuantPages:
    """A quantised K (or V) pool: codes [num_pages, G, page_size, head_dim*bits/unit] in
    `unit`-bit units (uint8 or uint16, the page format's `code_unit`; with `slot_pairs`
    uint16 [num_pages, G, page_size / 2, head_dim*bits/8], `pair_slots`),
    scale and zero float32 [num_pages, G, page_size] (with `groups` > 1: [..., groups], a
    scale and zero per group of head_dim / groups dims, the plane of that index when groups
    equals the planes). A pytree (jit, donation and scan carry it like an array); `bits`,
    `dtype` (what dequantised values come back as) and `groups` are static, as is
    `page_format`: the `PAGE_FORMATS` name of the pool this is half of, where it was made from
    one (`allocate_pools`; the decode kernel's tuning key), else None."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int
    dtype: np.dtype
    groups: int = 1
    slot_pairs: bool = False
    page_format: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``[num_pages, G, page_size, head_dim]``."""
        *lead, rows, width = self.codes.shape
        return (*lead, rows * (2 if self.slot_pairs else 1), width * (self.unit // self.bits))

    @property
    def unit(self) -> int:
        """Bits of the unit a row's codes are packed in (`unit_of`)."""
        return unit_of(self.codes.dtype, self.slot_pairs)

    def row_codes(self, codes: jax.Array) -> jax.Array:
        """`codes` (whole pages of this pool's) as one packed row a slot: [..., page_size,
        head_dim * bits / unit] (slot pairs undone)."""
        return unpair_slots(codes) if self.slot_pairs else codes

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.codes, self.scale, self.zero))


jax.tree_util.register_dataclass(QuantPages, data_fields=["codes", "scale", "zero"],
                                 meta_fields=["bits", "dtype", "groups", "slot_pairs",
                                              "page_format"])

Pages = jax.Array | QuantPages


def _check_pairs(slot_pairs: bool, unit: int, page_size: int) -> bool:
    if slot_pairs and (unit != 8 or page_size % 2):
        raise ValueError(f"slot pairs pack byte rows (unit 8) of an even page_size, got unit "
                         f"{unit} and page_size {page_size}")
    return bool(slot_pairs)


def pool_arrays(shape, dtype, bits: int | None, *, make=jnp.zeros, groups: int = 1,
                unit: int = 8, slot_pairs: bool = False, page_format: str | None = None) -> Pages:
    """A K or V pool of logical shape [num_pages, G, page_size, head_dim]: an array of `dtype`
    (bits None) or `QuantPages` (with `groups` scales a row, codes in `unit`-bit units, in
    `slot_pairs` when set, tagged with `page_format`). `make(shape, dtype)` builds each leaf:
    `jnp.zeros` (a zeroed pool) or `jax.ShapeDtypeStruct` (a spec to compile against)."""
    shape = tuple(int(s) for s in shape)
    if bits is None:
        return make(shape, dtype)
    groups = _check_groups(groups, shape[-1])
    scales = scale_shape(shape[:-1], groups)
    width = packed_dim(shape[-1], bits, unit)
    if _check_pairs(slot_pairs, unit, shape[-2]):
        codes = make((*shape[:-2], shape[-2] // 2, width), jnp.uint16)
    else:
        codes = make((*shape[:-1], width), CODE_UNITS[unit])
    return QuantPages(codes=codes, scale=make(scales, jnp.float32),
                      zero=make(scales, jnp.float32), bits=_check_bits(bits),
                      dtype=jnp.dtype(dtype), groups=groups, slot_pairs=bool(slot_pairs),
                      page_format=page_format)


def allocate_pools(formats, num_pages, page_shape, dtype, *, make=jnp.zeros) -> tuple:
    """(k_pages, v_pages) of a pool: of one page format (`formats` and `num_pages` of length
    1: `Pages`), or of precision tiers (a high and a low format and page count: `TieredPages`).
    page_shape: ``(G, page_size, head_dim)``; `make` as for `pool_arrays`."""
    if len(formats) != len(num_pages) or len(formats) not in (1, 2):
        raise ValueError(f"one page count per format (1 or 2 of them), got {len(formats)} "
                         f"formats and num_pages {tuple(num_pages)}")
    pools = [(pool_arrays((n, *page_shape), dtype, fmt.key_bits, make=make,
                          unit=fmt.code_unit, slot_pairs=fmt.slot_pairs, page_format=fmt.name),
              pool_arrays((n, *page_shape), dtype, fmt.value_bits, make=make,
                          groups=fmt.value_groups, unit=fmt.code_unit,
                          slot_pairs=fmt.slot_pairs, page_format=fmt.name))
             for n, fmt in zip(num_pages, formats)]
    return from_tier_pools(pools)


def page_bytes(fmt: PageFormat, group_size: int, page_size: int, head_dim: int, dtype) -> int:
    """Bytes of one page (K and V together) of this format."""
    slots = group_size * page_size
    total = 0
    for bits, groups in ((fmt.key_bits, 1), (fmt.value_bits, fmt.value_groups)):
        if bits is None:
            total += slots * head_dim * jnp.dtype(dtype).itemsize
        else:   # codes + a float32 scale and zero per group
            total += slots * (packed_dim(head_dim, bits) + 8 * groups)
    return total


def value_dtype(pages: Pages):
    """The dtype a pool's values are computed in (its own dtype, or what `QuantPages`
    dequantises to)."""
    return pages.dtype


def write_slots(pages: Pages, index: tuple, values: jax.Array, *, mode=None) -> Pages:
    """Set the slots `pages[index]` (an index of the first three axes: page, head, slot) to
    `values` [..., head_dim], quantising them for `QuantPages`; `mode` as for ``.at[].set``
    (``"drop"``: out-of-range indices are skipped)."""
    # The values are computed before the scatter, not inside it: XLA's GPU fusion otherwise
    # pulls a per-head norm (Qwen3's and Gemma-3's k_norm) into the scatter, which then
    # redoes the reduction per written element (6.5 of a 15.9 ms Gemma-3-12B decode step at
    # batch 1, 0.2 ms for Llama: `results/families_gemma3_12b_gpu.json`).
    values = jax.lax.optimization_barrier(values)
    if isinstance(pages, QuantPages):
        codes, scale, zero = quantise(values, pages.bits, pages.groups, pages.unit)
        if pages.slot_pairs:
            codes = _paired_codes(pages.codes, index, codes, mode)
        else:
            codes = pages.codes.at[index].set(codes, mode=mode)
        return dataclasses.replace(pages, codes=codes,
                                   scale=pages.scale.at[index].set(scale, mode=mode),
                                   zero=pages.zero.at[index].set(zero, mode=mode))
    return pages.at[index].set(values.astype(pages.dtype), mode=mode)


def _paired_codes(units: jax.Array, index: tuple, rows: jax.Array, mode) -> jax.Array:
    """Slot-pair `units` with the byte rows `rows` [..., w] (uint8) written at slots `index`
    (page, head, slot). Each write adds to its unit the difference between its new and old
    byte in that slot's half (uint16 arithmetic wraps, and the other half is untouched), so
    two slots of one pair written in one call both land; a slot written twice in one call
    (the null page of padded rows) is left with a meaningless byte, never read."""
    page, head, slot = (jnp.asarray(i) for i in index)
    unit_index = (page, head, slot // 2)
    shift = ((slot % 2) * 8).astype(jnp.uint16)[..., None]
    old = (units[unit_index] >> shift) & 0xFF
    return units.at[unit_index].add((rows.astype(jnp.uint16) - old) << shift, mode=mode)


def take_pages(pages: Pages, page_ids: jax.Array, dtype=None) -> jax.Array:
    """Dense values of the pages `page_ids` (int array [...]) -> [..., G, page_size, head_dim]
    in `dtype` (default the pool's value dtype); quantised pages are dequantised."""
    dtype = dtype or pages.dtype
    if isinstance(pages, QuantPages):
        return dequantise(pages.row_codes(pages.codes[page_ids]), pages.scale[page_ids],
                          pages.zero[page_ids], pages.bits, dtype)
    return pages[page_ids].astype(dtype)


def dequantise_pages(pages: Pages, dtype=None) -> jax.Array:
    """The whole pool as dense values [num_pages, G, page_size, head_dim]."""
    return take_pages(pages, jnp.arange(pages.shape[0]), dtype)


def quantise_pages(pages: jax.Array, bits: int | None, dtype=None, groups: int = 1,
                   unit: int = 8, slot_pairs: bool = False,
                   page_format: str | None = None) -> Pages:
    """A dense pool [num_pages, G, page_size, head_dim] in the format of `bits` (None: the
    pool itself, cast to `dtype`) with `groups` scales a row and codes in `unit`-bit units (in
    `slot_pairs` when set), tagged with `page_format` (`QuantPages`). Rows holding a NaN get NaN scale and zero (codes cannot be NaN), so
    a poisoned slot stays poisoned (what the kernel tests rely on)."""
    dtype = jnp.dtype(dtype or pages.dtype)
    if bits is None:
        return pages.astype(dtype)
    x = jnp.asarray(pages, jnp.float32)
    poisoned = jnp.isnan(x).any(axis=-1)
    codes, scale, zero = quantise(jnp.nan_to_num(x), bits, groups, unit)
    if _check_pairs(slot_pairs, unit, x.shape[-2]):
        codes = pair_slots(codes)
    if scale.ndim > poisoned.ndim:
        poisoned = poisoned[..., None]
    return QuantPages(codes=codes, scale=jnp.where(poisoned, jnp.nan, scale),
                      zero=jnp.where(poisoned, jnp.nan, zero), bits=_check_bits(bits),
                      dtype=dtype, groups=int(groups), slot_pairs=bool(slot_pairs),
                      page_format=page_format)


# ----- precision tiers (`kv_layout.TieredLayout`) ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class TieredPages:
    """The K (or V) pool of a tiered precision: two pools of logical shapes [high_pages, G,
    page_size, head_dim] and [low_pages, G, page_size, head_dim], `high` in the high tier's
    format and `low` in the low tier's (`kv_layout.PRECISION_TIERS`). Each has its own page
    ids (page 0 its null page; the KV-cache manager keeps a pool of ids per tier, sized by the
    tier's share of the retained tokens): a high tier group's block-table entries index `high`,
    a low tier group's `low`. A pytree, like `QuantPages`; `shape` and `dtype` are the high
    pool's (code that reads G, page_size and head_dim from it sees both tiers' values)."""

    high: Pages
    low: Pages

    @property
    def shape(self) -> tuple[int, ...]:
        return self.high.shape

    @property
    def dtype(self):
        return self.high.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.high.nbytes) + int(self.low.nbytes)


jax.tree_util.register_dataclass(TieredPages, data_fields=["high", "low"], meta_fields=[])


def is_tiered(k_pages, v_pages) -> bool:
    """Whether a K and a V pool are precision tiers (`TieredPages`); a mixed pair is a TypeError
    naming both types."""
    if isinstance(k_pages, TieredPages) != isinstance(v_pages, TieredPages):
        raise TypeError(f"k_pages and v_pages must both be TieredPages or neither, got "
                        f"{type(k_pages).__name__} and {type(v_pages).__name__}")
    return isinstance(k_pages, TieredPages)


def tier_pools(k_pages, v_pages) -> list[tuple]:
    """[(k, v)] of each tier's pool, high first: one pair, or the two of `TieredPages`."""
    if is_tiered(k_pages, v_pages):
        return [(k_pages.high, v_pages.high), (k_pages.low, v_pages.low)]
    return [(k_pages, v_pages)]


def from_tier_pools(pools: list[tuple]) -> tuple:
    """(k_pages, v_pages) of `tier_pools`' pairs: the one pair, or `TieredPages` of two."""
    if len(pools) == 1:
        return pools[0]
    (k_high, v_high), (k_low, v_low) = pools
    return TieredPages(k_high, k_low), TieredPages(v_high, v_low)


def tiered_dense_history(k_pages: TieredPages, v_pages: TieredPages, block_tables: jax.Array,
                         lengths: jax.Array, dtype) -> tuple:
    """Both tiers of every group as one dense history: what attention over a tiered pool reads
    where the kernel takes one page format (the prefill kernel, the CPU serving path, the
    references).

    block_tables int [..., 2 * groups, W] and lengths int [..., 2 * groups] of tier groups
    (``2 g`` high, ``2 g + 1`` low, `kv_layout.TieredLayout`). Group g's history becomes its
    high tier's tokens followed by its low tier's (attention does not depend on the order of
    its keys: positions are in them already). Returns (k, v dense [n * 2 W, G, page_size,
    head_dim] in `dtype`, n = the product of the leading axes and groups; tables int32
    [..., groups, 2 W] onto them; lengths int32 [..., groups], high + low).
    """
    tables_hi, tables_lo = block_tables[..., 0::2, :], block_tables[..., 1::2, :]
    len_hi, len_lo = lengths[..., 0::2], lengths[..., 1::2]
    *lead, groups, width = tables_hi.shape
    _, group_size, page_size, head_dim = k_pages.shape
    span = width * page_size
    slot = jnp.arange(2 * span)
    # Token t of the merged history: the high tier's t, or the low tier's t - len_hi.
    source = jnp.clip(jnp.where(slot < len_hi[..., None], slot, span + slot - len_hi[..., None]),
                      0, 2 * span - 1)                                   # [..., groups, 2 span]

    def merged(pages: TieredPages) -> jax.Array:
        parts = [take_pages(p, jnp.clip(t, 0, p.shape[0] - 1), dtype)  # [.., groups, W, G, ps, d]
                 for p, t in ((pages.high, tables_hi), (pages.low, tables_lo))]
        x = jnp.moveaxis(jnp.concatenate(parts, axis=-4), -3, -4)   # [..., groups, G, 2W, ps, d]
        x = x.reshape(*x.shape[:-3], 2 * span, head_dim)
        x = jnp.take_along_axis(x, source[..., None, :, None], axis=-2)
        x = x.reshape(*x.shape[:-2], 2 * width, page_size, head_dim)
        return jnp.moveaxis(x, -4, -3).reshape(-1, group_size, page_size, head_dim)

    pages_per_group = 2 * width
    count = int(np.prod(lead, dtype=np.int64)) * groups * pages_per_group
    tables = jnp.arange(count, dtype=jnp.int32).reshape(*lead, groups, pages_per_group)
    return merged(k_pages), merged(v_pages), tables, (len_hi + len_lo).astype(jnp.int32)
