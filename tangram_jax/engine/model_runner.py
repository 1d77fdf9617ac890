"""Model runner: the device side of the engine, which executes one step plan at a time.

The runner owns the device state: the model's parameters (KV heads permuted at load time so that
every head group is a contiguous slice) and the one page pool shared by every layer and group::

    k_pages, v_pages: [num_pages, G, page_size, head_dim]

It knows nothing of requests: the engine hands it one `step_plan.StepPlan` a step (token ids,
positions, block-table writes, lengths and sampling arrays, all numpy) and gets device tokens
back (`execute`); fork page copies come separately (`copy_pages`). Everything that builds device
work is here: which prefill rows share a call (`prefill_calls.py`), the decode split maps, the
compiled shapes. Static arguments (chunk size, batch bucket, split map) are the only things a
step is compiled for; nothing is planned at run time in ``tangram`` mode.

The class is spread over one file a concept: this one (construction, pool, block tables, layer
loop, `execute`), `prefill_step.py` (prompt rows), `turn_compaction.py` (retention "turn": a
turn's last row compacts the whole turn), `decode_step.py` (decode, the mixed step, sampling,
split maps) and `step_compiler.py` (ahead-of-time compilation and warm-up).

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
import threading
from collections.abc import Sequence
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from tangram_jax.compression.chunk_scoring import check_scoring_rule, check_served_method
from tangram_jax.engine.config import MODES, SPLIT_MAPS
from tangram_jax.engine.decode_step import (DecodeSteps, _copy_pages, _sample_into_slots,
                                            decode_split_maps)
from tangram_jax.engine.host_offload import HostKVTier
from tangram_jax.engine.prefill_calls import run_prefill_rows
from tangram_jax.engine.prefill_step import PrefillSteps, _apply_planned_writes, _reference_write
from tangram_jax.engine.step_compiler import StepCompilation
from tangram_jax.engine.step_plan import StepPlan, StepResult
from tangram_jax.engine.turn_compaction import TurnCompaction
from tangram_jax import kv_quant
from tangram_jax.kv_layout import KVLayout, TieredLayout, check_local_layers
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder
from tangram_jax.models.head_permutation import permute_kv_heads
from tangram_jax.engine.tensor_parallel import (AXIS, Placement, check_tensor_parallel,
                                                device_major_perm)
from tangram_jax.models.moe import shard_experts
from tangram_jax.models.rope import inverse_frequencies
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.prefill_attention import PREFILL_TUNING, fit_tuning
from tangram_jax.sampling import SlotState, write_penalty_row
from tangram_jax.pallas_kernels.split_map import SplitMap

LAYER_LOOPS = ("scan", "unrolled", "switch")


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
    def for_backend(cls, use_kernels: bool | None = None,
                    pool_format: kv_quant.PoolFormat | None = None) -> "AttentionOps":
        """Pallas kernels where they compile (GPU), the XLA serving path otherwise (CPU). With
        `pool_format` the decode kernel launches with that format's tuning
        (`tuning.DECODE_TUNING`, keyed by the format's name); without, the kernel finds it from
        the pool's arrays."""
        from tangram_jax.pallas_kernels import chunk_compress, decode_attention, prefill_attention
        from tangram_jax.pallas_kernels.tuning import DECODE_TUNING
        if use_kernels is None:
            use_kernels = not backend.default_interpret()
        if use_kernels:
            block_tokens, num_warps = (DECODE_TUNING[pool_format.precision]
                                       if pool_format is not None else (None, None))
            return cls(prefill_attention.ragged_prefill_attention,
                       chunk_compress.write_chunk_into_pages,
                       chunk_compress.compress_chunk_into_pages,
                       lambda q, k, v, bt, ln, work, **terms:
                       decode_attention.ragged_paged_decode_attention(
                           q, k, v, bt, ln, work_list=work, block_tokens=block_tokens,
                           num_warps=num_warps, **terms),
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
      (`ModelRunner.prefill_token_buckets`); None: doublings of the row alignment.
    decode_buckets / num_programs / split_map: the decode batch buckets the runner builds a
      split map for (where it is not handed `split_maps`), the kernel's program target, and
      the map's kind (`config.SPLIT_MAPS`: ``aot`` weighs groups by budget, ``uniform`` cuts
      every row evenly: the ablation baseline).
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
    decode_buckets: tuple[int, ...] = ()
    num_programs: int = 132 * 4
    split_map: str = "aot"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.split_map not in SPLIT_MAPS:
            raise ValueError(f"split_map must be one of {SPLIT_MAPS}, got {self.split_map!r}")
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


class ModelRunner(PrefillSteps, TurnCompaction, DecodeSteps, StepCompilation):
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
      pool_format: what the pool stores (`kv_quant.PoolFormat`, resolved once from
        `EngineConfig.kv_precision`; default bf16): ``bf16`` stores K/V in `kv_dtype`;
        ``k8v8`` / ``k8v4`` / ``k4v2`` store packed codes with per-slot scales
        (`kv_quant.QuantPages`), quantised as the chunk compression and the decode step write
        them and dequantised by the attention kernels. A tiered format
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
                 pool_format: kv_quant.PoolFormat = kv_quant.pool_format("bf16"),
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
        self.pool_format = pool_format
        if pool_format.tiered != (self.tiers is not None) or (
                self.tiers is not None and self.tiers.precision != pool_format.precision):
            raise ValueError(f"pool format {pool_format.precision!r} needs "
                             + ("a TieredLayout of that precision" if pool_format.tiered
                                else "a KVLayout") + f", got {layout.name!r}")
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
        self.ops = ops or AttentionOps.for_backend(pool_format=pool_format)
        if split_maps is None:   # each device attends over its share of every group's heads
            split_maps = decode_split_maps(
                layout, config, model.dtype, runner_config.num_programs,
                runner_config.decode_buckets, group_size=base.group_size // self.placement.tp,
                pool_format=pool_format, kind=runner_config.split_map)
        self.split_maps = dict(split_maps)
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
        check_local_layers(config, layout, runner_config.mode, pool_format.precision,
                           int(table_shape[-1]) * base.page_size)
        head_perm = device_major_perm(base.head_perm, base.group_size, tp)
        self._head_perm = None if np.array_equal(head_perm, np.tile(
            np.arange(base.num_kv_heads), (base.num_layers, 1))) else head_perm
        # Switch on the CPU: unrolled saves the scan's per-layer weight copies (~425 MB a step
        # on the embedded model) but compiles 30 layer bodies per shape (the warm-up of `bench
        # serve`, ~50 shapes, went from ~4 minutes to over 15); the switch loop saves the
        # copies too and compiles the attention once.
        self.layer_loop = runner_config.layer_loop or (
            "unrolled" if self.ops.name == "pallas" else "switch")
        self.kv_dtype = jnp.dtype(kv_dtype or model.dtype)
        self._take_weights(model)
        # Bytes of one page of each tier's pool (one pool untiered) on each device (a page's G
        # heads are split over the devices).
        self.tier_page_bytes = tuple(b // tp for b in pool_format.page_bytes(
            base.group_size, base.page_size, base.head_dim, self.kv_dtype))
        # Tables, lengths and keep counts per (layer, group) or per (layer, tier group).
        self.counts_shape = (layout.num_layers, layout.num_groups)
        # The prefill kernel's tiles, shrunk where this model's dtype and head count would not
        # fit a program's shared memory (float32 models); row packing and work items follow it.
        self.prefill_tuning = fit_tuning(PREFILL_TUNING, config.num_heads // config.num_kv_heads,
                                         config.head_dim, self.kv_dtype.itemsize)
        # What `warmup` compiled: one record a program (name, shape key, seconds, HLO size).
        self.compile_log: list[dict] = []
        self._compiled: dict = {}   # (program, shape key, pool pages) -> jax.stages.Compiled
        # Warm-up's background compiles (`StepCompilation._compile_in_background`): the thread,
        # its jobs by program key, (field, value, pool pages) -> programs still compiling and
        # (field, value) -> the covering value (field: "region_pages" or "bucket",
        # `WarmupProgram.covered_by`).
        self._background = None
        self._background_jobs: dict = {}
        self._compiling: dict = {}
        # Background compiles finished before the pool was allocated (judged then), the keys
        # of those refused for their peak, and the lock between the thread and the pool.
        self._held_compiles: list = []
        self._refused_compiles: list = []
        self._background_lock = threading.Lock()
        self._covered_by: dict = {}
        # The bytes the engine left the steps beside the pool (`memory.PoolPlan.
        # step_room_bytes`; before the pool is sized, the largest warm-up program's peak);
        # None: none set (no memory plan).
        self.step_peak_budget: int | None = None
        self.k_pages = self.v_pages = None
        if num_pages is not None:
            self.allocate_pool(num_pages)
        # Host copies of sessions swapped out of the pool (`host_offload.py`).
        self.host_tier = HostKVTier(self.placement.pool)
        self.block_tables = jnp.zeros(table_shape, jnp.int32, device=self.placement.replicated)
        self.null_slot = int(table_shape[0]) - 1   # the manager's always-empty last row
        self._inv_freq = inverse_frequencies(config)   # Expected Attention's RoPE model
        # The last sampled token of every slot, kept on the device: a decode step reads its
        # input tokens here, so the host can schedule the next step before it has seen them;
        # and each slot's penalty row (`sampling.SlotState`): requests with penalties or
        # min_tokens cost no program of their own, whatever their history's length.
        self.slot_state = SlotState(
            jnp.zeros(table_shape[0], jnp.int32, device=self.placement.replicated),
            jnp.zeros((table_shape[0], config.vocab_size), jnp.int32,
                      device=self.placement.replicated))
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
                               static_argnames=("split_map", "table_width"),
                               donate_argnums=(2, 3))
        self._mixed = jax.jit(self._mixed_impl,
                              static_argnames=("table_width", "region_pages", "logprobs"),
                              donate_argnums=(2, 3, 4))
        self._sample_rows = jax.jit(_sample_into_slots, static_argnames=("logprobs", "greedy"),
                                    donate_argnums=0)

    def _take_weights(self, model: Decoder) -> None:
        """Take `model`'s weights over as the steps read them (`state`, `layer_states`; the
        model is left without its layers). An abstract model (`nnx.eval_shape`: weights are
        `jax.ShapeDtypeStruct`s) gives specs of the same shapes and shardings, enough to
        compile every step; `load_weights` brings the arrays before one runs."""
        abstract = _is_abstract(model)
        if self._head_perm is not None and not abstract:
            permute_kv_heads(model, self._head_perm)
        # The runner takes the layers over: stacked for lax.scan (one layer body is compiled,
        # not num_layers copies: compile time dominates on small models and CPUs), or kept as
        # separate arrays for an unrolled loop (no per-step copies out of a stack on the GPU).
        layers = list(model.layers)
        if self.placement.tp > 1:   # mixture-of-experts layers run expert-parallel over the mesh
            shard_experts(layers, self.placement.mesh)
        self.layer_graphdef = nnx.split(layers[0])[0]
        states = [nnx.split(layer)[1] for layer in layers]
        # Every array the steps take is committed to the devices: jit keys its compiled steps
        # on whether an input is committed, and a step's outputs (the pool, the sampled tokens,
        # the block table) are. Uncommitted inputs at warm-up made every step shape compile
        # again while serving (twice: once more when the pool became a step's output).
        if self.layer_loop == "scan":
            stack = ((lambda *xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype))
                     if abstract else (lambda *xs: jnp.stack(xs)))
            states = jax.tree.map(stack, *states)
        model.layers = nnx.List([])
        self.graphdef, state = nnx.split(model)
        self.state = self.placement.weights(state)
        self.layer_states = self.placement.weights(states, stacked=self.layer_loop == "scan")
        # The steps take the weights as two tuples of arrays, flattened here once: jit flattens
        # an nnx State in Python at every call (~400 variables at 8B: 1.2-1.7 ms of host time
        # a step, on the step's critical path once the device's share is small, as with
        # tensor parallelism). `_weight_trees` rebuilds the States inside the trace.
        self._weight_defs = (jax.tree.structure(self.state),
                             jax.tree.structure(self.layer_states))
        self.weight_args = (tuple(jax.tree.leaves(self.state)),
                            tuple(jax.tree.leaves(self.layer_states)))

    def _weight_trees(self, state_leaves, layer_leaves):
        """(state, layer_states) from a step's `weight_args` (inside the trace)."""
        return (jax.tree.unflatten(self._weight_defs[0], state_leaves),
                jax.tree.unflatten(self._weight_defs[1], layer_leaves))

    def load_weights(self, model: Decoder) -> None:
        """Take the weights of `model` over (loaded for the architecture, dtype and
        shapes the runner was built with, abstractly or not): the compiled steps stay valid."""
        def specs():
            return (self.graphdef, self.layer_graphdef,
                    jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding),
                                 (self.state, self.layer_states)))
        built = specs()
        self._take_weights(model)
        if specs() != built:
            raise ValueError("load_weights: the model's weights differ from those the runner "
                             "was built for (architecture, shapes, dtype or placement)")

    def weight_bytes(self) -> int:
        """Bytes of the weights on each device (a sharded weight counts its shard)."""
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves((self.state, self.layer_states)))

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
        self._judge_held_compiles()   # against the room this pool left (`step_peak_budget`)

    def _pool(self, num_pages, make):
        """(k_pages, v_pages) of the runner's page format(s); `make(shape, dtype)` builds each
        array (zeros on the runner's devices, or a `jax.ShapeDtypeStruct` spec)."""
        return kv_quant.allocate_pools(self.pool_format.page_formats,
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
        # One jitted layer body called once a layer: it is traced and lowered once a program,
        # not once a layer (lowering the unrolled steps was most of a warm start), and XLA
        # inlines the calls, so what is compiled and run is the same unrolled program.
        body = jax.jit(layer_step)
        ys = []
        for i, layer_state in enumerate(layer_states):
            carry, y = body(carry, (layer_state, *(x[i] for x in rest)))
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

    # ----- one engine step --------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step's device work (`step_plan`): the block-table writes, the prefill rows
        (`prefill_calls.run_prefill_rows`) with the decode rows beside the last call, then the
        first tokens of the prompts that ended. Nothing here waits for the device but
        ``dynamic`` mode's retained counts."""
        self.move_host_kv(plan.host_transfers)
        self.update_block_tables(*plan.table_updates)
        for rows in (plan.decode, plan.first_tokens):
            if rows is not None:
                self.write_penalty_rows(rows.sampling.penalty_rows)
        last_logits, retained, prompt_lp, decoded = run_prefill_rows(
            self, plan.prefill, plan.max_prefill_rows, plan.decode)
        result = StepResult(prompt_logprobs=prompt_lp,
                            retained=retained if self.runner_config.mode == "dynamic" else None)
        if plan.decode is not None:
            asked = plan.decode.sampling.logprobs is not None
            result.decode_tokens, result.decode_logprobs = decoded if asked else (decoded, None)
        first = plan.first_tokens
        if first is not None and first.sources:
            out = self.sample([last_logits[i] for i in first.sources], list(first.slots),
                              *first.sampling.arrays(), **first.sampling.options())
            asked = first.sampling.logprobs is not None
            result.first_tokens, result.first_logprobs = out if asked else (out, None)
        return result

    def write_penalty_rows(self, rows) -> None:
        """Write slots' penalty rows from the host (`step_plan.PenaltyRow`s), before the step
        samples with them."""
        for r in rows:
            self.slot_state = write_penalty_row(self.slot_state, np.int32(r.slot),
                                                 np.asarray(r.row, np.int32),
                                                 np.int32(r.pending))

    def move_host_kv(self, transfers) -> None:
        """Run the host tier's moves (`scheduler.host_pool.HostTransfer`s, in order) against
        the pool: copies to host memory of pages being freed, copies back into fresh pages."""
        self.k_pages, self.v_pages = self.host_tier.apply(self.k_pages, self.v_pages, transfers)

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Overwrite pool pages `dst` with pages `src` (int32 [n]): the partly filled pages a
        fork (parallel samples) copies (`KVCacheManager.take_page_copies`), queued before any
        forked sequence decodes. With precision tiers the copies are of the high tier's pool
        (the decode tier's page ids). Padded to a power of two from 8 (few compiled sizes)."""
        if len(src) == 0:
            return
        size = max(8, backend.next_power_of_2(len(src)))
        pad = size - len(src)
        num_pages = self.num_pages if self.tiers is None else self.num_pages[0]
        self.k_pages, self.v_pages = _copy_pages(
            self.k_pages, self.v_pages,
            np.concatenate([np.asarray(src, np.int32), np.zeros(pad, np.int32)]),
            np.concatenate([np.asarray(dst, np.int32), np.full(pad, num_pages, np.int32)]))


def _is_abstract(model) -> bool:
    """Whether `model`'s weights are `jax.ShapeDtypeStruct`s (`nnx.eval_shape`)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))


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
