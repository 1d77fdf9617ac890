"""Engine configuration, and how a mode becomes a KV layout.

The three modes are configurations of the same manager, runner and kernels:

=========  =============================  ================  ==============================
mode       layout                         manager policy    per-chunk kept tokens
=========  =============================  ================  ==============================
full       monolithic (all heads, r = 1)  reserve           all of them
dynamic    monolithic (all heads, r = 1)  reclaim           per-input top-k, then reclaim
tangram    calibrated groups of G         reserve           ``ceil(r_g * n)`` per group
=========  =============================  ================  ==============================
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from tangram_jax.compression.profile import BudgetProfile, shipped_profile
from tangram_jax.kv_layout import KVLayout
from tangram_jax.models.config import ModelConfig

MODES = ("tangram", "full", "dynamic")
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_KV_CACHE_TOKENS = 16384    # the pool where nothing sizes it (CPU, no allocator cap)


@dataclasses.dataclass
class EngineConfig:
    """Everything an `Engine` is built from (vLLM's engine args, Tangram's additions).

    model: None or "smollm2" (the embedded SmolLM2-135M), a Hugging Face folder or a .gguf file.
    mode: "tangram" | "full" | "dynamic".
    profile: a `BudgetProfile`, a path to a profile file, or None (the shipped profile of the
      embedded model at `ratio` and `group_size`; required for other models in tangram mode).
    ratio: target retention rho for the shipped profile (tangram) or the per-input selection
      (dynamic).
    group_size: G (regroups a given profile; the shipped profiles of the embedded model, which
      has 3 KV heads, exist for G 1 (default) and 3).
    dtype: "float32" or "bfloat16" (model weights and the KV pool).
    page_size, chunk_size: tokens per page; prefill compression chunk (and prefill piece size).
    num_pages: KV pool pages; None sizes it from `kv_cache_tokens`.
    kv_cache_tokens: full-KV tokens' worth of memory the pool gets when num_pages is None (the
      same bytes in every mode, so modes compare at equal memory). None: on a GPU the pool takes
      what `gpu_memory_utilization` leaves after the weights and the largest step
      (`engine/memory.py`); elsewhere DEFAULT_KV_CACHE_TOKENS.
    gpu_memory_utilization: the share of the GPU the engine may use (vLLM's meaning), in (0, 1];
      sets JAX's allocator cap when the engine is the first to start JAX's GPU backend.
    compile_cache_dir: JAX's persistent compilation cache folder; None: $TANGRAM_JAX_COMPILE_CACHE
      or ~/.cache/tangram_jax/jax; "" or "off": no cache (`engine/compile_cache.py`).
    max_num_seqs: concurrent sequence slots; max_num_batched_tokens: prefill tokens per step.
    max_model_len: longest sequence (prompt + output); default the model's context length.
    num_programs: concurrent programs the decode kernel's split map is sized for.
    async_scheduling: learn each step's tokens one step late, so the host schedules step N+1
      while the device runs step N (vLLM's `async_scheduling`); False waits for every step's
      tokens before returning from `Engine.step` (outputs a step earlier, device idle meanwhile).
    layer_loop: "scan", "unrolled" or None (unrolled on a GPU, scan on a CPU); see `RunnerConfig`.
    max_prefill_rows: prefill chunks of different sequences run together in one call (rounded up
      to a power of two). More rows mean fewer calls but a larger traced step (each row has its
      own attention and compression per layer), so compile time grows with rows x layers.
    warmup: compile every step shape when the engine is built (`Engine.warmup`); None: on a GPU
      only (compiling a shape first met while serving stalls every request for it).
    """

    model: str | None = None
    mode: str = "tangram"
    profile: Any = None
    ratio: float = 0.5
    group_size: int | None = None
    dtype: str = "float32"
    page_size: int = 16
    chunk_size: int = 128
    num_pages: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    num_programs: int = 132 * 4
    obs_window: int = 32
    seed: int = 0
    async_scheduling: bool = True
    layer_loop: str | None = None
    max_prefill_rows: int = 1
    warmup: bool | None = None
    gpu_memory_utilization: float = 0.9
    compile_cache_dir: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        for name in ("page_size", "chunk_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_tokens", "num_programs", "obs_window", "max_prefill_rows"):
            value = getattr(self, name)
            if value is None and name == "kv_cache_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (isinstance(self.gpu_memory_utilization, bool)
                or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.compile_cache_dir is not None and not isinstance(self.compile_cache_dir,
                                                                 (str, os.PathLike)):
            raise ValueError(f"compile_cache_dir must be a folder path, '' / 'off' or None, got "
                             f"{self.compile_cache_dir!r}")
        if self.max_num_batched_tokens < self.chunk_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least chunk_size ({self.chunk_size}): prefill runs whole chunks")
        self.decode_buckets = tuple(sorted(set(int(b) for b in self.decode_buckets)))
        if self.decode_buckets[0] < 1:
            raise ValueError(f"decode buckets must be positive, got {self.decode_buckets}")


def resolve_profile(cfg: EngineConfig, model_config: ModelConfig, is_embedded: bool) -> BudgetProfile:
    """The budget profile of tangram mode, validated against the model."""
    fingerprint = model_config.fingerprint()
    profile = cfg.profile
    if isinstance(profile, BudgetProfile):
        profile.check_fingerprint(fingerprint)
    elif isinstance(profile, (str, os.PathLike)):
        profile = BudgetProfile.load(profile, expected_fingerprint=fingerprint)
    elif profile is None:
        if not is_embedded:
            raise ValueError("tangram mode needs a budget profile for this model: pass profile= "
                             "(make one with `tangram-jax calibrate --model ...`)")
        # The embedded model has 3 KV heads: per-head groups (G = 1) are its only ragged layout.
        group_size = cfg.group_size or 1
        profile = shipped_profile(cfg.ratio, group_size, expected_fingerprint=fingerprint)
    else:
        raise TypeError(f"profile must be a BudgetProfile, a path or None, got "
                        f"{type(profile).__name__}")
    if cfg.group_size is not None and profile.group_size != cfg.group_size:
        profile = profile.regroup(cfg.group_size)
    return profile


def build_layout(cfg: EngineConfig, model_config: ModelConfig, is_embedded: bool) -> KVLayout:
    """The KV layout of `cfg.mode` for this model."""
    if cfg.mode == "tangram":
        profile = resolve_profile(cfg, model_config, is_embedded)
        return profile.to_layout(cfg.page_size, cfg.chunk_size)
    return KVLayout.monolithic(model_config.num_layers, model_config.num_kv_heads,
                               model_config.head_dim, page_size=cfg.page_size,
                               chunk_size=cfg.chunk_size, name=cfg.mode)


def pool_is_fixed(cfg: EngineConfig) -> bool:
    """Whether the user fixed the pool (`num_pages` or `kv_cache_tokens`); else a GPU sizes it
    from `gpu_memory_utilization`."""
    return cfg.num_pages is not None or cfg.kv_cache_tokens is not None


def pool_pages(cfg: EngineConfig, model_config: ModelConfig, layout: KVLayout) -> int:
    """Pages of the pool: `num_pages`, or the full-KV bytes of `kv_cache_tokens` tokens
    (DEFAULT_KV_CACHE_TOKENS when None).

    A page of G heads holds ``page_size * G`` head-token slots; a full-KV token needs
    ``layers * kv_heads`` of them. Plus the null page 0.
    """
    if cfg.num_pages is not None:
        if cfg.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {cfg.num_pages}")
        return int(cfg.num_pages)
    tokens = cfg.kv_cache_tokens if cfg.kv_cache_tokens is not None else DEFAULT_KV_CACHE_TOKENS
    slots = tokens * model_config.num_layers * model_config.num_kv_heads
    return int(np.ceil(slots / (layout.page_size * layout.group_size))) + 1
