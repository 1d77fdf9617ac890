"""Model runner: the jitted prefill-chunk and decode steps over the paged KV pool.

The runner owns the device state: the model's parameters (KV heads permuted at load time so that
every head group is a contiguous slice) and the one page pool shared by every layer and group::

    k_pages, v_pages: [num_pages, G, page_size, head_dim]

It knows nothing of requests: the engine hands it token ids, positions, block tables and lengths
(numpy, from the `KVCacheManager`) and gets device arrays back. Static arguments (chunk size,
batch bucket, split map) are the only things a step is compiled for; nothing is planned at run
time in ``tangram`` mode.

Where attention comes from: on a GPU the Pallas kernels of `tangram_jax.pallas_kernels`, on a CPU
the XLA serving path of `engine/xla_attention.py` (same signatures, reading only the pages the
rows hold); there a step that decodes some sequences while others prefill runs as one program
(`prefill(..., decode=...)`, `mixes_steps`). `AttentionOps.for_backend` makes that choice.

Modes (one runner, other configurations):
- ``tangram`` / ``full``: every (layer, group) keeps ``layout.chunk_keep_counts(n, p)`` tokens of
  a chunk of n tokens whose last p are the turn's protected tail (``full`` is the monolithic
  layout with budget 1: everything is kept).
- ``dynamic``: monolithic pages; the per-input Ada-SnapKV selection (one top-k over the layer's
  heads, with a per-head safeguard) decides on device how many of the unprotected tokens the
  layer keeps (the protected ones are kept on top); the counts come back to the host, which then
  reclaims the pages above them.
Scores and counts of a chunk come from `tangram_jax.compression.chunk_scoring`, one sequence's
chunk at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from tangram_jax.compression.chunk_scoring import (check_scoring_rule, check_served_method,
                                                   chunk_scores, dynamic_keep_count,
                                                   turn_scores)
from tangram_jax.engine.config import MODES
from tangram_jax import kv_quant
from tangram_jax.engine.xla_attention import apply_chunk_writes
from tangram_jax.kv_layout import PRECISION_TIERS, KVLayout, TieredLayout, check_local_layers
from tangram_jax.pallas_kernels.chunk_compress import (chunk_destinations,
                                                       compress_chunk_into_tiers,
                                                       contiguous_dirty_pages)
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder
from tangram_jax.models.head_permutation import permute_kv_heads
from tangram_jax.engine.tensor_parallel import (AXIS, Placement, check_tensor_parallel,
                                                device_major_perm)
from tangram_jax.models.moe import shard_experts
from tangram_jax.models.rope import inverse_frequencies
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.prefill_attention import (PREFILL_TUNING, fit_tuning,
                                                           item_capacity, observation_probs,
                                                           pack_rows, prefill_work_items,
                                                           row_alignment)
from tangram_jax.pallas_kernels.split_map import SplitMap
from tangram_jax.sampling import (LogitsAdjust, TokenLogprobs, force_tokens, sample_tokens,
                                  step_keys, token_logprobs)

LAYER_LOOPS = ("scan", "unrolled", "switch")
# What a step computes besides its tokens: nothing, the chosen and top log-probs, or also the
# whole [rows, vocab] log-softmax (each a separately compiled variant of the step).
LOGPROB_MODES = (None, "top", "full")


class AttentionOps(NamedTuple):
    """The attention pieces a step calls; Pallas kernels or their jnp references."""

    prefill_attention: Callable   # ragged_prefill_attention signature (window, sinks included)
    write_chunk: Callable         # write_chunk_into_pages signature (rows to destination slots)
    compress_chunk: Callable      # compress_chunk_into_pages signature (precision tiers)
    # (q, k_pages, v_pages, block_tables, lengths, work_list, *, window, sinks) -> out
    decode_attention: Callable
    name: str                     # "pallas" (GPU kernels) or "xla" (the CPU path)
    # The CPU path plans a prefill's pool writes in the layer loop and applies them after it
    # (`chunk_compress.plan_destination_writes`: XLA would copy the pool every layer otherwise);
    # None: `write_chunk` writes in place inside the loop (the Pallas kernel aliases the pool).
    plan_writes: Callable | None = None

    @classmethod
    def for_backend(cls, use_kernels: bool | None = None) -> "AttentionOps":
        """Pallas kernels where they compile (GPU), the XLA serving path otherwise (CPU)."""
        from tangram_jax.pallas_kernels import chunk_compress, decode_attention, prefill_attention
        if use_kernels is None:
            use_kernels = not backend.default_interpret()
        if use_kernels:
            return cls(prefill_attention.ragged_prefill_attention,
                       chunk_compress.write_chunk_into_pages,
                       chunk_compress.compress_chunk_into_pages,
                       lambda q, k, v, bt, ln, work, **terms:
                       decode_attention.ragged_paged_decode_attention(
                           q, k, v, bt, ln, work_list=work, **terms),
                       "pallas")
        # The CPU serving path: XLA programs of the kernels' signatures (engine/xla_attention.py),
        # not the kernels' test references; the chunk compression's scatter is its reference.
        from tangram_jax.engine import xla_attention
        return cls(xla_attention.ragged_prefill_attention_xla,
                   _reference_write, chunk_compress.compress_chunk_into_pages_reference,
                   xla_attention.ragged_paged_decode_attention_xla,
                   "xla", chunk_compress.plan_destination_writes)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Static settings of the runner.

    obs_window: SnapKV observation window (queries whose attention scores a chunk's tokens).
    method: the scorer of the chunk compression, the method the budget profile was calibrated
      with (`chunk_scoring.SERVED_METHODS`); ``dynamic`` mode is Ada-SnapKV, so SnapKV.
    dynamic_ratio / dynamic_safeguard: the per-input selection of ``dynamic`` mode.
    scoring_rule: which queries rank a chunk's tokens (`chunk_scoring.SCORING_RULES`).
    layer_loop: how a step runs the layers: ``"scan"`` (`lax.scan` over stacked parameters: one
      layer body compiled, fast to compile, but XLA copies each layer's weights out of the
      stack every step), ``"unrolled"`` (one traced body per layer over separate parameter
      arrays: no copies, compile time grows with depth) or ``"switch"`` (`lax.scan` over the
      layer index; each half of a layer around attention is a `lax.switch` with one branch per
      layer over separate arrays: no copies, and attention, the larger part of a CPU step's
      program, compiled once). None: unrolled where the Pallas kernels run (GPU), switch on
      the CPU.
    max_prefill_tokens: the most tokens of one prefill call (the engine's token budget); the
      largest flat-token bucket of a call of whole rows (`ModelRunner.prefill`).
    prefill_token_buckets: the flat-token sizes below that a call of whole rows is padded to
      (`ModelRunner.prefill_token_buckets`); None: a ladder growing by ~1.5x.
    """

    mode: str = "tangram"
    obs_window: int = 32
    method: str = "snapkv"
    scoring_rule: str = "window"
    dynamic_ratio: float = 0.5
    dynamic_safeguard: float = 0.2
    layer_loop: str | None = None
    max_prefill_tokens: int = 8192
    prefill_token_buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.layer_loop not in (None, *LAYER_LOOPS):
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS} or None, got "
                             f"{self.layer_loop!r}")
        if self.obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {self.obs_window}")
        if not 0 < self.dynamic_ratio <= 1:
            raise ValueError(f"dynamic_ratio must be in (0, 1], got {self.dynamic_ratio}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        check_served_method(self.method)
        check_scoring_rule(self.scoring_rule)
        if self.mode == "dynamic" and self.scoring_rule != "window":
            raise ValueError(f"dynamic mode counts with Ada-SnapKV's scores; scoring_rule must "
                             f"be 'window', got {self.scoring_rule!r}")
        if self.mode == "dynamic" and self.method != "snapkv":
            raise ValueError(f"dynamic mode selects with Ada-SnapKV; method must be 'snapkv', "
                             f"got {self.method!r}")


class ModelRunner:
    """Device side of the engine: parameters, page pool, jitted steps.

    Args:
      model: the decoder (its KV heads are permuted in place to `layout.head_perm`).
      config: the model's config.
      layout: the KV layout (groups, budgets, page and chunk size).
      num_pages: pool pages (page 0 is the null page padded rows read and write); with precision
        tiers a (high, low) pair, each tier's pool with its null page; None: no pool until
        `allocate_pool` (the engine sizes it after compiling the largest steps).
      table_shape: the manager's block table, ``[rows, layers, groups, max_pages]``; the runner
        keeps a device copy, updated from the manager's write log (`update_block_tables`).
      split_maps: batch bucket -> SplitMap for the decode kernel (ignored by the references); of
        the groups (with precision tiers a tiered map of the tier groups, a list per tier).
      runner_config: mode and scorer settings.
      kv_dtype: pool dtype (the model's dtype by default); of a quantised pool, the dtype its
        values are dequantised to.
      kv_precision: page format of the pool (`kv_quant.KV_PRECISIONS`): ``bf16`` stores K/V in
        `kv_dtype`; ``k8v8`` / ``k8v4`` / ``k4v2`` store packed codes with per-slot scales
        (`kv_quant.QuantPages`), quantised as the chunk compression and the decode step write
        them and dequantised by the attention kernels. A tiered precision
        (`kv_layout.PRECISION_TIERS`, ``k8v4-k4v2``) needs a `TieredLayout` of that precision:
        the pool is then `kv_quant.TieredPages` (a high and a low pool, each of its own page
        count, indexed by its tier groups' block-table entries),
        block tables and lengths are of tier groups (``[..., 2 * groups]``, ``2 g`` high), the
        compression writes each group's top kept tokens to the high tier and the rest to the
        low tier, decode tokens go to the high tier, and attention reads both tiers.
      ops: attention implementations (default: by backend).
    """

    def __init__(self, model: Decoder, config: ModelConfig, layout: KVLayout | TieredLayout,
                 num_pages: int | tuple[int, int] | None,
                 table_shape: tuple[int, ...], *,
                 split_maps: dict[int, SplitMap] | None = None,
                 runner_config: RunnerConfig = RunnerConfig(), kv_dtype=None,
                 kv_precision: str = "bf16",
                 ops: AttentionOps | None = None,
                 devices: Sequence[jax.Device] | None = None):
        self.config = config
        # Every array the runner holds is committed to its devices, so its steps run there
        # whatever the caller's default device is (data-parallel replicas, one per device);
        # several devices split every KV head group between them (`tensor_parallel`).
        self.placement = Placement(devices if devices else [jax.devices()[0]])
        self.device = self.placement.devices[0]
        # A tiered layout's groups are (group, tier) pairs for the tables and counts; heads,
        # pages and the kernels' groups are its base layout's.
        self.tiers = layout if isinstance(layout, TieredLayout) else None
        if (kv_precision in PRECISION_TIERS) != (self.tiers is not None) or (
                self.tiers is not None and self.tiers.precision != kv_precision):
            raise ValueError(f"kv_precision {kv_precision!r} needs "
                             + ("a TieredLayout of that precision" if kv_precision in
                                PRECISION_TIERS else "a KVLayout") + f", got {layout.name!r}")
        if self.tiers is not None and runner_config.mode == "dynamic":
            raise ValueError("precision tiers are served with static budgets (tangram or full "
                             "mode), not in dynamic mode")
        self.layout = layout
        base = self.base_layout = layout.base if self.tiers is not None else layout
        self.runner_config = runner_config
        # Retention "turn" (`kv_layout`): a turn's chunks are held whole and its last chunk
        # compresses the whole turn (`_turn_compaction`).
        self.compacts_turns = (base.retention == "turn" and base.compresses
                               and runner_config.mode != "dynamic" and self.tiers is None)
        self.ops = ops or AttentionOps.for_backend()
        self.split_maps = dict(split_maps or {})
        for bucket, split_map in self.split_maps.items():
            if split_map.tiered != (self.tiers is not None):
                raise ValueError(f"split map of bucket {bucket} must be "
                                 + ("tiered (build_tier_split_map)" if self.tiers is not None
                                    else "untiered") + f" for layout {layout.name!r}")
        tp = self.placement.tp
        check_tensor_parallel(tp, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                              group_size=base.group_size,
                              intermediate_size=config.intermediate_size,
                              num_experts=config.moe.num_experts if config.moe else None)
        check_local_layers(config, layout, runner_config.mode, kv_precision,
                           int(table_shape[-1]) * base.page_size)
        head_perm = device_major_perm(base.head_perm, base.group_size, tp)
        if not np.array_equal(head_perm, np.tile(np.arange(base.num_kv_heads),
                                                 (base.num_layers, 1))):
            permute_kv_heads(model, head_perm)
        # The runner takes the layers over: stacked for lax.scan (one layer body is compiled,
        # not num_layers copies: compile time dominates on small models and CPUs), or kept as
        # separate arrays for an unrolled loop (no per-step copies out of a stack on the GPU).
        layers = list(model.layers)
        if tp > 1:   # mixture-of-experts layers run expert-parallel over the mesh
            shard_experts(layers, self.placement.mesh)
        # Switch on the CPU: unrolled saves the scan's per-layer weight copies (~425 MB a step
        # on the embedded model) but compiles 30 layer bodies per shape (the warm-up of `bench
        # serve`, ~50 shapes, went from ~4 minutes to over 15); the switch loop saves the
        # copies too and compiles the attention once (NOTES_bench_serve.md, session 9).
        self.layer_loop = runner_config.layer_loop or (
            "unrolled" if self.ops.name == "pallas" else "switch")
        self.layer_graphdef = nnx.split(layers[0])[0]
        states = [nnx.split(layer)[1] for layer in layers]
        # Every array the steps take is committed to the devices: jit keys its compiled steps
        # on whether an input is committed, and a step's outputs (the pool, the sampled tokens,
        # the block table) are. Uncommitted inputs at warm-up made every step shape compile
        # again while serving (twice: once more when the pool became a step's output).
        self.layer_states = (jax.tree.map(lambda *xs: jnp.stack(xs), *states)
                             if self.layer_loop == "scan" else states)
        model.layers = nnx.List([])
        del layers
        self.graphdef, self.state = nnx.split(model)
        self.state = self.placement.weights(self.state)
        self.layer_states = self.placement.weights(self.layer_states,
                                                   stacked=self.layer_loop == "scan")
        self.kv_dtype = jnp.dtype(kv_dtype or model.dtype)
        # The page format of the pool, or of each tier's pool (high, low).
        self.tier_formats = (tuple(kv_quant.page_format(t) for t in self.tiers.tiers)
                             if self.tiers is not None else None)
        self.kv_format = (self.tier_formats[0] if self.tiers is not None
                          else kv_quant.page_format(kv_precision))
        # Bytes of one page of each tier's pool (one pool untiered) on each device (a page's G
        # heads are split over the devices).
        self.tier_page_bytes = tuple(
            kv_quant.page_bytes(fmt, base.group_size, base.page_size, base.head_dim,
                                self.kv_dtype) // tp
            for fmt in (self.tier_formats or (self.kv_format,)))
        # Tables, lengths and keep counts per (layer, group) or per (layer, tier group).
        self.counts_shape = (layout.num_layers, layout.num_groups)
        # The prefill kernel's tiles, shrunk where this model's dtype and head count would not
        # fit a program's shared memory (float32 models); row packing and work items follow it.
        self.prefill_tuning = fit_tuning(PREFILL_TUNING, config.num_heads // config.num_kv_heads,
                                         config.head_dim, self.kv_dtype.itemsize)
        self.k_pages = self.v_pages = None
        if num_pages is not None:
            self.allocate_pool(num_pages)
        self.block_tables = jnp.zeros(table_shape, jnp.int32, device=self.placement.replicated)
        self.null_slot = int(table_shape[0]) - 1   # the manager's always-empty last row
        self._inv_freq = inverse_frequencies(config)   # Expected Attention's RoPE model
        # The last sampled token of every slot, kept on the device: a decode step reads its
        # input tokens here, so the host can schedule the next step before it has seen them.
        self.slot_tokens = jnp.zeros(table_shape[0], jnp.int32,
                                     device=self.placement.replicated)
        self._apply_table_updates = jax.jit(
            lambda t, i, v: t.reshape(-1).at[i].set(v, mode="drop").reshape(t.shape),
            donate_argnums=0)
        # The CPU path's prefill only reads the pool (its writes come back as a plan that
        # `_apply_writes` scatters in place, a second program): nothing of it is donated.
        self._prefill = jax.jit(self._prefill_impl,
                                static_argnames=("table_width", "region_pages"),
                                donate_argnums=() if self.plans_prefill_writes else (2, 3))
        self._apply_writes = jax.jit(_apply_planned_writes, donate_argnums=(0, 1))
        self._decode = jax.jit(self._decode_impl,
                               static_argnames=("split_map", "logprobs", "table_width"),
                               donate_argnums=(2, 3, 4))
        self._mixed = jax.jit(self._mixed_impl,
                              static_argnames=("table_width", "region_pages", "logprobs"),
                              donate_argnums=(2, 3, 4))
        self._sample_rows = jax.jit(_sample_into_slots, static_argnames=("logprobs",),
                                    donate_argnums=0)

    @property
    def kv_bytes_per_page(self) -> int:
        """Bytes of one page (K and V) on each device; a tiered pool's pages differ by tier
        (`tier_page_bytes`, `pool_bytes`)."""
        if self.tiers is not None:
            raise AttributeError("a tiered pool's pages differ by tier: use tier_page_bytes")
        return self.tier_page_bytes[0]

    # ----- the pool ----------------------------------------------------------------------
    def tier_pages(self, num_pages) -> tuple[int, ...]:
        """`num_pages` (an int, or (high, low) with tiers) as one count per tier's pool,
        checked against the runner's tiers."""
        counts = (num_pages,) if isinstance(num_pages, (int, np.integer)) else tuple(num_pages)
        if len(counts) != len(self.tier_page_bytes) or min(counts) < 2:
            want = "a (high, low) pair" if self.tiers is not None else "an int"
            raise ValueError(f"num_pages must be {want} of pool sizes >= 2 (the null page "
                             f"and one), got {num_pages!r}")
        return tuple(int(n) for n in counts)

    @property
    def num_pages(self) -> int | tuple[int, int]:
        """The pool's pages (null pages included): an int, or (high, low) with tiers."""
        pools = (self.k_pages,) if self.tiers is None else (self.k_pages.high, self.k_pages.low)
        counts = tuple(int(p.shape[0]) for p in pools)
        return counts[0] if self.tiers is None else counts

    def pool_bytes(self, num_pages=None) -> int:
        """Bytes (K and V, on each device) of a pool of `num_pages` (default: the one held)."""
        counts = self.tier_pages(self.num_pages if num_pages is None else num_pages)
        return sum(n * b for n, b in zip(counts, self.tier_page_bytes))

    def pool_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """``[num_pages, G, page_size, head_dim]``: the shape of `k_pages` and of `v_pages`
        (of one tier's pools: each tier has its own `num_pages`)."""
        return (int(num_pages), self.base_layout.group_size, self.base_layout.page_size,
                self.base_layout.head_dim)

    def allocate_pool(self, num_pages) -> None:
        """(Re)allocate the zeroed pool of `num_pages` pages (page 0 is the null page; with
        tiers a (high, low) pair, each tier's null page included)."""
        self.k_pages = self.v_pages = None         # the old pool's memory goes first
        self.k_pages, self.v_pages = self._pool(
            num_pages, lambda shape, dtype: jnp.zeros(shape, dtype, device=self.placement.pool))

    def _pool(self, num_pages, make):
        """(k_pages, v_pages) of the runner's page format(s); `make(shape, dtype)` builds each
        array (zeros on the runner's devices, or a `jax.ShapeDtypeStruct` spec)."""
        return kv_quant.allocate_pools(self.tier_formats or (self.kv_format,),
                                       self.tier_pages(num_pages), self.pool_shape(0)[1:],
                                       self.kv_dtype, make=make)

    def _commit(self, tree):
        """`tree`'s arrays committed to the runner's devices, replicated (see `__init__`)."""
        return jax.device_put(tree, self.placement.replicated)

    def _over_layers(self, layer_step, carry, xs):
        """`lax.scan(layer_step, carry, xs)`, or the same loop unrolled over the layer list
        (then ``xs[0]`` is that list and the other per-layer inputs are sliced statically), or
        (``switch``) a scan over the layer index whose step gets a `_SwitchedLayer` of that
        list in place of a layer's state (layer steps take their layer from `_layer`)."""
        if self.layer_loop == "scan":
            return jax.lax.scan(layer_step, carry, xs)
        layer_states, *rest = xs
        if self.layer_loop == "switch":
            def indexed_step(carry, xs):
                index, *per_layer = xs
                return layer_step(carry, (_SwitchedLayer(self.layer_graphdef, layer_states, index),
                                          *per_layer))
            return jax.lax.scan(indexed_step, carry,
                                (jnp.arange(len(layer_states), dtype=jnp.int32), *rest))
        ys = []
        for i, layer_state in enumerate(layer_states):
            carry, y = layer_step(carry, (layer_state, *(x[i] for x in rest)))
            ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    def _attention_terms(self, layer) -> dict:
        """What the layer's attention takes besides q, k, v (`pallas_kernels.attention_terms`):
        its window where the model has local layers, its sinks where it has sinks (nothing
        for other models: their attention compiles as before)."""
        terms = {}
        if self.config.local_layers:
            terms["window"] = layer.attention_window()
        if self.config.attention_sinks:
            terms["sinks"] = layer.attention_sinks()
        return terms

    @property
    def _terms_spec(self) -> dict:
        """`shard_map` specs of `_attention_terms`: the window whole, the sinks by query head."""
        spec = {}
        if self.config.local_layers:
            spec["window"] = P()
        if self.config.attention_sinks:
            spec["sinks"] = P(AXIS)
        return spec

    def _layer(self, layer_state):
        """The layer a layer step runs: its state merged into a `DecoderLayer`, or (the
        ``switch`` loop) the `_SwitchedLayer` that picks it by index."""
        if isinstance(layer_state, _SwitchedLayer):
            return layer_state
        return nnx.merge(self.layer_graphdef, layer_state)

    # ----- block tables ----------------------------------------------------------------------
    def update_block_tables(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        """Apply the manager's block-table writes (flat indices into the table, in order) to
        the device copy: a step sends what changed, not the table."""
        if len(flat_index) == 0:
            return
        flat_index = np.asarray(flat_index, np.int64)
        # Later writes to a cell win; a scatter with repeated indices has no order.
        _, last = np.unique(flat_index[::-1], return_index=True)
        keep = len(flat_index) - 1 - last
        n = len(keep)
        size = max(64, backend.next_power_of_2(n))        # few distinct shapes to compile
        index = np.full(size, self.block_tables.size, np.int32)   # out of range: dropped
        vals = np.zeros(size, np.int32)
        index[:n] = flat_index[keep]
        vals[:n] = np.asarray(values)[keep]
        self.block_tables = self._apply_table_updates(self.block_tables, index, vals)

    # ----- prefill ---------------------------------------------------------------------------
    @property
    def prefill_whole_rows(self) -> bool:
        """True when a prefill row may span several compression chunks: the layout keeps every
        token (``full``, or a profile of budgets 1), so no chunk's selection depends on the
        scores of the chunk before it, and a row is a whole piece of a turn (one long causal
        attention, one KV append). Otherwise a row is one compression chunk (always with
        precision tiers: the tier rule splits each chunk's kept tokens by rank)."""
        return (not self.layout.compresses and self.runner_config.mode != "dynamic"
                and self.tiers is None)

    def prefill_token_buckets(self, max_rows: int = 1) -> list[int]:
        """Flat-token sizes a call of whole rows is padded to (`prefill_whole_rows`): the
        configured `RunnerConfig.prefill_token_buckets` rounded up to the row alignment, else
        multiples of the alignment growing by ~1.5x (so at most a third is padding); up to
        `max_prefill_tokens` plus one alignment of slack per extra row (always a bucket)."""
        align = row_alignment(self.prefill_tuning)
        cap = -(-self.runner_config.max_prefill_tokens // align) * align + align * (max_rows - 1)
        if self.runner_config.prefill_token_buckets is not None:
            return sorted({-(-b // align) * align for b in self.runner_config.prefill_token_buckets
                           if b < cap} | {cap})
        sizes, size = [], align
        while size < cap:
            sizes += [size] + ([size * 3 // 2] if size * 3 // 2 < cap and size >= 2 * align
                               else [])
            size *= 2
        return sorted(set(sizes)) + [cap]

    def chunk_token_buckets(self, rows: int) -> list[int]:
        """Flat-token sizes of a call of `rows` compression-chunk rows (not
        `prefill_whole_rows`): every row's chunk, aligned; on the CPU path also the powers of
        two of the row alignment below that from `rows` alignments up (a follow-up turn's few
        dozen tokens cost a 64-token GEMM, not a whole chunk's; each size is one more compiled
        prefill and mixed program)."""
        align = row_alignment(self.prefill_tuning)
        whole = rows * (-(-self.layout.chunk_size // align) * align)
        if self.ops.name != "xla":
            return [whole]
        return _doublings(rows * align, whole)

    def prefill(self, tokens: list[np.ndarray], start_positions: list[int], slots: list[int],
                hist_lengths: list[np.ndarray],
                num_protected: list[int] | None = None,
                prompt_targets: list[np.ndarray] | None = None,
                decode: dict | None = None, *,
                turn_hist: list[np.ndarray] | None = None,
                keep_counts: list[np.ndarray] | None = None,
                held_protected: list[int] | None = None) -> tuple:
        """Run one prefill row for each of several sequences in one call (a ragged batch: the
        GEMMs see every row's tokens at once), writing each one's kept K/V into its pages.

        Row b: tokens[b] int [n_b], start_positions[b] the absolute position of its first token
        (a compression-chunk boundary of its turn), slots[b] its block-table row (reservation
        applied by `update_block_tables`), hist_lengths[b] int [layers, groups] retained tokens
        before the row, num_protected[b] how many of its last tokens are the turn's protected
        tail (`KVLayout.chunk_protected`; default none). With `prefill_whole_rows` a row is any
        piece of a turn (n_b >= 1, all rows together within `max_prefill_tokens`; every token
        is kept, so protection changes nothing); otherwise one compression chunk
        (1 <= n_b <= layout.chunk_size). The slots must be distinct. Rows are padded to a
        power of two with empty rows on the null slot, so few shapes compile.
        Returns (last_logits [rows, vocab] float32, kept [rows, layers, groups] int32), device
        arrays whose first ``len(tokens)`` rows are the given rows. Without dynamic selection
        `kept` is the layout's keep rule for each row (``chunk_keep_counts(n_b, num_protected[b])``
        for a chunk, n_b for a whole row). With `prompt_targets` a third item: each row's
        log-probabilities of its targets (see `_run_prefill`).

        decode: a decode step to run with this call (the keyword arguments of `decode`; its
        rows are other sequences than these). Where the runner `mixes_steps` and no
        prompt_targets are asked, both run as one program (`_mixed_impl`: one pass over the
        weights and the layers); otherwise the prefill, then the decode. Its result (`decode`'s
        return value) is then the last item of the returned tuple.

        Retention "turn" (`compacts_turns`) needs, per row, turn_hist[b] int [layers, groups]
        (the retained tokens before the row's turn: its held tokens are slots turn_hist ..
        hist - 1) and keep_counts[b] int [layers, groups] (what the row changes the group's
        count by, ``layout.piece_retained_counts`` of the row within its turn: the row's length
        while the turn is held, and for its last row the turn's count less what it holds, so
        that row compresses the whole turn); held_protected[b]: of the turn's protected tail,
        the tokens already held before the row. Without them every row is a whole turn of its
        own, compressed as it is written.
        """
        n_rows = len(tokens)
        if not (n_rows == len(start_positions) == len(slots) == len(hist_lengths) > 0):
            raise ValueError("prefill needs one start position, slot and history per row")
        if len(set(int(s) for s in slots)) != n_rows:
            raise ValueError(f"prefill rows must be distinct sequences, got slots {list(slots)}")
        if num_protected is None:
            num_protected = [0] * n_rows
        limit = None if self.prefill_whole_rows else self.layout.chunk_size
        for t, p in zip(tokens, num_protected):
            if len(t) < 1 or (limit is not None and len(t) > limit):
                raise ValueError(f"a prefill row holds 1..{limit or 'max_prefill_tokens'} "
                                 f"tokens, got {len(t)}")
            if not 0 <= p <= len(t):
                raise ValueError(f"num_protected must be in [0, {len(t)}] for a row of {len(t)} "
                                 f"tokens, got {p}")
        if prompt_targets is not None and [len(t) for t in prompt_targets] != \
                [len(t) for t in tokens]:
            raise ValueError("prompt_targets needs one target per token of every row")
        turn_rows = self._turn_rows(tokens, hist_lengths, num_protected, turn_hist, keep_counts,
                                    held_protected)
        if decode is not None and self.mixes_steps and prompt_targets is None:
            return self._run_mixed(tokens, start_positions, slots, hist_lengths, num_protected,
                                   decode, turn_rows)
        out = self._run_prefill(tokens, start_positions, slots, hist_lengths, num_protected,
                                prompt_targets, turn_rows)
        return out if decode is None else (*out, self.decode(**decode))

    def _turn_rows(self, tokens, hist_lengths, num_protected, turn_hist, keep_counts,
                   held_protected):
        """(turn_hist, keep_counts, held_protected) of every row for retention "turn"
        (checked; `prefill`), None where the runner does not compact turns."""
        if not self.compacts_turns:
            return None
        n = len(tokens)
        if turn_hist is None and keep_counts is None and held_protected is None:
            # Every row a whole turn of its own: compressed as it is written.
            layout = self.layout
            bad = [len(t) for t, p in zip(tokens, num_protected)
                   if p != layout.protected_tail(len(t))]
            if bad:
                raise ValueError(f"retention 'turn': rows of {bad} tokens are not whole turns "
                                 f"(their protected tails differ); pass turn_hist, keep_counts "
                                 f"and held_protected")
            turn_hist = [np.asarray(h) for h in hist_lengths]
            keep_counts = [layout.retained_counts(len(t)) for t in tokens]
            held_protected = [0] * n
        if turn_hist is None or keep_counts is None or held_protected is None or \
                not len(turn_hist) == len(keep_counts) == len(held_protected) == n:
            raise ValueError("retention 'turn' needs turn_hist, keep_counts and held_protected "
                             "for every row")
        turn_hist = [np.asarray(x, np.int64) for x in turn_hist]
        keep_counts = [np.asarray(x, np.int64) for x in keep_counts]
        for t, h0, h, k, p in zip(tokens, turn_hist, hist_lengths, keep_counts, held_protected):
            h = np.asarray(h)
            if h0.shape != self.counts_shape or k.shape != self.counts_shape or \
                    (h0 > h).any() or (k > len(t)).any() or (h + k < h0).any() or \
                    not 0 <= p <= (h - h0).min():
                raise ValueError(f"turn_hist and keep_counts must be {self.counts_shape} with "
                                 f"turn_hist <= hist, keep_counts <= the row's tokens and "
                                 f"hist + keep_counts >= turn_hist; held_protected in "
                                 f"[0, hist - turn_hist]")
        return turn_hist, keep_counts, [int(p) for p in held_protected]

    def _run_mixed(self, tokens, start_positions, slots, hist_lengths, num_protected,
                   decode: dict, turn_rows=None) -> tuple:
        """`prefill` of these rows and `decode(**decode)` as one program (`_mixed_impl`)."""
        decode = dict(decode)
        positions, d_slots, lengths = (decode.pop(k) for k in ("positions", "slots", "lengths"))
        sampling = [decode.pop(k) for k in ("temperature", "top_k", "top_p", "seeds", "steps")]
        logprobs = decode.pop("logprobs", None)
        forced, adjust = decode.pop("forced_tokens", None), decode.pop("adjust", None)
        if decode:
            raise ValueError(f"unknown decode arguments {sorted(decode)}")
        if set(int(s) for s in slots) & set(int(s) for s in d_slots if s != self.null_slot):
            raise ValueError("a mixed step's prefill and decode rows must be distinct sequences")
        prefill_args, prefill_static = self._prefill_args(
            tokens, start_positions, slots, hist_lengths, num_protected, None, self.k_pages,
            self.v_pages, turn_rows)
        decode_args, decode_static = self._decode_call(
            self.k_pages, self.v_pages, positions, d_slots, lengths, *sampling, forced,
            logprobs, adjust)
        # One width for both parts: where steps mix it is the whole table (`_table_width`).
        prefill_static = dict(prefill_static, table_width=max(
            prefill_static["table_width"], decode_static["table_width"]))
        logits, kept, next_tokens, lp = self._call_mixed(prefill_args, prefill_static,
                                                         decode_args, decode_static)
        return logits, kept, (next_tokens if logprobs is None else (next_tokens, lp))

    def _run_prefill(self, tokens, start_positions, slots, hist_lengths, num_protected,
                     prompt_targets=None, turn_rows=None):
        """`prefill` without the checks. With `prompt_targets` (int [n_b] per row: the token
        each position's logits predict, -1 for none) it also returns each row's
        `TokenLogprobs` of those targets (numpy, [n_b] / [n_b, MAX_TOP_LOGPROBS]; the
        prompt_logprobs of vLLM), computed on the device over every position of the call."""
        args, static = self._prefill_args(tokens, start_positions, slots, hist_lengths,
                                          num_protected, None, self.k_pages, self.v_pages,
                                          turn_rows)
        if prompt_targets is None:
            logits, kept = self._call_prefill(args, static)
            return logits, kept
        row_starts = args[6]
        flat_targets = np.full(args[4].shape[0], -1, np.int32)
        for start, t in zip(row_starts, prompt_targets):
            flat_targets[start:start + len(t)] = t
        logits, kept, lp = self._call_prefill((*args, flat_targets), static)
        host = TokenLogprobs(*(np.asarray(x) for x in lp[:4]), None)
        rows = [TokenLogprobs(*(x[start:start + len(t)] for x in host[:4]), None)
                for start, t in zip(row_starts, prompt_targets)]
        return logits, kept, rows

    def _call_prefill(self, args, static) -> tuple:
        """Run `_prefill` and take the pool it wrote (kernels: in place) or apply the writes
        it planned (the CPU path); returns the rest of its results."""
        if self.plans_prefill_writes:
            writes, *rest = self._prefill(*args, **static)
            self.k_pages, self.v_pages = self._apply_writes(self.k_pages, self.v_pages, writes)
        else:
            self.k_pages, self.v_pages, *rest = self._prefill(*args, **static)
        return tuple(rest)

    def _prefill_args(self, tokens, start_positions, slots, hist_lengths, num_protected,
                      num_tokens, k_pages, v_pages, turn_rows=None,
                      region_pages: int | None = None) -> tuple[tuple, dict]:
        """`_prefill`'s inputs and static arguments for these rows; `num_tokens` forces the
        flat-token bucket of whole rows (warm-up); turn_rows: `_turn_rows`'s (turn_hist,
        keep_counts, held_protected), or None (every row keeps all: a warm-up call);
        region_pages forces the static region width of turn compactions (warm-up)."""
        n_rows = len(tokens)
        rows = backend.next_power_of_2(n_rows)
        layout = self.layout
        align = row_alignment(self.prefill_tuning)
        lens = np.zeros(rows, np.int32)
        lens[:n_rows] = [len(t) for t in tokens]
        protected = np.zeros(rows, np.int32)
        protected[:n_rows] = num_protected
        starts, used = pack_rows(lens[:n_rows], align)
        if self.prefill_whole_rows:
            if num_tokens is None:
                num_tokens = next((b for b in self.prefill_token_buckets(rows) if b >= used), None)
                if num_tokens is None:
                    raise ValueError(f"a prefill call of {int(lens.sum())} tokens in {n_rows} "
                                     f"rows exceeds max_prefill_tokens "
                                     f"{self.runner_config.max_prefill_tokens}")
        elif num_tokens is None:
            num_tokens = next(b for b in self.chunk_token_buckets(rows) if b >= used)
        # Empty padding rows start at the end of the flat axis (they own no token).
        row_starts = np.full(rows, num_tokens, np.int32)
        row_starts[:n_rows] = starts
        flat = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        for b in range(n_rows):
            s, n = starts[b], lens[b]
            flat[s:s + n] = tokens[b]
            positions[s:s + n] = int(start_positions[b]) + np.arange(n)
        row_slots = np.full(rows, self.null_slot, np.int32)
        row_slots[:n_rows] = slots
        hist = np.zeros((rows, *self.counts_shape), np.int32)
        hist[:n_rows] = np.stack([np.asarray(h, np.int32) for h in hist_lengths])
        turn_hist = hist.copy()
        held_protected = np.zeros(rows, np.int32)
        if self.prefill_whole_rows or self.runner_config.mode == "dynamic":
            keep = np.zeros_like(hist)     # whole rows keep all; dynamic decides on device
        elif self.compacts_turns:
            keep = np.broadcast_to(lens[:, None, None], hist.shape).astype(np.int32)
            if turn_rows is not None:
                turn_hist[:n_rows] = np.stack(turn_rows[0])
                keep[:n_rows] = np.stack(turn_rows[1])
                held_protected[:n_rows] = turn_rows[2]
        else:
            keep = np.stack([layout.chunk_keep_counts(int(n), int(p))
                             for n, p in zip(lens, protected)]).astype(np.int32)
        # The kernel's item list per layer, heaviest first (ahead of the call, on the host).
        # (Tiers: a group's history is both its tiers, read as one.)
        group_hist = hist if self.tiers is None else hist[..., 0::2] + hist[..., 1::2]
        items = prefill_work_items(
            row_starts, lens, np.swapaxes(group_hist, 0, 1), num_tokens=num_tokens,
            num_items=item_capacity(num_tokens, self.base_layout.num_groups,
                                    self.base_layout.group_size // self.placement.tp,
                                    self.prefill_tuning), tuning=self.prefill_tuning)
        args = (self.state, self.layer_states, k_pages, v_pages, flat, positions, row_starts,
                lens, protected, self.block_tables, row_slots, hist, keep, items, held_protected,
                turn_hist)
        # The columns attention reads: the history's (the CPU path plans its writes from the
        # whole table after the loop), or the history's and the row's (kernels write in place).
        reach = int(hist.max()) + (0 if self.plans_prefill_writes else int(lens.max()))
        if region_pages is None:
            region_pages = 0
            if self.compacts_turns:   # the pages each compaction's held tokens span
                compacts = (keep < lens[:, None, None]).any(axis=(1, 2))[:n_rows]
                ps = layout.page_size
                span = (turn_hist % ps + hist - turn_hist + ps - 1) // ps
                region_pages = self._region_width(
                    int(span[:n_rows][compacts].max()) if compacts.any() else 0)
        return args, dict(table_width=self._table_width(reach, prefill=True),
                          region_pages=region_pages)

    def _region_widths(self) -> list[int]:
        """The static region widths (pages) of turn compactions a prefill call compiles for
        (`_region_width`): `SHORT_REGION_PAGES` (what a follow-up turn holds) and the whole
        block table (a long turn), so a prefill shape compiles twice, not once per length; a
        call whose rows only append takes the short one (its compaction branch is skipped).
        [0] where the runner does not compact turns."""
        if not self.compacts_turns:
            return [0]
        full = int(self.block_tables.shape[-1])
        return sorted({min(SHORT_REGION_PAGES, full), full})

    def _region_width(self, pages: int) -> int:
        """The smallest of `_region_widths` that holds `pages` pages."""
        return next(w for w in self._region_widths() if w >= pages)

    @property
    def dense_pool(self) -> bool:
        """Whether the pool holds pages of values (bf16), not quantised codes or tiers."""
        return not self.kv_format.quantised and self.tiers is None

    @property
    def plans_prefill_writes(self) -> bool:
        """Whether prefill plans its K/V writes and scatters them after the layer loop (the CPU
        path: writing inside the loop made XLA copy the whole pool every layer) rather than
        writing in place. Plans are of dense (bf16) pools on one device."""
        return self.ops.plan_writes is not None and self.placement.tp == 1 and self.dense_pool

    def prefill_chunk(self, tokens: np.ndarray, start_position: int, slot: int,
                      hist_lengths: np.ndarray,
                      num_protected: int = 0) -> tuple[jax.Array, jax.Array]:
        """`prefill` of a single row: (last_logits [vocab], kept [layers, groups])."""
        logits, kept = self.prefill([tokens], [start_position], [slot], [hist_lengths],
                                    [num_protected])
        return logits[0], kept[0]

    def _prefill_layer_attention(self, rows: int, n: int, k_pages,
                                 region_pages: int = 0) -> Callable:
        """One layer's prefill attention, compression scoring and KV write for `rows` rows over
        a flat axis of `n` tokens (run per device): ``attend(q, k, v, k_pages, v_pages, tables,
        write_tables, hist, turn_hist, keep, items, row_starts, row_lens, num_protected,
        held_protected, positions, terms) -> (out [n, Hq, d], k_pages, v_pages, kept [rows,
        groups], planned writes)``. region_pages: static, the held pages a turn compaction of
        this call reads (`_turn_compaction`; 0: no row compacts its turn)."""
        chunk = self.layout.chunk_size
        whole_rows = self.prefill_whole_rows
        group_size = self.base_layout.group_size // self.placement.tp   # heads of a group here
        page_size = self.layout.page_size

        planned = self.plans_prefill_writes
        num_pages = k_pages.shape[0] if planned else None
        tiered = self.tiers is not None

        def write(k_src, v_src, dest, k_pages, v_pages, table, plans):
            """Rows of k_src, v_src [S, heads, d] into the slots `dest` [heads, S] gives (-1:
            none): now (kernel), or planned for after the loop (then `table` is the row's
            whole table of this layer, `plans` collects the plan)."""
            if planned:
                plans.append(self.ops.plan_writes(k_src, v_src, dest, num_pages, page_size,
                                                  group_size, table))
                return k_pages, v_pages
            return self.ops.write_chunk(
                k_src, v_src, dest, k_pages, v_pages, table,
                max_dirty=contiguous_dirty_pages(k_src.shape[0], page_size))

        def attend(q, k, v, k_pages, v_pages, tables, write_tables, hist, turn_hist, keep, items,
                   row_starts, row_lens, num_protected, held_protected, positions, terms):
            """The layer's attention, compression scoring and KV write on one device's heads
            (all of them without tensor parallelism). q [N, Hq, d], k/v [N, Hkv, d]; pools
            [num_pages, G, page_size, d] (this device's G); terms: the layer's window and sinks
            (`_attention_terms`). Returns (out [N, Hq, d], k_pages, v_pages, kept [rows,
            groups], the planned writes (a list; empty unless planned))."""
            k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
            plans = []
            # Tiers: tables and lengths of tier groups; both prefill paths read a group's two
            # tiers as one dense history (`kv_quant.tiered_dense_history`).
            out, lse = self.ops.prefill_attention(q, k, v, k_pages, v_pages, tables, hist,
                                                  row_starts, row_lens, items,
                                                  tuning=self.prefill_tuning, **terms)
            if whole_rows:
                # Every token kept: each row's K/V appended after its history, in order.
                pad = ((0, n), (0, 0), (0, 0))
                k_flat, v_flat = jnp.pad(k, pad), jnp.pad(v, pad)
                t = jnp.arange(n, dtype=jnp.int32)[None, :]
                for b in range(rows):
                    dest = jnp.where(t < row_lens[b], jnp.repeat(hist[b], group_size)[:, None]
                                     + t, -1)
                    k_pages, v_pages = write(
                        jax.lax.dynamic_slice_in_dim(k_flat, row_starts[b], n),
                        jax.lax.dynamic_slice_in_dim(v_flat, row_starts[b], n), dest,
                        k_pages, v_pages, write_tables[b], plans)
                kept = jnp.broadcast_to(row_lens[:, None], hist.shape)
                return out, k_pages, v_pages, kept, plans
            # One compression chunk per row: score, select, write.
            obs = observation_probs(q, k, lse, row_starts, row_lens,
                                    obs_window=self.runner_config.obs_window, chunk=chunk)
            pad = ((0, chunk), (0, 0), (0, 0))   # a padding row's slice stays in range
            q_flat, k_flat, v_flat = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
            kept = []
            for b in range(rows):
                q_row, k_row, v_row = (jax.lax.dynamic_slice_in_dim(x, row_starts[b], chunk)
                                       for x in (q_flat, k_flat, v_flat))
                if tiered:
                    scores, keep_b = self._row_scores(
                        obs[b], q_row, k_row, v_row, row_lens[b], num_protected[b],
                        positions[jnp.minimum(row_starts[b], n - 1)], keep[b])
                    k_pages, v_pages = compress_chunk_into_tiers(
                        self.ops.compress_chunk, k_row, v_row, scores, keep_b, row_lens[b],
                        k_pages, v_pages, write_tables[b], hist[b])
                    kept.append(keep_b)
                    continue
                if self.compacts_turns:
                    # Held whole (the row's length), or the turn's last row: the whole turn.
                    keep_b = keep[b]
                    chunk_dest = chunk_destinations(
                        -jnp.arange(chunk, dtype=jnp.float32)[None].repeat(k.shape[1], 0),
                        jnp.minimum(keep_b, row_lens[b]), row_lens[b], hist[b], group_size)
                    if region_pages:
                        dest, k_src, v_src = jax.lax.cond(
                            jnp.any(keep_b < row_lens[b]),
                            lambda: self._turn_compaction(
                                q_row, k_row, v_row, obs[b], lse, row_starts[b], row_lens[b],
                                k_pages, v_pages, write_tables[b], hist[b], turn_hist[b],
                                keep_b, num_protected[b], held_protected[b], region_pages),
                            lambda: _append_only(chunk_dest, k_row, v_row, region_pages,
                                                 page_size))
                    else:
                        dest, k_src, v_src = chunk_dest, k_row, v_row
                else:
                    scores, keep_b = self._row_scores(
                        obs[b], q_row, k_row, v_row, row_lens[b], num_protected[b],
                        positions[jnp.minimum(row_starts[b], n - 1)], keep[b])
                    dest = chunk_destinations(scores, keep_b, row_lens[b], hist[b], group_size)
                    k_src, v_src = k_row, v_row
                k_pages, v_pages = write(k_src, v_src, dest, k_pages, v_pages, write_tables[b],
                                         plans)
                kept.append(keep_b)
            return out, k_pages, v_pages, jnp.stack(kept), plans

        heads = P(None, AXIS, None)                      # [N, heads, d]: heads over the devices
        attend = self.placement.per_device(
            attend, in_specs=(heads, heads, heads, self._pool_spec, self._pool_spec)
            + (P(),) * 11 + (self._terms_spec,),
            out_specs=(heads, self._pool_spec, self._pool_spec, P(), []))

        return attend

    def _turn_compaction(self, q_row, k_row, v_row, obs_row, lse, row_start, row_len, k_pages,
                         v_pages, table, hist, turn_hist, keep, num_protected, held_protected,
                         region_pages: int):
        """The last row of a turn under retention "turn": the whole turn (its held slots
        ``turn_hist .. hist - 1`` of each group, then the row's tokens) scored by the turn's
        question (the row's last obs_window queries, `obs_row`) and the question-agnostic rule
        (`chunk_scoring.turn_scores`), the top ``hist + keep - turn_hist`` of each head written
        back in temporal order from slot ``turn_hist``.

        q_row, k_row, v_row [T, heads, d] (the row, padded); obs_row [Hq, W, T] (the window's
        probabilities over the row's keys); lse [Hq, N] (the call's); row_start, row_len,
        num_protected (the row's protected tokens), held_protected (the turn's protected tokens
        held before the row): int32 scalars; table int [groups, P]; hist, turn_hist, keep int
        [groups]. Returns (dest [heads, R + T], k_src, v_src [R + T, heads, d]) for `write`:
        R = region_pages * page_size held slots, read from the pages (dequantised) and written
        back compacted, then the row's tokens."""
        chunk, heads, dim = k_row.shape
        group_size = heads // hist.shape[0]
        ps = self.layout.page_size
        window = obs_row.shape[1]
        q_per_kv = self.config.q_per_kv
        # The held slots: per group the table columns from its turn's first page on.
        first = turn_hist // ps                                              # [groups]
        cols = jnp.clip(first[:, None] + jnp.arange(region_pages)[None], 0, table.shape[1] - 1)
        page_ids = jnp.clip(jnp.take_along_axis(table, cols, axis=1), 0, None)
        slot = (first[:, None] * ps + jnp.arange(region_pages * ps)[None])   # [groups, R]
        held = (slot >= turn_hist[:, None]) & (slot < hist[:, None])
        per_head = lambda x: jnp.repeat(x, group_size, axis=0)              # noqa: E731

        def gather(pages):   # [groups, R_pages] -> [heads, R, d] in the pool's value dtype
            x = kv_quant.take_pages(pages, page_ids)       # [groups, Rp, G, ps, d]
            x = jnp.moveaxis(x, 2, 1)                      # [groups, G, Rp, ps, d]
            return x.reshape(heads, region_pages * ps, dim)

        k_held, v_held = gather(k_pages), gather(v_pages)
        # The question's attention on the held tokens: exp(q k / sqrt(d) - lse), summed over
        # the window, averaged over each head's query heads (what `obs_row` holds for the row).
        local = row_len - window + jnp.arange(window)
        # (In the pool's dtype with float32 sums, as the attention kernels compute them.)
        q_win = q_row[jnp.clip(local, 0, chunk - 1)].astype(k_held.dtype)    # [W, Hq, d]
        lse_win = lse[:, jnp.clip(row_start + local, 0, lse.shape[1] - 1)]   # [Hq, W]
        logits = jnp.einsum("wgjd,gsd->gjws", q_win.reshape(window, heads, q_per_kv, dim),
                            k_held, preferred_element_type=jnp.float32).reshape(
            heads * q_per_kv, window, -1) / math.sqrt(dim)
        live = (local >= 0)[None, :, None] & per_head(held)[:, None].repeat(q_per_kv, 0)
        probs = jnp.where(live, jnp.exp(logits - lse_win[..., None]), 0.0)
        mass_held = probs.sum(axis=1).reshape(heads, q_per_kv, -1).mean(axis=1)
        mass_row = obs_row.sum(axis=1).reshape(heads, q_per_kv, chunk).mean(axis=1)
        # One temporal axis: held slots, then the row.
        mass = jnp.concatenate([mass_held, mass_row], axis=1)
        keys = jnp.concatenate([k_held.astype(jnp.float32),
                                jnp.swapaxes(k_row, 0, 1).astype(jnp.float32)], axis=1)
        t = jnp.arange(chunk)
        candidate = jnp.concatenate([per_head(held), jnp.broadcast_to(
            t[None] < row_len, (heads, chunk))], axis=1)
        protected = jnp.concatenate([
            per_head((slot >= hist[:, None] - held_protected) & held),
            jnp.broadcast_to((t[None] >= row_len - num_protected) & (t[None] < row_len),
                             (heads, chunk))], axis=1)
        scores = turn_scores(mass, keys, candidate, protected,
                             method=self.runner_config.method,
                             rule=self.runner_config.scoring_rule)
        total = scores.shape[1]
        dest = chunk_destinations(scores, hist + keep - turn_hist, jnp.int32(total), turn_hist,
                                  group_size)
        k_src = jnp.concatenate([jnp.swapaxes(k_held, 0, 1).astype(k_row.dtype), k_row])
        v_src = jnp.concatenate([jnp.swapaxes(v_held, 0, 1).astype(v_row.dtype), v_row])
        return dest, k_src, v_src

    def _prefill_impl(self, state, layer_states, k_pages, v_pages, tokens, positions, row_starts,
                      row_lens, num_protected, all_tables, slots, hist_lengths, keep_counts,
                      work_items, held_protected, turn_hist, targets=None, *, table_width,
                      region_pages):
        """tokens, positions [N] (flat, rows at row_starts); row_starts, row_lens, num_protected,
        held_protected, slots [rows]; hist_lengths, keep_counts, turn_hist [rows, layers,
        groups]; work_items [layers, items, 5]; table_width, region_pages: static, the
        block-table columns attention reads and the held pages a turn compaction reads (see
        `_table_width`, `_prefill_args`). Returns (k_pages, v_pages, logits, kept[, lp]), or
        with `plans_prefill_writes` (writes, logits, kept[, lp]): the pool untouched, its
        writes for `_apply_writes`."""
        model = nnx.merge(self.graphdef, state)
        rows, n = row_starts.shape[0], tokens.shape[0]
        planned = self.plans_prefill_writes
        attend = self._prefill_layer_attention(rows, n, k_pages, region_pages)

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry
            # [rows, Gn, width], [rows, Gn, P or width], [rows, Gn] x 3, [I, 5]
            layer_state, tables, write_tables, hist, turn_hist, keep, items = xs
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, positions[None])      # GEMMs over every row's tokens at once
            out, k_pages, v_pages, kept, plans = attend(
                q[0], k[0], v[0], k_pages, v_pages, tables, write_tables, hist, turn_hist, keep,
                items, row_starts, row_lens, num_protected, held_protected, positions,
                self._attention_terms(layer))
            h = layer.finish(h, out[None].astype(h.dtype))
            return (h, k_pages, v_pages), (kept, plans or None)

        h = model.embed(tokens[None])                    # [1, N, hidden]
        (h, k_pages, v_pages), (kept, plans) = self._over_layers(
            layer_step, (h, k_pages, v_pages),
            (layer_states, *self._prefill_layer_inputs(all_tables, slots, hist_lengths,
                                                        turn_hist, keep_counts, work_items,
                                                        table_width)))
        # The CPU path returns its writes of every layer and row (`_apply_writes` scatters them
        # in place, in a second program): scattered here, after the loop, they could still be
        # ordered before a layer's history read (unrolled, nothing makes the scatter wait for
        # the last layer's attention), and XLA copied the pool (1 GiB) to keep them apart.
        pool = (plans,) if planned else (k_pages, v_pages)
        last = h[0, jnp.clip(row_starts + row_lens - 1, 0, h.shape[1] - 1)]   # [rows, hidden]
        logits = model.logits(last[:, None])[:, 0]
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)    # [layers, rows, ...] -> [rows, layers, ...]
        if targets is None:
            return *pool, logits, per_layer(kept)
        # prompt_logprobs: every position's distribution over the token that follows it.
        lp = token_logprobs(model.logits(h)[0], jnp.maximum(targets, 0), full=False)
        return *pool, logits, per_layer(kept), lp

    def _prefill_layer_inputs(self, all_tables, slots, hist_lengths, turn_hist, keep_counts,
                              work_items, table_width) -> tuple:
        """The prefill's per-layer inputs (leading axis layers): the rows' tables of the
        columns attention reads, the tables writes use (the whole table where writes are
        planned), histories, turn starts, keep counts, work items."""
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)    # [rows, layers, ...] -> [layers, rows, ...]
        tables = all_tables[slots]
        return (per_layer(tables[..., :table_width]),
                per_layer(tables if self.plans_prefill_writes else tables[..., :table_width]),
                per_layer(hist_lengths), per_layer(turn_hist), per_layer(keep_counts),
                work_items)

    def _row_scores(self, obs_probs, q, k, v, chunk_len, num_protected, first_position, keep):
        """Scores [num_kv_heads, T] of one compression chunk and the tokens each group keeps
        [groups] (`tangram_jax.compression.chunk_scoring`, by the runner's method; dynamic mode
        decides the count on the device). obs_probs [Hq, obs_window, T]; q, k, v the row's
        [T, heads, d] (padded); first_position: the row's first token position."""
        scores = chunk_scores(self.runner_config.method, obs_probs, q, k, v, chunk_len,
                              num_protected, first_position, q_per_kv=self.config.q_per_kv,
                              inv_freq=self._inv_freq, rule=self.runner_config.scoring_rule)
        if self.runner_config.mode == "dynamic":
            # One count for every head of the layer: under tensor parallelism it is decided
            # over all devices' heads (the selection does not depend on the heads' order).
            every_head = (jax.lax.all_gather(scores, AXIS, axis=0, tiled=True)
                          if self.placement.tp > 1 else scores)
            count = dynamic_keep_count(every_head, chunk_len, num_protected,
                                       self.runner_config.dynamic_ratio,
                                       self.runner_config.dynamic_safeguard)
            return scores, jnp.full(keep.shape, count, jnp.int32)
        return scores, keep

    def _table_width(self, max_tokens: int, *, prefill: bool) -> int:
        """Block-table columns a step passes to attention when rows hold at most `max_tokens`
        retained tokens per group (history plus what the step writes).

        The Pallas decode kernel reads only the pages a row's length covers, and so does the
        CPU path's attention (`xla_attention` walks a row's table in blocks and skips those
        past its length): both get the whole table (one compiled shape). Where attention
        first gathers every column of the rows' tables into a dense history
        (`_reads_dense_history`: precision tiers on the CPU path, quantised pools in the
        Pallas prefill), the width is the pages `max_tokens` needs, rounded up to a power of
        two and at least `_dense_width_floor` pages, so a step dequantises what its rows hold,
        not `max_model_len`, and few widths compile.
        """
        full = int(self.block_tables.shape[-1])
        if not self._reads_dense_history(prefill):
            return full
        pages = -(-max(int(max_tokens), 1) // self.layout.page_size)
        return min(full, max(self._dense_width_floor, backend.next_power_of_2(pages)))

    def _table_widths(self, *, prefill: bool) -> list[int]:
        """Every width `_table_width` returns for prefill (or decode) steps: the shapes
        warm-up compiles."""
        full = int(self.block_tables.shape[-1])
        if not self._reads_dense_history(prefill):
            return [full]
        return _doublings(min(self._dense_width_floor, full), full)

    def _reads_dense_history(self, prefill: bool) -> bool:
        """Whether a step's attention gathers its rows' table columns into a dense history:
        the CPU path over precision tiers (`kv_quant.tiered_dense_history`, prefill and
        decode), and the Pallas prefill over a quantised or tiered pool (`prefill_attention.
        dense_history`: the kernel reads one dense page format)."""
        if self.ops.name == "pallas":
            return prefill and not self.dense_pool
        return self.tiers is not None

    @property
    def _dense_width_floor(self) -> int:
        """The narrowest dense-history width (pages): `_MIN_TABLE_WIDTH` on the CPU path; on
        the Pallas path an eighth of the table rounded up to a power of two (at most 4 widths a
        prefill shape compiles: each adds seconds of warm-up on the 8B model, 50-120 s in all
        on an H100, and a dense history of an eighth of `max_model_len` costs little beside a
        chunk's attention)."""
        if self.ops.name != "pallas":
            return _MIN_TABLE_WIDTH
        return max(_MIN_TABLE_WIDTH,
                   backend.next_power_of_2(-(-int(self.block_tables.shape[-1]) // 8)))

    # ----- decode ---------------------------------------------------------------------------
    _pool_spec = P(None, AXIS)   # every pool array (codes, scales) split on its head axis G

    @staticmethod
    def _decode_attention(q, k, v, k_pages, v_pages, tables, lens, work, terms, *,
                          decode_attention, use_work, tiered=None, high_items=0):
        """One layer's decode attention on one device's heads (all of them without tensor
        parallelism): append the new token's K/V at slot `lens` of every group, attend.
        q [B, 1, Hq, d], k/v [B, 1, Hkv, d] (this device's heads, group-major); k/v_pages
        [num_pages, G, page_size, d] (this device's G); tables [B, groups, P]; lens [B, groups].
        terms: the layer's window and sinks (`_attention_terms`). Returns (out [B, 1, Hq, d],
        k_pages, v_pages).

        tiered: precision tiers (`kv_quant.TieredPages`; tables and lens of tier groups),
        attended by the Pallas decode kernel (``"pallas"``: one launch over both pools, work the
        high tier's `high_items` rows then the low tier's, `SplitMap.tier_work_lists`) or, on
        the CPU path, as one dense history. The token goes to the high tier."""
        batch = lens.shape[0]
        if tiered is None:
            k_pages, v_pages = ModelRunner._append_token(k, v, k_pages, v_pages, tables, lens)
            qg = q[:, 0].reshape(batch, lens.shape[1], -1, q.shape[-1])
            out = decode_attention(qg, k_pages, v_pages, tables, lens + 1,
                                   work if use_work else None, **terms)
            return out.reshape(batch, 1, -1, q.shape[-1]), k_pages, v_pages
        k_high, v_high = ModelRunner._append_token(k, v, k_pages.high, v_pages.high,
                                                   tables[:, 0::2], lens[:, 0::2])
        k_pages = kv_quant.TieredPages(k_high, k_pages.low)
        v_pages = kv_quant.TieredPages(v_high, v_pages.low)
        seen = lens + (jnp.arange(lens.shape[1]) % 2 == 0)        # the new token is high
        qg = q[:, 0].reshape(batch, lens.shape[1] // 2, -1, q.shape[-1])
        if tiered == "pallas":
            out = decode_attention(qg, k_pages, v_pages, tables, seen,
                                   (work[:high_items], work[high_items:]), **terms)
        else:
            out = decode_attention(qg, *kv_quant.tiered_dense_history(
                k_pages, v_pages, tables, seen, jnp.float32), None, **terms)
        return out.reshape(batch, 1, -1, q.shape[-1]), k_pages, v_pages

    @staticmethod
    def _append_token(k, v, k_pages, v_pages, tables, lens):
        """Write each row's new K/V (k/v [B, 1, Hkv, d]) at slot `lens` [B, groups] of its
        groups' pages (tables [B, groups, P]); returns the pools."""
        batch, n_groups = lens.shape
        g, ps = k_pages.shape[1], k_pages.shape[2]
        # Padded rows write into the null page 0, which nothing reads as valid.
        page = jnp.take_along_axis(tables, (lens // ps)[..., None], axis=-1)[..., 0]
        offset = lens % ps
        heads = jnp.arange(g)[None, None, :]
        k_new = k[:, 0].reshape(batch, n_groups, g, -1).astype(k_pages.dtype)
        v_new = v[:, 0].reshape(batch, n_groups, g, -1).astype(v_pages.dtype)
        slots = (page[..., None], heads, offset[..., None])
        return (kv_quant.write_slots(k_pages, slots, k_new),    # quantised if the pool is
                kv_quant.write_slots(v_pages, slots, v_new))

    def decode(self, positions: np.ndarray, slots: np.ndarray, lengths: np.ndarray,
               temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               seeds: np.ndarray, steps: np.ndarray, *, forced_tokens: np.ndarray | None = None,
               logprobs: str | None = None, adjust: LogitsAdjust | None = None,
               ) -> jax.Array | tuple[jax.Array, TokenLogprobs]:
        """One decode step for a padded batch (the bucket is `len(slots)`).

        Each row's input token is its slot's last sampled token (`slot_tokens`, on the device),
        and the token sampled here replaces it, so nothing waits for the host.
        positions: int [B] position of each row's input token; slots: int [B] rows of the block
        table (padded rows: the manager's null slot); lengths: int32 [B, layers, groups]
        retained tokens before this step (pages for the new token already reserved).
        Sampling arrays [B] as in `tangram_jax.sampling`. forced_tokens: int [B], the token row
        i must take (teacher forcing; -1: sample), default none. logprobs: one of
        `LOGPROB_MODES`. adjust: the rows' penalties / min_tokens / min_p (None: nobody's; a
        separately compiled variant). Returns next tokens [B] (device), and with `logprobs` set also their
        `TokenLogprobs` (device arrays, the model's distribution at each row).
        """
        args, static = self._decode_call(self.k_pages, self.v_pages, positions, slots, lengths,
                                         temperature, top_k, top_p, seeds, steps,
                                         forced_tokens, logprobs, adjust)
        self.k_pages, self.v_pages, self.slot_tokens, next_tokens, lp = self._decode(
            *args, **static)
        return next_tokens if logprobs is None else (next_tokens, lp)

    def _decode_call(self, k_pages, v_pages, positions, slots, lengths, temperature, top_k,
                     top_p, seeds, steps, forced_tokens=None,
                     logprobs: str | None = None,
                     adjust: LogitsAdjust | None = None) -> tuple[tuple, dict]:
        """`_decode`'s positional inputs and static arguments (the bucket is `len(slots)`)."""
        bucket = len(slots)
        split_map = self.split_maps.get(bucket) if self.ops.name == "pallas" else None
        if self.ops.name == "pallas" and split_map is None:
            raise ValueError(f"no split map for decode bucket {bucket}; have "
                             f"{sorted(self.split_maps)}")
        _check_logprob_mode(logprobs)
        forced = (np.full(bucket, -1, np.int32) if forced_tokens is None
                  else np.asarray(forced_tokens, np.int32))
        args = (self.state, self.layer_states, k_pages, v_pages, self.slot_tokens,
                np.asarray(positions, np.int32), self.block_tables, np.asarray(slots, np.int32),
                np.asarray(lengths, np.int32), np.asarray(temperature, np.float32),
                np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
                np.asarray(seeds, np.uint32), np.asarray(steps, np.int32), forced, adjust)
        return args, dict(split_map=split_map, logprobs=logprobs,
                          table_width=self._table_width(int(np.max(lengths, initial=0)) + 1,
                                                        prefill=False))

    def _decode_layer_attention(self, split_map) -> Callable:
        """One layer's decode attention (`_decode_attention`) run per device: ``attend(q, k, v,
        k_pages, v_pages, tables, lens, work) -> (out, k_pages, v_pages)``."""
        heads = P(None, None, AXIS, None)          # [B, 1, heads, d]: heads over the devices
        return self.placement.per_device(
            functools.partial(self._decode_attention, decode_attention=self.ops.decode_attention,
                              use_work=split_map is not None,
                              tiered=None if self.tiers is None else self.ops.name,
                              high_items=split_map.tier_work_lists()[0].shape[1]
                              if self.tiers is not None and split_map is not None else 0),
            in_specs=(heads, heads, heads, self._pool_spec, self._pool_spec, P(), P(), P(),
                      self._terms_spec),
            out_specs=(heads, self._pool_spec, self._pool_spec))

    def _decode_impl(self, state, layer_states, k_pages, v_pages, slot_tokens, positions,
                     all_tables, slots, lengths, temperature, top_k, top_p, seeds, steps, forced,
                     adjust, *, split_map, logprobs, table_width):
        model = nnx.merge(self.graphdef, state)
        tokens = slot_tokens[slots]
        block_tables = all_tables[slots][..., :table_width]   # [B, layers, groups, width]
        layout = self.layout
        # The AOT work lists are constants of the trace ([layers, items, 3]); the references
        # take none (a dummy keeps the scan's inputs uniform).
        # With precision tiers each layer's row is the high tier's list then the low tier's.
        work_lists = (jnp.zeros((layout.num_layers, 1, 3), jnp.int32) if split_map is None else
                      jnp.asarray(split_map.work_lists()) if self.tiers is None else
                      jnp.asarray(np.concatenate(split_map.tier_work_lists(), axis=1)))
        attend = self._decode_layer_attention(split_map)

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry
            layer_state, tables, lens, work = xs          # [B, Gn, P], [B, Gn], [items, 3]
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, positions[:, None])
            out, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, tables, lens, work,
                                           self._attention_terms(layer))
            h = layer.finish(h, out.astype(h.dtype))
            return (h, k_pages, v_pages), None

        h = model.embed(tokens[:, None])
        (h, k_pages, v_pages), _ = self._over_layers(
            layer_step, (h, k_pages, v_pages),
            (layer_states, jnp.swapaxes(block_tables, 0, 1), jnp.swapaxes(lengths, 0, 1),
             work_lists))
        logits = model.logits(h)[:, 0]
        next_tokens, lp = _choose_tokens(logits, temperature, top_k, top_p, seeds, steps, forced,
                                         logprobs, adjust, tokens)
        # Padded rows all point at the null slot; whichever write wins there is never read.
        return k_pages, v_pages, slot_tokens.at[slots].set(next_tokens), next_tokens, lp

    # ----- a mixed step: prefill rows and decode rows in one program (the CPU path) -------------
    @property
    def mixes_steps(self) -> bool:
        """Whether a step's last prefill call and its decode rows run as one program (`prefill`
        with `decode`): the CPU path, where the two programs of a mixed step each read every
        weight and walk every layer (a decode step at batch 8 is ~0.15 s of that on the
        embedded model). Not with precision tiers (their attention reads a dense history of a
        per-width table) nor tensor parallelism; the Pallas path keeps its two programs."""
        return self.ops.name == "xla" and self.tiers is None and self.placement.tp == 1

    def _mixed_args(self, prefill_args: tuple, prefill_static: dict, decode_args: tuple,
                    decode_static: dict) -> tuple[tuple, dict]:
        """`_mixed`'s inputs and static arguments from a prefill call's and a decode call's
        (`_prefill_args`, `_decode_call`) over the same pool."""
        (state, layer_states, k_pages, v_pages, flat, positions, row_starts, lens, protected,
         tables, row_slots, hist, keep, items, held_protected, turn_hist) = prefill_args
        (_, _, _, _, slot_tokens, d_positions, _, d_slots, d_lengths, *sampling) = decode_args
        return ((state, layer_states, k_pages, v_pages, slot_tokens, tables, flat, positions,
                 row_starts, lens, protected, row_slots, hist, keep, items, held_protected,
                 turn_hist, d_positions, d_slots, d_lengths, *sampling),
                dict(table_width=prefill_static["table_width"],
                     region_pages=prefill_static["region_pages"],
                     logprobs=decode_static["logprobs"]))

    def _mixed_impl(self, state, layer_states, k_pages, v_pages, slot_tokens, all_tables,
                    tokens, positions, row_starts, row_lens, num_protected, slots, hist_lengths,
                    keep_counts, work_items, held_protected, turn_hist, d_positions, d_slots,
                    d_lengths, temperature, top_k, top_p, seeds, steps, forced, adjust, *,
                    table_width, region_pages, logprobs):
        """A prefill call (`_prefill_impl`'s inputs, N flat tokens) and a decode step
        (`_decode_impl`'s, B rows) in one forward: per layer the projections of all N + B
        tokens in one matmul, the decode rows' attention (their token appended to the pool
        first), the prefill rows' attention over the pool, and o-proj + MLP of all tokens in
        one matmul. Returns (k_pages, v_pages, slot_tokens, next_tokens [B], lp, writes or None,
        prefill logits [rows, vocab], kept [rows, layers, groups]): the decode step's results,
        then the prefill's (`_prefill_impl`: its planned writes, or None where it wrote in
        place). Mixed steps exist where `_table_width` is the whole table, so both parts read
        `table_width` columns.

        Order inside a layer: the decode rows write their token, then both parts read the pool.
        Their pages are disjoint (distinct sequences), but the order matters to XLA: a read
        before a write of the same buffer in one loop iteration makes it copy the pool."""
        model = nnx.merge(self.graphdef, state)
        rows, n = row_starts.shape[0], tokens.shape[0]
        planned = self.plans_prefill_writes
        prefill_attend = self._prefill_layer_attention(rows, n, k_pages, region_pages)
        decode_attend = self._decode_layer_attention(None)
        no_work = jnp.zeros((1, 3), jnp.int32)           # the CPU path's decode takes none
        d_tokens = slot_tokens[d_slots]
        all_positions = jnp.concatenate([positions, d_positions])

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry                     # h [1, N + B, hidden]
            (layer_state, tables, write_tables, hist, turn_hist, keep, items, d_tables,
             d_lens) = xs
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, all_positions[None])     # one GEMM over both parts' tokens
            terms = self._attention_terms(layer)
            d_out, k_pages, v_pages = decode_attend(
                q[0, n:, None], k[0, n:, None], v[0, n:, None], k_pages, v_pages, d_tables,
                d_lens, no_work, terms)
            out, k_pages, v_pages, kept, plans = prefill_attend(
                q[0, :n], k[0, :n], v[0, :n], k_pages, v_pages, tables, write_tables, hist,
                turn_hist, keep, items, row_starts, row_lens, num_protected, held_protected,
                positions, terms)
            out = jnp.concatenate([out, d_out[:, 0].astype(out.dtype)])
            h = layer.finish(h, out[None].astype(h.dtype))
            return (h, k_pages, v_pages), (kept, plans or None)

        h = model.embed(jnp.concatenate([tokens, d_tokens])[None])
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)
        (h, k_pages, v_pages), (kept, plans) = self._over_layers(
            layer_step, (h, k_pages, v_pages),
            (layer_states, *self._prefill_layer_inputs(all_tables, slots, hist_lengths,
                                                        turn_hist, keep_counts, work_items,
                                                        table_width),
             per_layer(all_tables[d_slots][..., :table_width]), per_layer(d_lengths)))
        last = h[0, jnp.clip(row_starts + row_lens - 1, 0, n - 1)]        # [rows, hidden]
        logits = model.logits(jnp.concatenate([last, h[0, n:]])[:, None])[:, 0]
        d_logits = logits[rows:]
        next_tokens, lp = _choose_tokens(d_logits, temperature, top_k, top_p, seeds, steps,
                                         forced, logprobs, adjust, d_tokens)
        return (k_pages, v_pages, slot_tokens.at[d_slots].set(next_tokens), next_tokens, lp,
                plans if planned else None, logits[:rows], per_layer(kept))

    def _call_mixed(self, prefill_args, prefill_static, decode_args, decode_static) -> tuple:
        """Run `_mixed` on the held pool (and apply the prefill's planned writes); returns
        (logits, kept, next_tokens, lp)."""
        args, static = self._mixed_args(prefill_args, prefill_static, decode_args, decode_static)
        (self.k_pages, self.v_pages, self.slot_tokens, next_tokens, lp, writes, logits,
         kept) = self._mixed(*args, **static)
        if writes is not None:
            self.k_pages, self.v_pages = self._apply_writes(self.k_pages, self.v_pages, writes)
        return logits, kept, next_tokens, lp

    # ----- sampling of prefill logits -----------------------------------------------------
    def sample(self, logits: list[jax.Array], slots, temperature, top_k, top_p, seeds,
               steps, *, forced_tokens=None, logprobs: str | None = None,
               adjust: LogitsAdjust | None = None) -> jax.Array | tuple[jax.Array, TokenLogprobs]:
        """Sample the first token of sequences whose prefill just ended (logits: list of [V],
        slots: int [n] their block-table rows, which remember the token for the next decode;
        sampling arrays [n]; forced_tokens, logprobs and adjust (rows [n]) as in `decode`). Rows are padded to a
        power of two (padding rows repeat row 0 and write to the null slot). Returns tokens
        [rows] (device), the first n the samples (and their `TokenLogprobs` when asked)."""
        _check_logprob_mode(logprobs)
        n = len(logits)
        pick = _pad_rows(n)
        rows = lambda x, dtype: np.asarray(x, dtype)[pick]
        padded_slots = rows(slots, np.int32)
        padded_slots[n:] = self.null_slot
        forced = rows(np.full(n, -1) if forced_tokens is None else forced_tokens, np.int32)
        self.slot_tokens, tokens, lp = self._sample_rows(
            self.slot_tokens, jnp.stack([logits[i] for i in pick]), padded_slots,
            rows(temperature, np.float32), rows(top_k, np.int32), rows(top_p, np.float32),
            rows(seeds, np.uint32), rows(steps, np.int32), forced,
            None if adjust is None else LogitsAdjust(*(np.asarray(x)[pick] for x in adjust)),
            logprobs=logprobs)
        return tokens if logprobs is None else (tokens, lp)

    # ----- compile ahead -------------------------------------------------------------------
    def _null_prefill_call(self, rows: int, k_pages, v_pages, num_tokens: int | None = None,
                           region_pages: int | None = None) -> tuple[tuple, dict]:
        """`_prefill` inputs and static arguments of `rows` one-token rows on the null slot,
        whose page 0 is scratch (`prefill` refuses repeated slots; the null slot may repeat:
        it holds nothing), over a flat axis of `num_tokens` (default the largest bucket) and
        turn compactions of `region_pages` (default: what such a call serves with)."""
        zeros = np.zeros(self.counts_shape, np.int32)
        if num_tokens is None:
            num_tokens = (self.prefill_token_buckets(rows) if self.prefill_whole_rows
                          else self.chunk_token_buckets(rows))[-1]
        return self._prefill_args([np.zeros(1, np.int32)] * rows, [0] * rows,
                                  [self.null_slot] * rows, [zeros] * rows, [0] * rows,
                                  num_tokens, k_pages, v_pages, None, region_pages)

    def _null_decode_call(self, bucket: int, k_pages, v_pages) -> tuple[tuple, dict]:
        """`_decode` inputs and static arguments of `bucket` greedy rows on the null slot."""
        return self._decode_call(k_pages, v_pages, np.zeros(bucket, np.int32),
                                 np.full(bucket, self.null_slot, np.int32),
                                 np.zeros((bucket, *self.counts_shape), np.int32),
                                 *_greedy(bucket))

    def compile_steps(self, num_pages, decode_bucket: int, prefill_rows: int) -> dict:
        """Compile (without running, and without a pool in memory) the decode step at
        `decode_bucket` and the prefill step at `prefill_rows` for a pool of `num_pages`
        pages. Returns {"decode": compiled, "prefill": compiled} and, where prefill plans its
        writes, "prefill_writes" (the program that scatters them) (`jax.stages.Compiled`: read
        `memory_analysis()`, `as_text()`). The jitted steps reuse these executables when later
        called with the same shapes."""
        pool = self._pool(num_pages, lambda shape, dtype: jax.ShapeDtypeStruct(
            shape, dtype, sharding=self.placement.pool))
        rows = backend.next_power_of_2(prefill_rows)
        decode_args, decode_static = self._null_decode_call(decode_bucket, *pool)
        prefill_args, prefill_static = self._null_prefill_call(rows, *pool)
        steps = {"decode": self._decode.lower(*decode_args, **decode_static).compile(),
                 "prefill": self._prefill.lower(*prefill_args, **prefill_static).compile()}
        if self.plans_prefill_writes:
            steps["prefill_writes"] = self._compile_apply_writes(prefill_args, prefill_static)
        if self.mixes_steps:
            steps["mixed"] = self._mixed.lower(*self._mixed_args(
                prefill_args, prefill_static, decode_args, decode_static)[0],
                **prefill_static | dict(logprobs=None)).compile()
        return steps

    def _compile_mixed(self, rows: int, num_tokens: int | None, bucket: int, logprobs,
                       region_pages: int | None = None) -> None:
        """Compile `_mixed` for a prefill call of `rows` rows (over `num_tokens` flat tokens,
        whole rows; turn compactions over `region_pages`) beside a decode step of `bucket`
        rows."""
        prefill_args, prefill_static = self._null_prefill_call(rows, self.k_pages, self.v_pages,
                                                               num_tokens, region_pages)
        decode_args, decode_static = self._null_decode_call(bucket, self.k_pages, self.v_pages)
        args, static = self._mixed_args(prefill_args, prefill_static, decode_args,
                                        dict(decode_static, logprobs=logprobs))
        self._mixed.lower(*args, **static).compile()

    def _compile_apply_writes(self, prefill_args, prefill_static):
        """`_apply_writes` compiled for the write plan a prefill call with these arguments
        returns (its shapes do not depend on the table width)."""
        writes = jax.eval_shape(functools.partial(self._prefill, **prefill_static),
                                *prefill_args)[0]
        k_pages, v_pages = prefill_args[2], prefill_args[3]
        return self._apply_writes.lower(k_pages, v_pages, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.placement.replicated),
            writes)).compile()

    def warmup(self, decode_buckets, max_prefill_rows: int, max_first_tokens: int, *,
               logprob_modes=(None,), prompt_logprobs=(False,)) -> None:
        """Compile every step shape serving can meet (decode buckets, prefill row counts and,
        for whole rows, flat-token buckets; where the runner `mixes_steps`, each prefill shape
        beside each decode bucket; first-token sampling row counts) ahead of time, without
        running them: jit reuses these
        executables when serving meets the shapes, so nothing compiles while requests wait
        (running the steps would add nothing but time: on a CPU the reference attention is
        slow).

        logprob_modes: the `LOGPROB_MODES` decode and first-token sampling are compiled for
        (any top-k count up to `MAX_TOP_LOGPROBS` is one "top" variant); prompt_logprobs: the
        prefill variants, without (False) and with (True) prompt log-probabilities. Compiling
        a variant again costs little (jit finds it cached), so a later call may add modes."""
        for mode in logprob_modes:
            _check_logprob_mode(mode)
        for rows in _padded_row_counts(max_prefill_rows):
            # Whole rows: every flat-token bucket a call of `rows` rows can meet.
            buckets = [b for b in self.prefill_token_buckets(rows)
                       if b >= rows * row_alignment(self.prefill_tuning)] \
                if self.prefill_whole_rows else self.chunk_token_buckets(rows)
            # Retention "turn": every region width a turn compaction of the call can read.
            regions = [0] if self.prefill_whole_rows else self._region_widths()
            for num_tokens, region in itertools.product(buckets, regions):
                for width, targets in itertools.product(self._table_widths(prefill=True),
                                                        prompt_logprobs):
                    args, static = self._null_prefill_call(rows, self.k_pages, self.v_pages,
                                                           num_tokens, region)
                    extra = (np.full(args[4].shape[0], -1, np.int32),) if targets else ()
                    self._prefill.lower(*args, *extra,
                                        **dict(static, table_width=width)).compile()
                if self.plans_prefill_writes:
                    self._compile_apply_writes(args, static)
                # This prefill call beside each decode bucket (a mixed step's one program).
                for bucket, mode in itertools.product(
                        decode_buckets if self.mixes_steps else (), logprob_modes):
                    self._compile_mixed(rows, num_tokens, bucket, mode, region)
        for n, mode in itertools.product(_padded_row_counts(max_first_tokens), logprob_modes):
            self._sample_rows.lower(
                self.slot_tokens, jax.ShapeDtypeStruct(
                    (n, self.config.vocab_size), jnp.float32,
                    sharding=self.placement.replicated),
                np.zeros(n, np.int32), *_greedy(n), np.full(n, -1, np.int32), None,
                logprobs=mode).compile()
        for bucket, mode in itertools.product(decode_buckets, logprob_modes):
            for width in self._table_widths(prefill=False):
                args, static = self._null_decode_call(bucket, self.k_pages, self.v_pages)
                self._decode.lower(*args, **dict(static, table_width=width,
                                                 logprobs=mode)).compile()
        # The small ops between the steps, run once: a row of the prefill logits, a stack of
        # rows for `sample`, a block-table write (all dropped: out of range).
        for rows in _padded_row_counts(max_prefill_rows):
            row = jnp.zeros((rows, self.config.vocab_size), jnp.float32,
                            device=self.placement.replicated)[0]
        for n in _padded_row_counts(max_first_tokens):
            jnp.stack([row] * n)
        # Every update size `update_block_tables` pads to (64 and up by powers of two: a long
        # prompt's reservation or a fork writes many entries at once), capped at 2**20 entries.
        most = min(backend.next_power_of_2(self.block_tables.size), 1 << 20)
        for size in (1 << b for b in range(6, max(6, most.bit_length() - 1) + 1)):
            self.block_tables = self._apply_table_updates(
                self.block_tables, np.full(size, self.block_tables.size, np.int32),
                np.zeros(size, np.int32))
        jax.block_until_ready(self.block_tables)


# The narrowest block-table width of the CPU path over precision tiers (pages): shorter rows are
# padded to it, so short contexts share one compiled shape.
_MIN_TABLE_WIDTH = 16
# The held pages a short turn's compaction reads (retention "turn", `_region_widths`): a
# follow-up question and its protected tail fit; a longer turn reads the whole table.
SHORT_REGION_PAGES = 64


class _SwitchedLayer:
    """Layer `index` (a traced scalar) of separate per-layer states, as a `DecoderLayer`'s two
    halves: each half is a `lax.switch` over one branch per layer, which reads that layer's
    weights where they are (a scan over stacked weights copies each layer's out of the stack
    every step: XLA's CPU dots take no dynamic slice). Only the halves are compiled per layer;
    what lies between them (attention) is compiled once, in the scan's body."""

    def __init__(self, graphdef, states, index):
        self.graphdef, self.states, self.index = graphdef, states, index

    def _switch(self, half: str, *args):
        branches = [functools.partial(
            lambda state, *a: getattr(nnx.merge(self.graphdef, state), half)(*a), state)
            for state in self.states]
        return jax.lax.switch(self.index, branches, *args)

    def qkv(self, h, positions):
        return self._switch("qkv", h, positions)

    def finish(self, h, attn):
        return self._switch("finish", h, attn)

    def attention_window(self):
        return self._switch("attention_window")

    def attention_sinks(self):
        return self._switch("attention_sinks")


def _doublings(first: int, last: int) -> list[int]:
    """first, 2 first, 4 first, ... below `last`, then `last`: the sizes a few compiled
    shapes cover."""
    sizes = []
    while first < last:
        sizes.append(first)
        first *= 2
    return sizes + [last]


def _greedy(rows: int) -> tuple[np.ndarray, ...]:
    """Sampling arrays (temperature, top_k, top_p, seeds, steps) of `rows` greedy rows."""
    return (np.zeros(rows, np.float32), np.full(rows, -1, np.int32), np.ones(rows, np.float32),
            np.zeros(rows, np.uint32), np.zeros(rows, np.int32))


def _padded_row_counts(max_rows: int) -> list[int]:
    """Every row count `_pad_rows` makes for 1 .. max_rows rows: 1, 2, 4, ..."""
    return [1 << i for i in range(backend.next_power_of_2(max_rows).bit_length())]


def _pad_rows(n: int) -> list[int]:
    """Row order for `n` rows padded to a power of two by repeating row 0 (few shapes compile)."""
    return list(range(n)) + [0] * (backend.next_power_of_2(n) - n)


def _check_logprob_mode(logprobs) -> None:
    if logprobs not in LOGPROB_MODES:
        raise ValueError(f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")


def _choose_tokens(logits, temperature, top_k, top_p, seeds, steps, forced, logprobs,
                   adjust=None, input_tokens=None):
    """Each row's token (sampled after `adjust`, or forced where ``forced >= 0``) and, with
    `logprobs` set, the model's log-probabilities at that row (computed here on the device)."""
    tokens = force_tokens(sample_tokens(logits, temperature, top_k, top_p,
                                        step_keys(seeds, steps), adjust, input_tokens), forced)
    lp = None if logprobs is None else token_logprobs(logits, tokens, full=logprobs == "full")
    return tokens, lp


def _apply_planned_writes(k_pages, v_pages, writes):
    """Scatter a CPU prefill's planned writes (one (where, rows) per row, stacked over the
    layers) into the pool, in place (the pool is donated)."""
    for where, rows_kv in writes:
        k_pages, v_pages = apply_chunk_writes(k_pages, v_pages, where, rows_kv)
    return k_pages, v_pages


def _reference_write(k_chunk, v_chunk, dest, k_pages, v_pages, block_table, *, max_dirty):
    """`write_chunk_into_pages`'s signature over its pure-jnp scatter (`max_dirty` unused)."""
    from tangram_jax.pallas_kernels.chunk_compress import write_chunk_into_pages_reference
    del max_dirty
    return write_chunk_into_pages_reference(k_chunk, v_chunk, dest, k_pages, v_pages,
                                            block_table)


def _append_only(chunk_dest, k_row, v_row, region_pages: int, page_size: int):
    """`_turn_compaction`'s outputs for a row that only appends (its turn is still held):
    the row's destinations after an unwritten region of `region_pages` pages."""
    rows = region_pages * page_size
    none = jnp.full((chunk_dest.shape[0], rows), -1, chunk_dest.dtype)
    zeros = jnp.zeros((rows, *k_row.shape[1:]), k_row.dtype)
    return (jnp.concatenate([none, chunk_dest], axis=1), jnp.concatenate([zeros, k_row]),
            jnp.concatenate([zeros.astype(v_row.dtype), v_row]))


def _sample_into_slots(slot_tokens, logits, slots, temperature, top_k, top_p, seeds, steps,
                       forced, adjust, *, logprobs):
    tokens, lp = _choose_tokens(logits, temperature, top_k, top_p, seeds, steps, forced, logprobs,
                                adjust)
    return slot_tokens.at[slots].set(tokens), tokens, lp
