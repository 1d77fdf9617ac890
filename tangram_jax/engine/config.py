"""Engine configuration: the fields users set, their validation, their CLI flags, and
`EngineConfig.resolve`, the one place every derived setting is computed.

The three modes are configurations of the same manager, runner and kernels:

=========  =============================  ================  ==============================
mode       layout                         manager policy    per-chunk kept tokens
=========  =============================  ================  ==============================
full       monolithic (all heads, r = 1)  reserve           all of them
dynamic    monolithic (all heads, r = 1)  reclaim           per-input top-k, then reclaim
tangram    calibrated groups of G         reserve           ``ceil(r_g * n)`` per group
=========  =============================  ================  ==============================

Every field is declared with `_field(default, check, help)` (`config_fields.py`): `check`
validates and normalises the value (numpy scalars become Python numbers; an error names the
field, the value and what is allowed) and `help` is its CLI help. `add_cli_args` generates one
flag per field from the same declarations (as vLLM's `EngineArgs.add_cli_args`), so a new field
is one declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from tangram_jax.compression.profile import BudgetProfile, shipped_profile
from tangram_jax.engine.config_fields import (EngineConfigError, _buckets, _cache_folder,
                                              _chat_template, _choice, _field, _flag, _fraction,
                                              _generation_config, _host_port, _int_at_least,
                                              _model, _profile, _tier_turn)
from tangram_jax.engine.tensor_parallel import check_tensor_parallel
from tangram_jax.compression.chunk_scoring import (SCORING_RULE_CHOICES, TURN_METHODS,
                                                   resolve_scoring_rule)
from tangram_jax.kv_layout import (PRECISION_TIERS, RETENTIONS, TAIL_RULES, TURN_VIEWS,
                                   KVLayout, TieredLayout, check_local_layers, pages_for)
from tangram_jax.kv_quant import SERVED_PRECISIONS, PoolFormat, pool_format

# Page formats of a pool, and precision tiers (a high and a low tier, `kv_layout.TieredLayout`).
from tangram_jax.models.config import ModelConfig
from tangram_jax.host_memory import default_host_kv_cache_bytes, host_memory_bytes
from tangram_jax.models.registry import DTYPES
from tangram_jax.decode_buckets import DEFAULT_DECODE_BUCKETS

MODES = ("tangram", "full", "dynamic")
# How the decode kernel's work is cut across head groups (`pallas_kernels/split_map.py`): the
# ahead-of-time map from the budgets (Tangram), or the same splits for every group (the ablation's
# FlashDecoding-style baseline, with as many work items per row as the AOT map).
SPLIT_MAPS = ("aot", "uniform")
RETENTION_CHOICES = ("auto",) + RETENTIONS
LAYER_LOOPS = ("scan", "unrolled", "switch")
# Defaults of the prefill knobs when `chunk_size` / `max_num_batched_tokens` are not given.
# The compression chunk is the same on every backend, so a CPU and a GPU make the same
# retention decisions for the same input (the CPU pays in speed, not in accuracy): 2048
# tokens, where tangram prefills 1.2x / 1.7x faster than with 256-token chunks at 32k / 100k
# on an H100 (`benchmarks/results/prefill_8b.json`). The token budget of a step is by backend:
# 8192 is vLLM's on large GPUs; on a CPU a step holds one chunk and the decode batch.
DEFAULT_CHUNK_SIZE = 2048
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"gpu": 8192, "cpu": 512}
# A tiered pool's smallest num_pages: each tier's null page and one page.
TIERED_MIN_PAGES = 4
# The answer of the default typical turn a tiered pool is split for (`kv_tier_turn`): a chat
# answer (SCBench's multi-turn tasks answer in ~128 tokens; a few hundred is a long one), at
# most an eighth of the sequence (a short max_model_len is not mostly answer).
DEFAULT_TIER_ANSWER_TOKENS = 256
DEFAULT_KV_CACHE_TOKENS = 16384    # the pool where nothing sizes it (CPU, no allocator cap)
# Long prefills (the scheduler's `long_prefill_token_threshold` / `max_long_partial_prefills`).
# Default: one long turn prefills at a time (vLLM's default too), and the threshold is the
# budget shared by the long turns allowed at once (max_num_batched_tokens / that number, in whole
# compression chunks). Why: a follow-up is protected by the scheduler's order (short turns take
# their pieces before long ones, one chunk per long turn kept back), not by the cap, so a lone
# long turn may use the rest of every step; capping it lower only stretches its prefill over
# more steps (tiny engine, 8 slots, three 200-token first turns queued with a 64-token budget
# and three 8-token follow-ups arriving: the long turns' first tokens at steps 6 / 12 / 18 with
# a half-budget cap against 3 / 7 / 11 without, and 3 / 6 / 10 on the old scheduler, which
# served the follow-ups after them: at step 7-9 instead of 2). One at a time keeps first turns
# in arrival order (the lowest mean time to first token for equal turns) and reserves pages for
# one long turn, not for several that would wait for the budget; with more at once they share
# each step evenly.
DEFAULT_MAX_LONG_PARTIAL_PREFILLS = 1


def _backend_kind(gpu_memory_utilization: float) -> str:
    """"gpu" or "cpu": which column of the backend-dependent defaults applies. Asking starts
    JAX's backend, which fixes its GPU allocator cap for the process: the engine's cap
    (`gpu_memory_utilization`) is set first, or a config checked before the Engine is built
    would leave the Engine JAX's default 0.75 of the card."""
    import jax

    from tangram_jax.engine import memory
    memory.configure_allocator(gpu_memory_utilization)
    return "cpu" if jax.default_backend() == "cpu" else "gpu"


@dataclasses.dataclass
class EngineConfig:
    """Everything an `Engine` is built from (vLLM's engine args, Tangram's additions).

    Each field's meaning is its `help` below; `resolve` turns the fields into the settings the
    engine runs with (model-dependent defaults, minimums, the layout and the pool size).
    """

    model: str | None = _field(
        None, _model, "model: 'smollm2' (the embedded SmolLM2-135M, default), a Hugging Face "
        "folder or a .gguf file")
    mode: str = _field("tangram", _choice(MODES),
                       "KV handling: calibrated non-uniform budgets (tangram), uncompressed "
                       "(full), or per-input selection with reclaim (dynamic)")
    profile: Any = _field(None, _profile,
                          "budget profile file (default: the shipped one of the embedded model "
                          "at --ratio and --group-size; required for other models in tangram mode)")
    ratio: float = _field(0.5, _fraction,
                          "target retention rho in (0, 1]: of the shipped profile (tangram) or of "
                          "the per-input selection (dynamic); shipped profiles: 0.5, 0.25")
    group_size: int | None = _field(None, _int_at_least(1, optional=True),
                                    "KV heads per group G (regroups the profile; default: the "
                                    "profile's)")
    dtype: str = _field("auto", _choice(DTYPES), "model weights and KV pool dtype (auto: the "
                        "checkpoint's, see models.registry)")
    page_size: int = _field(16, _int_at_least(1), "tokens per KV page")
    chunk_size: int | None = _field(
        None, _int_at_least(1, optional=True),
        f"prefill piece size (and the compression chunk of retention 'chunk'), tokens; default "
        f"{DEFAULT_CHUNK_SIZE} on every backend")
    num_pages: int | None = _field(None, _int_at_least(2, optional=True),
                                   "KV pool pages (page 0 is the null page); with precision tiers "
                                   "the pages of both tiers' pools together, each with its null "
                                   "page, split by the high tier's share of the retained tokens "
                                   "(at least 4); default: sized from --kv-cache-tokens")
    kv_cache_tokens: int | None = _field(
        None, _int_at_least(1, optional=True),
        "full-KV tokens' worth of memory the pool gets when --num-pages is not given (the same "
        "bytes in every mode); default: on a GPU what --gpu-memory-utilization leaves after the "
        f"weights and the largest step (engine/memory.py), elsewhere {DEFAULT_KV_CACHE_TOKENS}")
    kv_cache_memory_bytes: int | None = _field(
        None, _int_at_least(1, optional=True),
        "bytes of KV pool (on each device), in the pool's own page format: a quantised or "
        "tiered --kv-precision holds more tokens in them (vLLM's kv_cache_memory_bytes); "
        "instead of --num-pages / --kv-cache-tokens / --gpu-memory-utilization's sizing")
    host_kv_cache_bytes: int | None = _field(
        None, _int_at_least(0, optional=True),
        "host memory for idle sessions' KV swapped out of the pool, bytes (vLLM's swap_space / "
        "kv_offloading_size): an evicted session is copied there and back instead of "
        "re-prefilled when that is cheaper; 0 turns the host tier off; default: a quarter of "
        "the machine's memory, at most 16 GiB, shared by the data-parallel replicas "
        "(host_memory.py)")
    max_num_seqs: int = _field(16, _int_at_least(1), "concurrent sequence slots")
    max_num_batched_tokens: int | None = _field(
        None, _int_at_least(1, optional=True),
        f"tokens per step (decode + prefill); at least max_num_seqs + chunk_size; default "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['gpu']} on a GPU, {DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} "
        f"on a CPU, or that minimum if larger")
    long_prefill_token_threshold: int | None = _field(
        None, _int_at_least(1, optional=True),
        "a turn with more tokens than this to prefill when admitted is long: shorter turns take "
        "their pieces of a step first, and a long turn at most this many tokens of a step "
        "(vLLM's long_prefill_token_threshold); between chunk_size and max_num_batched_tokens; "
        "default max_num_batched_tokens / max_long_partial_prefills in whole chunks")
    max_long_partial_prefills: int = _field(
        DEFAULT_MAX_LONG_PARTIAL_PREFILLS, _int_at_least(1),
        "long turns (see --long-prefill-token-threshold) prefilling at once; shorter turns go "
        "ahead of the others (vLLM's max_long_partial_prefills)")
    max_model_len: int | None = _field(None, _int_at_least(2, optional=True),
                                       "longest sequence, prompt + output (default: the model's "
                                       "context length)")
    decode_buckets: tuple[int, ...] = _field(
        DEFAULT_DECODE_BUCKETS, _buckets,
        "batch sizes the decode step is compiled for (comma-separated); sizes above max_num_seqs "
        "beyond the first are dropped")
    prefill_token_buckets: tuple[int, ...] | None = _field(
        None, lambda name, value: None if value is None else _buckets(name, value),
        "flat-token sizes a prefill call of whole rows (full KV on a GPU) is padded to, each "
        "compiled once (comma-separated; rounded up to the kernel's row alignment, "
        "max_num_batched_tokens always added). Default: doublings of the alignment (half a call "
        "padding at most, 8 shapes at 8192 tokens); more sizes pad less and compile longer")
    num_programs: int = _field(132 * 4, _int_at_least(1),
                               "concurrent programs the decode kernel's split map is sized "
                               "for (bf16 pages; a quantised format scales it by its measured "
                               "`tuning.DECODE_PROGRAM_SCALE`)")
    obs_window: int = _field(32, _int_at_least(1),
                             "observation window of the compression scorer (capped at chunk_size)")
    seed: int = _field(0, _int_at_least(0), "engine seed: seeds requests that bring no seed of "
                       "their own, per (seed, request id), as vLLM's seed")
    generation_config: str = _field(
        "auto", _generation_config,
        "default sampling parameters of requests that bring none (vLLM's generation_config): "
        "auto, the model's (a HF folder's generation_config.json, a GGUF's general.sampling.* "
        "metadata; vLLM's defaults where it has none), vllm (vLLM's defaults: temperature 1, "
        "16 tokens), or a folder whose generation_config.json to use "
        "(models.generation_config)")
    chat_template: str | None = _field(
        None, _chat_template,
        "chat template used in place of the model's own (vLLM's --chat-template): a Jinja file "
        "path or the template text; needed by models that ship none")
    async_scheduling: bool = _field(
        True, _flag(), "learn each step's tokens one step late so the host schedules step N+1 "
        "while the device runs step N (vLLM's async_scheduling)")
    layer_loop: str | None = _field(None, _choice(LAYER_LOOPS, optional=True),
                                    "layer loop of the runner: scan, unrolled or switch "
                                    "(default: unrolled on a GPU, switch on a CPU)")
    max_prefill_rows: int = _field(1, _int_at_least(1),
                                   "prefill chunks of different sequences run together in one "
                                   "call (more rows: fewer calls, longer compiles)")
    warmup: bool | None = _field(None, _flag(optional=True),
                                 "compile every step shape when the engine is built (default: on "
                                 "a GPU only)")
    background_compile: bool = _field(
        True, _flag(), "with warm-up, compile the programs a wider one can stand in for (decode "
        "buckets below the largest, prefill token buckets but the largest and the first of "
        "1024 tokens, the turn compaction's regions but the whole table's) after the "
        "engine is ready, on one background thread; until each is, its calls run the wider "
        "program, padded (the same tokens, more work)")
    gpu_memory_utilization: float = _field(
        0.9, _fraction, "share of the GPU the engine may use (vLLM's meaning): sets JAX's "
        "allocator cap when the engine starts JAX's GPU backend, and sizes the KV pool when "
        "neither --num-pages nor --kv-cache-tokens is given")
    compile_cache_dir: str | None = _field(
        None, _cache_folder, "JAX's persistent compilation cache folder ('' or 'off': none); "
        "default: $TANGRAM_JAX_COMPILE_CACHE or ~/.cache/tangram_jax/jax")
    tensor_parallel_size: int = _field(
        1, _int_at_least(1), "devices one engine spans: every KV head group's heads are split "
        "between them (Megatron-style projections, one KV pool shard per device, one block "
        "table); must divide the head counts and the layout's group size")
    kv_precision: str = _field("bf16", _choice(SERVED_PRECISIONS),
                               "KV page format (kv_quant): bf16 (the pool dtype), or keys / values "
                               "quantised to 8/8, 8/4 or 4/2 bits with a per token-and-head scale "
                               "and zero (k8v8, k8v4, k4v2); with num_pages / kv_cache_tokens the "
                               "pool keeps its page count, on a GPU it gets more pages for the "
                               "same bytes; k8v4-k4v2: precision tiers (tangram mode, a profile "
                               "with tier budgets): each group's top kept tokens in K8V4 pages, "
                               "the rest in K4V2 pages, each tier a pool of its own split by the "
                               "high tier's share of the retained tokens")
    data_parallel_size: int = _field(
        1, _int_at_least(1), "engine replicas, one per device, that share an offline batch "
        "(`LLM`: prompts spread by tokens, a session stays on its replica); each replica "
        "loads the weights and sizes its own KV pool on its device")
    distributed_coordinator: str | None = _field(
        None, _host_port, "several hosts: 'host:port' of process 0's coordination service; "
        "setting it, --num-processes or --process-id makes the engine call "
        "jax.distributed.initialize (fields left unset: JAX's own, from JAX_COORDINATOR_ADDRESS, "
        "Slurm, Open MPI or Cloud TPU); every process then runs the same command, its replicas "
        "on its own devices, and an offline batch is split over all processes' replicas (LLM)")
    num_processes: int | None = _field(None, _int_at_least(1, optional=True),
                                       "several hosts: how many processes take part (see "
                                       "--distributed-coordinator)")
    process_id: int | None = _field(None, _int_at_least(0, optional=True),
                                    "several hosts: this process's index, 0 .. num_processes - 1 "
                                    "(see --distributed-coordinator)")
    kv_tier_turn: tuple[int, int] | None = _field(
        None, _tier_turn,
        "precision tiers: PROMPT,ANSWER tokens of the typical turn the tiers' pools are split "
        "for (its protected tail and its answer go to the high tier, so short turns and long "
        "answers need a larger high pool: TieredLayout.pool_high_share); default: one "
        "max_model_len sequence ending in a 256-token answer (at most max_model_len / 8)")
    split_map: str = _field("aot", _choice(SPLIT_MAPS),
                            "decode work split across head groups: ahead of time from the budgets "
                            "(aot) or the same for every group (uniform; an ablation baseline); "
                            "the GPU kernels only")
    tail_rule: str = _field("window", _choice(TAIL_RULES),
                            "which end of every turn stays uncompressed until it is answered "
                            "(kv_layout.TAIL_RULES): the last obs_window tokens (window), the "
                            "turn's final chunk (final_chunk), or none")
    retention: str = _field(
        "auto", _choice(RETENTION_CHOICES),
        "how a turn is compressed (kv_layout.RETENTIONS): turn (its chunks are held whole "
        "while it is prefilled and its last chunk compresses the whole turn, scored by its own "
        "question: SnapKV as published; a long prefill borrows uncompressed pages while it "
        "runs) or chunk (each chunk keeps a fixed share of its own, scored before the turn's "
        "question exists); auto: turn, except chunk for precision tiers, dynamic mode (the "
        "per-input method as published) and profiles calibrated with a method the whole-turn "
        "compression does not serve (chunk_scoring.TURN_METHODS)")
    turn_view: str = _field(
        "recent", _choice(TURN_VIEWS),
        "under retention turn, what a held turn's chunks before its last attend to "
        "(kv_layout.TURN_VIEWS): every held token (whole) or the turn's first page and its "
        "most recent max(chunk, ratio x held) tokens (recent: about the attention work of "
        "retention chunk); the last chunk, which scores the turn, attends to all of it")
    scoring_rule: str = _field(
        "auto", _choice(SCORING_RULE_CHOICES),
        "which queries rank a compressed chunk's tokens (chunk_scoring.SCORING_RULES): the "
        "observation window (window: the turn's question for a whole-turn chunk), or half of "
        "each head's count by the window and half by a question-agnostic score: queries "
        "spread over the chunk (window+context) or KeyDiff (window+keydiff), for what a later "
        "turn asks; auto: under retention turn the window (pooled wide enough to keep every "
        "sentence the question matches: chunk_scoring.TURN_POOL_KERNEL), under retention "
        "chunk window+keydiff for profiles that keep less than half, else window (measured "
        "on the embedded model: chunk_scoring.AUTO_KEYDIFF_BELOW_RATIO); tangram "
        "mode (dynamic counts with the window's scores)")

    def __setattr__(self, name, value):
        # Every assignment is checked, the constructor's and later ones alike.
        f = _FIELDS.get(name)
        if f is None:
            raise AttributeError(f"EngineConfig has no field {name!r}")
        super().__setattr__(name, f.metadata["check"](name, value))

    def resolved_retention(self, method: str = "snapkv") -> str:
        """`retention`, or for "auto" turn, except chunk with precision tiers, in dynamic mode
        and for a profile calibrated with a `method` the whole-turn compression does not serve
        (`chunk_scoring.TURN_METHODS`)."""
        if self.retention != "auto":
            return self.retention
        chunk = (self.kv_precision in PRECISION_TIERS or self.mode == "dynamic"
                 or method not in TURN_METHODS)
        return "chunk" if chunk else "turn"

    def resolved_chunk_size(self) -> int:
        """`chunk_size`, or `DEFAULT_CHUNK_SIZE` (the same on every backend)."""
        return self.chunk_size or DEFAULT_CHUNK_SIZE

    def __post_init__(self):
        # The rules between fields, at construction as vLLM's configs do.
        self._check_together(self.chunk_size or DEFAULT_CHUNK_SIZE)

    def check(self) -> None:
        """The rules between fields that need no model (each field alone was checked when it
        was set); `Engine` calls this before loading the model, so such errors come at once.
        The constructor checks them too (with the smallest default where chunk_size is None)."""
        self._check_together(self.resolved_chunk_size())

    def _check_together(self, chunk: int) -> None:
        """The rules between fields; `chunk`: the compression chunk (or a lower bound of it)."""
        if self.retention == "turn" and self.kv_precision in PRECISION_TIERS:
            raise EngineConfigError(f"retention 'turn' does not serve precision tiers "
                                    f"(kv_precision {self.kv_precision!r}): each chunk's kept "
                                    f"tokens are split between the tiers by rank as it is "
                                    f"written; use retention 'chunk' or 'auto'")
        if self.retention == "turn" and self.mode == "dynamic":
            raise EngineConfigError("retention 'turn' is a static-budget rule; dynamic mode "
                                    "counts per chunk (the per-input method as published): "
                                    "use retention 'chunk' or 'auto'")
        if self.mode == "dynamic" and self.scoring_rule not in ("window", "auto"):
            raise EngineConfigError(f"scoring_rule {self.scoring_rule!r} needs tangram or full "
                                    f"mode: dynamic mode counts with Ada-SnapKV's scores, its "
                                    f"scoring_rule must be 'window' (or 'auto', which serves "
                                    f"'window' there)")
        self._check_token_budget(chunk)
        if self.mode != "tangram" and self.profile is not None:
            raise EngineConfigError(f"profile is only used in tangram mode, got mode {self.mode!r} "
                                    f"with profile {self.profile!r}")
        check_precision(self.mode, self.kv_precision, "EngineConfig")
        if self.kv_tier_turn is not None and self.kv_precision not in PRECISION_TIERS:
            raise EngineConfigError(f"kv_tier_turn={self.kv_tier_turn} splits a tiered pool; "
                                    f"kv_precision {self.kv_precision!r} has no tiers (one of "
                                    f"{tuple(PRECISION_TIERS)})")
        if self.page_size % 2 and any(f.slot_pairs for f in
                                      pool_format(self.kv_precision).page_formats):
            raise EngineConfigError(
                f"page_size={self.page_size}: kv_precision {self.kv_precision!r} stores K4V2 "
                f"pages as slot pairs (two slots' codes in each 16-bit unit), which need an even "
                f"page_size")
        check_tiered_num_pages(self)
        host_memory = host_memory_bytes()
        if self.host_kv_cache_bytes is not None and host_memory is not None \
                and self.host_kv_cache_bytes > host_memory:
            raise EngineConfigError(
                f"host_kv_cache_bytes={self.host_kv_cache_bytes} exceeds this machine's memory "
                f"({host_memory} bytes): give at most that (0 turns the host tier off)")
        if self.kv_cache_memory_bytes is not None and (self.num_pages is not None
                                                       or self.kv_cache_tokens is not None):
            raise EngineConfigError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} sizes the KV pool, and so "
                f"do num_pages={self.num_pages} / kv_cache_tokens={self.kv_cache_tokens}: give "
                f"one of the three")

    def _check_token_budget(self, chunk: int) -> None:
        """max_num_batched_tokens and long_prefill_token_threshold against the chunk size."""
        # The scheduler's budget must fit a whole decode batch plus one prefill chunk, so that
        # prefill always progresses.
        minimum = self.max_num_seqs + chunk
        default = "" if self.chunk_size else (
            f" (chunk_size's default: {DEFAULT_CHUNK_SIZE})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < minimum:
            raise EngineConfigError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is below max_num_seqs + "
                f"chunk_size = {self.max_num_seqs} + {chunk} = {minimum}{default} (a step must "
                f"hold a full decode batch plus one prefill chunk); raise max_num_batched_tokens "
                f"or lower chunk_size / max_num_seqs")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (threshold < chunk or (
                self.max_num_batched_tokens is not None
                and threshold > self.max_num_batched_tokens)):
            top = self.max_num_batched_tokens or "max_num_batched_tokens"
            raise EngineConfigError(
                f"long_prefill_token_threshold must lie in [chunk_size, max_num_batched_tokens]"
                f" = [{chunk}, {top}]{default}, got {threshold} (a long prefill progresses by "
                f"whole compression chunks)")

    def resolve(self, model_config: ModelConfig, *, is_embedded: bool = False) -> "ResolvedConfig":
        """Every setting derived from the fields and the model, computed once (the engine, the
        scheduler and the CLI read these, never their own copies of the rules)."""
        mc = model_config
        max_model_len = self.max_model_len or int(mc.max_position_embeddings)
        if max_model_len > mc.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {max_model_len} exceeds the model's context "
                                    f"length {mc.max_position_embeddings}")
        self.check()
        chunk = self.resolved_chunk_size()
        minimum = self.max_num_seqs + chunk
        batched = self.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS[_backend_kind(self.gpu_memory_utilization)], minimum)
        long_threshold = self.long_prefill_token_threshold
        if long_threshold is None:
            long_threshold = max(chunk, batched // self.max_long_partial_prefills // chunk * chunk)
        elif long_threshold > batched:
            raise EngineConfigError(f"long_prefill_token_threshold {long_threshold} exceeds "
                                    f"max_num_batched_tokens {batched}")
        # Buckets below max_num_seqs, then the first that holds max_num_seqs rows.
        buckets = [b for b in self.decode_buckets if b < self.max_num_seqs]
        buckets.append(next((b for b in self.decode_buckets if b >= self.max_num_seqs),
                            self.max_num_seqs))
        obs_window = min(self.obs_window, chunk)
        # Every turn's tail (the question) stays uncompressed until it is answered: the
        # retention rule of `tangram_jax.kv_layout`, which reservation, prefill and the engine
        # all read from the layout.
        # The profile is read once: it gives the layout and the method the compression serves.
        profile = resolve_profile(self, mc, is_embedded) if self.mode == "tangram" else None
        method = profile.method if profile is not None else "snapkv"
        retention = self.resolved_retention(method)
        if retention == "turn" and self.mode == "tangram" and method not in TURN_METHODS:
            raise EngineConfigError(f"retention 'turn' scores with one of {TURN_METHODS}; the "
                                    f"profile was calibrated with {method!r} (use retention "
                                    f"'chunk' or 'auto', or a profile of another method)")
        try:
            scoring_rule = resolve_scoring_rule(self.scoring_rule, self.mode,
                                                profile.rho if profile is not None else None,
                                                retention)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        layout = build_layout(self, mc, is_embedded, profile=profile).with_tail(
            self.tail_rule, obs_window).with_retention(retention, self.turn_view)
        if self.kv_precision in PRECISION_TIERS:   # mode is tangram (`check`)
            layout = tiered_layout(self, profile, layout, max_model_len)
        try:   # every KV head group is split over the tensor-parallel devices
            check_tensor_parallel(self.tensor_parallel_size, num_heads=mc.num_heads,
                                  num_kv_heads=mc.num_kv_heads, group_size=layout.group_size,
                                  intermediate_size=mc.intermediate_size,
                                  num_experts=mc.moe.num_experts if mc.moe else None)
            # Local (sliding-window) layers keep every token (`kv_layout`, "Local layers").
            check_local_layers(mc, layout, self.mode, self.kv_precision, max_model_len)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        return ResolvedConfig(
            layout=layout, pool_format=pool_format(self.kv_precision),
            num_pages=pool_pages(self, mc, layout), max_model_len=max_model_len,
            max_num_batched_tokens=batched, decode_buckets=tuple(buckets),
            long_prefill_token_threshold=long_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
            max_pages_per_seq=int(pages_for(max_model_len, self.page_size)) + 1,
            obs_window=obs_window,
            compression_method=method, scoring_rule=scoring_rule,
            # The default is the machine's: data-parallel replicas (engines) share it.
            host_kv_cache_bytes=(default_host_kv_cache_bytes() // self.data_parallel_size
                                 if self.host_kv_cache_bytes is None
                                 else self.host_kv_cache_bytes),
            policy="reclaim" if self.mode == "dynamic" else "reserve")


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """The settings an engine runs with (see `EngineConfig.resolve`)."""

    layout: KVLayout | TieredLayout   # tiered: kv_precision names precision tiers
    pool_format: PoolFormat      # what the pool stores (kv_precision, resolved once)
    num_pages: int | tuple[int, int]   # KV pool pages, null page included; tiered: (high, low)
    max_model_len: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int   # tokens; a prefill with more left is capped at it
    max_long_partial_prefills: int
    decode_buckets: tuple[int, ...]   # strictly increasing; the last holds max_num_seqs rows
    max_pages_per_seq: int       # block-table width
    obs_window: int
    policy: str                  # the KV manager's: "reserve" or "reclaim" (dynamic mode)
    compression_method: str      # the scorer chunks are compressed with (the profile's method)
    scoring_rule: str            # the rule "auto" resolved to (chunk_scoring.SCORING_RULES)
    host_kv_cache_bytes: int = 0  # the host tier's budget (0: off)


# ----- command line -------------------------------------------------------------------------

def _cli_type(f: dataclasses.Field):
    """argparse `type` for a field: the string becomes the Python value its check expects (the
    check itself runs when the `EngineConfig` is built, so CLI and API report the same error)."""
    default = f.default
    if f.name in ("decode_buckets", "prefill_token_buckets", "kv_tier_turn"):
        return _comma_ints
    if isinstance(default, float):
        return float
    if isinstance(default, int) or "int" in str(f.type):
        return int
    return str


def _comma_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_cli_args(parser: argparse.ArgumentParser, *, exclude: Iterable[str] = (),
                 defaults: dict | None = None) -> None:
    """One flag per `EngineConfig` field (`--max-num-seqs` for `max_num_seqs`, `--x/--no-x`
    for booleans), with the field's help. `exclude`: fields the command sets itself;
    `defaults`: per-command defaults (still validated by the field's check)."""
    exclude, defaults = set(exclude), defaults or {}
    group = parser.add_argument_group("engine", "EngineConfig fields")
    added = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude or not f.metadata["cli"]:
            continue
        added.append(f.name)
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        # A None default is described by the help itself.
        help_text = f.metadata["help"] + ("" if default is None else f" (default: {shown})")
        if isinstance(f.default, bool) or f.metadata["check"].__qualname__.startswith("_flag"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            choices = {"mode": MODES, "dtype": DTYPES, "layer_loop": LAYER_LOOPS,
                       "tail_rule": TAIL_RULES, "scoring_rule": SCORING_RULE_CHOICES,
                       "retention": RETENTION_CHOICES, "turn_view": TURN_VIEWS,
                       "kv_precision": SERVED_PRECISIONS,
                       "split_map": SPLIT_MAPS}.get(f.name)
            group.add_argument(flag, dest=f.name, type=_cli_type(f), default=default,
                               choices=choices, help=help_text)
    parser.set_defaults(_engine_fields=tuple(added))


def from_cli_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` of the flags `add_cli_args` added (fields without a flag keep their
    defaults unless given in `overrides`)."""
    values = {name: getattr(args, name) for name in getattr(args, "_engine_fields", ())}
    values.update(overrides)
    return EngineConfig(**values)


# ----- layout and pool ----------------------------------------------------------------------

def resolve_profile(cfg: EngineConfig, model_config: ModelConfig, is_embedded: bool) -> BudgetProfile:
    """The budget profile of tangram mode, validated against the model."""
    fingerprint = model_config.fingerprint()
    profile = cfg.profile
    if isinstance(profile, BudgetProfile):
        profile.check_fingerprint(fingerprint)
    elif isinstance(profile, (str, os.PathLike)):
        profile = BudgetProfile.load(profile, expected_fingerprint=fingerprint)
    else:
        if not is_embedded:
            raise EngineConfigError("tangram mode needs a budget profile for this model: pass "
                                    "profile= (make one with `tangram-jax calibrate --model ...`)")
        # The embedded model has 3 KV heads: per-head groups (G = 1) are its only ragged layout.
        group_size = cfg.group_size or 1
        profile = shipped_profile(cfg.ratio, group_size, expected_fingerprint=fingerprint,
                                  tiers=cfg.kv_precision if cfg.kv_precision in PRECISION_TIERS
                                  else None)
    if cfg.group_size is not None and profile.group_size != cfg.group_size:
        profile = profile.regroup(cfg.group_size)
    return profile


def build_layout(cfg: EngineConfig, model_config: ModelConfig, is_embedded: bool, *,
                 profile: BudgetProfile | None = None) -> KVLayout:
    """The KV layout of `cfg.mode` for this model (tangram: of `profile`, resolved here when
    not given)."""
    if cfg.mode == "tangram":
        profile = profile or resolve_profile(cfg, model_config, is_embedded)
        return profile.to_layout(cfg.page_size, cfg.resolved_chunk_size())
    return KVLayout.monolithic(model_config.num_layers, model_config.num_kv_heads,
                               model_config.head_dim, page_size=cfg.page_size,
                               chunk_size=cfg.resolved_chunk_size(), name=cfg.mode)


def tiered_layout(cfg: EngineConfig, profile: BudgetProfile, layout: KVLayout,
                  max_model_len: int) -> TieredLayout:
    """`layout` split into the precision tiers of `cfg.kv_precision` by the profile's
    calibrated tier budgets, its pools split for `cfg.kv_tier_turn` (default: one
    `max_model_len` sequence whose last `DEFAULT_TIER_ANSWER_TOKENS`, at most an eighth of it,
    are its answer)."""
    if profile.tiers is None:
        raise EngineConfigError(
            f"kv_precision {cfg.kv_precision!r} needs a profile with precision-tier budgets; "
            f"this one has none (calibrate with tiers: `tangram-jax calibrate --tiers "
            f"{cfg.kv_precision}`)")
    if profile.tiers.precision != cfg.kv_precision:
        raise EngineConfigError(f"kv_precision {cfg.kv_precision!r} differs from the profile's "
                                f"tiers {profile.tiers.precision!r}")
    turn = cfg.kv_tier_turn
    if turn is None:
        answer = min(DEFAULT_TIER_ANSWER_TOKENS, max_model_len // 8)
        turn = (max_model_len - answer, answer)
    return TieredLayout(layout, profile.group_high_share(), precision=cfg.kv_precision,
                        pool_turn=turn)


def pool_is_fixed(cfg: EngineConfig) -> bool:
    """Whether the user fixed the pool (`num_pages`, `kv_cache_tokens` or
    `kv_cache_memory_bytes`); else a GPU sizes it from `gpu_memory_utilization`."""
    return (cfg.num_pages is not None or cfg.kv_cache_tokens is not None
            or cfg.kv_cache_memory_bytes is not None)


def check_precision(mode: str, kv_precision: str, subject: str) -> None:
    """Raise EngineConfigError (a ValueError) unless the engine mode `mode` can serve
    `kv_precision`: a served page format (`SERVED_PRECISIONS`), and precision tiers only in
    tangram mode (the tier budgets come with its profile). `subject` starts the message: what
    the caller calls the setting (a field, a mode name of the harness, a bench configuration)."""
    if kv_precision not in SERVED_PRECISIONS:
        raise EngineConfigError(f"{subject}: kv_precision must be one of "
                                f"{', '.join(SERVED_PRECISIONS)}, got {kv_precision!r}")
    if kv_precision in PRECISION_TIERS and mode != "tangram":
        raise EngineConfigError(f"{subject}: kv_precision {kv_precision!r} (precision tiers) "
                                f"needs tangram mode (its tier budgets come from the profile), "
                                f"got mode {mode!r}")


def check_tiered_num_pages(cfg: EngineConfig) -> None:
    """Raise unless `num_pages` (when given) can hold a tiered pool of `kv_precision`."""
    if cfg.kv_precision in PRECISION_TIERS and cfg.num_pages is not None \
            and cfg.num_pages < TIERED_MIN_PAGES:
        raise EngineConfigError(
            f"num_pages={cfg.num_pages} cannot hold a tiered pool (kv_precision "
            f"{cfg.kv_precision!r}): each tier's pool needs its null page and at least one "
            f"page, so num_pages must be >= {TIERED_MIN_PAGES}")


def pool_pages(cfg: EngineConfig, model_config: ModelConfig,
               layout: KVLayout | TieredLayout) -> int | tuple[int, int]:
    """Pages of the pool: `num_pages`, or the head-token slots of `kv_cache_tokens` full-KV
    tokens (DEFAULT_KV_CACHE_TOKENS when None; on a GPU the engine sizes the pool instead).

    A page of G heads holds ``page_size * G`` head-token slots; a full-KV token needs
    ``layers * kv_heads`` of them. Plus the null page 0.

    Precision tiers: a (high, low) pair of pool sizes, each with its own null page, whose
    usable pages together are what the untiered pool would hand out (``num_pages - 2`` of
    `num_pages`, at least 2; the slots of `kv_cache_tokens`), split by the high tier's share
    of the retained tokens (`TieredLayout.pool_pages`): the same retained tokens as a K8V4
    pool in fewer bytes whenever a share of them is in the low tier.
    """
    tiered = isinstance(layout, TieredLayout)
    if cfg.num_pages is not None:
        if not tiered:
            return cfg.num_pages
        check_tiered_num_pages(cfg)
        return layout.pool_pages(cfg.num_pages - 2)
    tokens = cfg.kv_cache_tokens if cfg.kv_cache_tokens is not None else DEFAULT_KV_CACHE_TOKENS
    slots = tokens * model_config.num_layers * model_config.num_kv_heads
    usable = int(np.ceil(slots / (layout.page_size * layout.group_size)))
    return layout.pool_pages(max(usable, 2)) if tiered else usable + 1
