"""GPU memory: JAX's allocator cap, and the KV pool that fits under `gpu_memory_utilization`.

vLLM's meaning: the engine may use ``gpu_memory_utilization`` of the card. On a GPU JAX's
allocator takes a fixed fraction of the card when its backend starts (75% unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise) and never grows past it, so the engine

1. sets that fraction to the utilization before JAX's backend starts (`configure_allocator`;
   once the backend runs it is too late, and the engine sizes against the cap in force and says
   so),
2. loads the weights and reads what the allocator holds (`DeviceMemory.read`),
3. compiles its steps for a provisional pool (with warm-up on, every program warm-up would
   compile, side by side, kept for warm-up; else the largest decode bucket and prefill) and
   reads their temporary bytes (XLA's `memory_analysis`; the pool is updated in place, so a
   step's temp does not grow with the pool),
4. gives the pool what is left (`plan_pool`): ``budget - in_use - step_peak - headroom``.

A pool of precision tiers (`kv_layout.TieredLayout`) is two pools of different page bytes whose
page counts split the usable pages by the high tier's share of the retained tokens
(`TieredPool`): the bytes buy as many usable pages as that mix of page sizes allows.

The step peak is measured at a provisional pool size; where a step's temp grows with the pool
(the CPU's jnp reference prefill copies V once a layer: its value gather and its compress
scatter are unordered, so XLA's copy insertion separates them) the measured peak includes that
copy, so the pool that follows is smaller than needed, never larger.

The arithmetic is plain integers (unit-tested on the CPU with made-up numbers); the engine feeds
it what the device reports.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np

from tangram_jax.kv_layout import TieredLayout, pages_for

FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75     # what JAX's GPU client takes when the variable is unset
GIB = 2 ** 30


def _parse_fraction(value: str | None) -> float | None:
    try:
        fraction = float(value) if value is not None else None
    except ValueError:
        return None
    return fraction if fraction is not None and 0 < fraction <= 1 else None


@dataclasses.dataclass(frozen=True)
class AllocatorSetup:
    """What `configure_allocator` found and did.

    fraction: the allocator's share of the card in force (or about to be) for this process.
    set_by_engine: True when the engine wrote ``XLA_PYTHON_CLIENT_MEM_FRACTION`` itself.
    too_late: JAX's backend had started before the engine could set the fraction (the cap is
      whatever was in force then; `note` says how to change it).
    """

    fraction: float
    set_by_engine: bool
    too_late: bool
    note: str = ""


def backends_started() -> bool:
    """Whether JAX's backends are already initialised (then allocator settings are fixed)."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):   # private API moved: assume the worst
        return True


_SETUP: AllocatorSetup | None = None


def configure_allocator(gpu_memory_utilization: float) -> AllocatorSetup:
    """Set JAX's GPU allocator cap to `gpu_memory_utilization` of the card, if JAX's backend
    has not started yet and the user has not set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` themselves
    (their setting wins). Idempotent within a process: the first call decides."""
    global _SETUP
    if _SETUP is not None and not _SETUP.too_late and backends_started():
        return _SETUP            # an earlier engine of this process set it up
    user = _parse_fraction(os.environ.get(FRACTION_ENV))
    if backends_started():
        fraction = user or JAX_DEFAULT_FRACTION
        # A larger cap than asked is harmless (the budget takes the utilization); a smaller
        # one bounds the pool, and the user should know why and how to change it.
        note = "" if fraction >= gpu_memory_utilization - 1e-9 else (
            f"JAX's GPU backend started before the Engine, with its allocator capped at "
            f"{fraction:.2f} of the card ({FRACTION_ENV}="
            f"{os.environ.get(FRACTION_ENV, 'unset: JAX default 0.75')}); "
            f"gpu_memory_utilization={gpu_memory_utilization} cannot change that any more. "
            f"Create the Engine before any other JAX work, or start Python with "
            f"{FRACTION_ENV}={gpu_memory_utilization}.")
        _SETUP = AllocatorSetup(fraction, set_by_engine=False, too_late=True, note=note)
    elif user is not None:
        _SETUP = AllocatorSetup(user, set_by_engine=False, too_late=False)
    else:
        os.environ[FRACTION_ENV] = repr(float(gpu_memory_utilization))
        _SETUP = AllocatorSetup(float(gpu_memory_utilization), set_by_engine=True,
                                too_late=False)
    return _SETUP


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What JAX's allocator on one device reports (bytes).

    bytes_limit: the allocator's cap; bytes_in_use: live buffers now; peak_bytes_in_use: the
    largest bytes_in_use so far; fraction: the share of the card the cap is (so
    ``card_bytes = bytes_limit / fraction`` is the memory JAX based it on).
    """

    bytes_limit: int
    bytes_in_use: int
    peak_bytes_in_use: int
    fraction: float

    @property
    def card_bytes(self) -> int:
        return int(round(self.bytes_limit / self.fraction))

    @classmethod
    def read(cls, device, fraction: float) -> "DeviceMemory | None":
        """The device's allocator statistics, or None where it reports none (CPU) or no cap
        (e.g. ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``)."""
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or not stats.get("bytes_limit"):
            return None
        return cls(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)),
                   int(stats.get("peak_bytes_in_use", 0)), float(fraction))


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """How the pool was sized (bytes unless named otherwise).

    budget_bytes: what the engine may use, ``min(utilization * card, allocator cap)``;
    in_use_bytes: held before the pool (weights, tables); step_peak_bytes: the largest step's
    temporary bytes; headroom_bytes: kept free for small outputs and allocator slack;
    num_pages: pool pages (page 0, the null page, included); pool_bytes = num_pages * page_bytes.
    With precision tiers page_bytes and num_pages are (high, low) pairs (each tier's pool with
    its null page) and pool_bytes their products' sum.
    capped_by: "utilization" or "allocator" (the cap in force was lower than asked).
    """

    card_bytes: int
    utilization: float
    budget_bytes: int
    in_use_bytes: int
    step_peak_bytes: int
    headroom_bytes: int
    page_bytes: int | tuple[int, ...]
    num_pages: int | tuple[int, ...]
    capped_by: str

    @property
    def pool_bytes(self) -> int:
        return int(np.dot(np.atleast_1d(self.num_pages), np.atleast_1d(self.page_bytes)))

    @property
    def step_room_bytes(self) -> int:
        """What the budget leaves the steps beside the pool, the weights and the headroom:
        at least `step_peak_bytes` (more where the pool kept its provisional size)."""
        return (self.budget_bytes - self.in_use_bytes - self.pool_bytes
                - self.headroom_bytes)

    def describe(self, tokens: int | None = None) -> str:
        held = f"{tokens:,} full-KV tokens, " if tokens is not None else ""
        pages = int(np.sum(self.num_pages))
        return (f"KV pool {pages:,} pages ({held}{self.pool_bytes / GIB:.2f} GiB): "
                f"gpu_memory_utilization {self.utilization} of {self.card_bytes / GIB:.2f} GiB "
                f"-> budget {self.budget_bytes / GIB:.2f} GiB (capped by {self.capped_by}), "
                f"minus {self.in_use_bytes / GIB:.2f} GiB in use (weights), "
                f"{self.step_peak_bytes / GIB:.2f} GiB step peak, "
                f"{self.headroom_bytes / GIB:.2f} GiB headroom")


def default_headroom(budget: int) -> int:
    """Bytes kept free for small outputs (tokens, a prefill's logits) and allocator slack:
    512 MiB, or 1/16 of a smaller budget."""
    return min(512 * 2 ** 20, budget // 16)


def step_reserve(budget: int) -> int:
    """Bytes a provisional pool leaves for the steps before their peak is known: 1/32 of the
    budget, at least 1 GiB (an 8B step at batch 256 needs ~1.2 GiB) unless the budget is under
    8 GiB (then 1/8 of it)."""
    return max(min(GIB, budget // 8), budget // 32)


def budget_bytes(card_bytes: int, utilization: float, allocator_limit: int) -> tuple[int, str]:
    """``min(utilization * card, allocator cap)`` and which of the two bound it."""
    wanted = int(utilization * card_bytes)
    return (wanted, "utilization") if wanted <= allocator_limit else (int(allocator_limit),
                                                                       "allocator")


@dataclasses.dataclass(frozen=True)
class TieredPool:
    """The pages of a pool of one or more tiers, to size it by bytes: one page format (the
    plain pool, `single`) or precision tiers (a high and a low tier's pools, `kv_layout.
    TieredLayout.pool_pages` splitting the usable pages between them).

    page_bytes: bytes of one page of each tier; split: usable pages -> each tier's pool size
    (null page included), nondecreasing in every tier; min_pages: each tier's pool size one
    `max_model_len` sequence needs (null page included). Page counts are ints for one tier,
    tuples for several (what the runner and the KV-cache manager take).
    """

    page_bytes: tuple[int, ...]
    split: Callable[[int], tuple[int, ...]]
    min_pages: tuple[int, ...]

    @classmethod
    def single(cls, page_bytes: int, min_pages: int) -> "TieredPool":
        return cls((int(page_bytes),), lambda usable: (usable + 1,), (int(min_pages),))

    def as_counts(self, pages) -> np.ndarray:
        """int64 [tiers] of a page count (an int, or a tuple per tier)."""
        return np.atleast_1d(np.asarray(pages, np.int64))

    def as_pages(self, counts) -> int | tuple[int, ...]:
        """Counts per tier as a page count: an int for one tier, else a tuple."""
        counts = tuple(int(c) for c in counts)
        return counts[0] if len(counts) == 1 else counts

    def bytes_of(self, pages) -> int:
        """Bytes of a pool of `pages` (per tier)."""
        return int(self.as_counts(pages) @ np.asarray(self.page_bytes, np.int64))

    def pages_in(self, nbytes: int) -> int | tuple[int, ...]:
        """The largest pool whose bytes are at most `nbytes`: one tier, ``nbytes // page
        bytes`` pages (<= 0 when nothing fits); tiers, the split of the most usable pages
        that fits (zeros when not even one page per tier does)."""
        if len(self.page_bytes) == 1:
            if self.page_bytes[0] <= 0:
                raise ValueError(f"page_bytes must be positive, got {self.page_bytes[0]}")
            return int(nbytes) // self.page_bytes[0]
        lo, hi = 2, max(2, int(nbytes) // min(self.page_bytes))   # usable pages: lo fits
        if self.bytes_of(self.split(lo)) > nbytes:
            return self.as_pages([0] * len(self.page_bytes))
        while lo < hi:                                              # bytes grow with usable
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes_of(self.split(mid)) <= nbytes else (lo, mid - 1)
        return self.as_pages(self.split(lo))

    def holds_min(self, pages) -> bool:
        """Whether every tier's pool of `pages` holds one `max_model_len` sequence."""
        return bool((self.as_counts(pages) >= np.asarray(self.min_pages)).all())

    def at_least_min(self, pages) -> int | tuple[int, ...]:
        """`pages` with every tier raised to its minimum (a size to compile steps for)."""
        return self.as_pages(np.maximum(self.as_counts(pages), self.min_pages))

    def describe(self, pages) -> str:
        counts = self.as_counts(pages)
        if len(counts) == 1:
            return f"{max(int(counts[0]), 0)} pages of {self.page_bytes[0]} bytes"
        return " + ".join(f"{max(int(c), 0)} pages of {b} bytes"
                          for c, b in zip(counts, self.page_bytes))


def plan_pool(memory: DeviceMemory, utilization: float, step_peak_bytes: int,
              pool: TieredPool, *, headroom_bytes: int | None = None,
              prefer_pages=None) -> PoolPlan:
    """The pool that fits: see the module docstring. pool: its pages' bytes and the pages one
    sequence needs, per tier (`TieredPool.single` for one page format). With `prefer_pages`
    (the size the steps were compiled for), that size is kept whenever it fits, so the
    compiled steps are reused. Raises ValueError (naming the figures and what to change) when
    fewer than the minimum pages fit (in any tier)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget, capped_by = budget_bytes(memory.card_bytes, utilization, memory.bytes_limit)
    if headroom_bytes is None:
        headroom_bytes = default_headroom(budget)
    pages = pool.pages_in(budget - memory.bytes_in_use - step_peak_bytes - headroom_bytes)
    if not pool.holds_min(pages):
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV pool: budget "
            f"{budget / GIB:.2f} GiB (of {memory.card_bytes / GIB:.2f} GiB, capped by "
            f"{capped_by}) minus {memory.bytes_in_use / GIB:.2f} GiB in use (weights), "
            f"{step_peak_bytes / GIB:.2f} GiB step peak and {headroom_bytes / GIB:.2f} GiB "
            f"headroom fits {pool.describe(pages)}, fewer than the "
            f"{pool.as_pages(pool.min_pages)} needed; raise gpu_memory_utilization, lower "
            f"max_num_seqs or max_num_batched_tokens, or set kv_cache_tokens / num_pages")
    if prefer_pages is not None and pool.holds_min(prefer_pages) and (
            pool.as_counts(prefer_pages) <= pool.as_counts(pages)).all():
        pages = prefer_pages
    return PoolPlan(card_bytes=memory.card_bytes, utilization=float(utilization),
                    budget_bytes=budget, in_use_bytes=memory.bytes_in_use,
                    step_peak_bytes=int(step_peak_bytes), headroom_bytes=int(headroom_bytes),
                    page_bytes=pool.as_pages(pool.page_bytes), num_pages=pool.as_pages(
                        pool.as_counts(pages)), capped_by=capped_by)


FIT_SLACK_BYTES = 16 << 20


def check_fixed_pool(memory: DeviceMemory, pool: TieredPool, pages, step_peak_bytes: int, *,
                     setting: str, tokens_of: Callable[[object], int],
                     note: str = "", headroom_bytes: int | None = None) -> int:
    """The bytes the steps have beside the pool, what is in use and the headroom (at least
    `step_peak_bytes`); raise ValueError unless a pool the user fixed (`setting`, e.g.
    "kv_cache_tokens=380000") of `pages` fits under the allocator's cap in force beside what is in use (the weights), the
    largest step's temporary bytes and the headroom; the message names those figures and the
    largest pool that fits (as kv_cache_memory_bytes, num_pages and `tokens_of` full-KV
    tokens). `note`: why the cap is what it is (`AllocatorSetup.note`)."""
    limit = memory.bytes_limit
    if headroom_bytes is None:
        headroom_bytes = default_headroom(limit)
    need = pool.bytes_of(pages) + memory.bytes_in_use + step_peak_bytes + headroom_bytes
    if need <= limit:
        return limit - need + step_peak_bytes
    # The pool named as fitting leaves `FIT_SLACK_BYTES` spare: what is in use moves by the
    # time the user builds again (a GPU run built an engine of exactly the named size and found
    # ~0.1 MB more in use than when it was named).
    fit = pool.pages_in(limit - memory.bytes_in_use - step_peak_bytes - headroom_bytes
                        - FIT_SLACK_BYTES)
    if pool.holds_min(fit):
        fits = (f"at most kv_cache_memory_bytes={pool.bytes_of(fit)} fits "
                f"(num_pages={pool.as_pages(pool.as_counts(fit))}, "
                f"kv_cache_tokens={tokens_of(fit):,})")
    else:
        fits = (f"not even the {pool.describe(pool.min_pages)} one max_model_len sequence "
                f"needs fits: lower max_model_len, max_num_seqs or max_num_batched_tokens")
    raise ValueError(
        f"{setting} fixes a KV pool of {pool.bytes_of(pages) / GIB:.2f} GiB, which with "
        f"{memory.bytes_in_use / GIB:.2f} GiB in use (the weights), the largest step's "
        f"{step_peak_bytes / GIB:.2f} GiB and {headroom_bytes / GIB:.2f} GiB of headroom needs "
        f"{need / GIB:.2f} GiB, more than the allocator's cap in force, {limit / GIB:.2f} GiB "
        f"({memory.fraction:.2f} of the {memory.card_bytes / GIB:.2f} GiB card{note}); "
        f"{fits}, or raise the cap ({FRACTION_ENV}, or gpu_memory_utilization before JAX "
        f"starts)")


def step_peak_bytes(compiled) -> int:
    """Bytes a compiled step allocates beyond its (donated, aliased) arguments: XLA's temp
    buffer plus the outputs that do not reuse an argument's buffer."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + max(m.output_size_in_bytes - m.alias_size_in_bytes, 0))


# ----- sizing the engine's pool (the runner's page formats, the layout's budgets) ---------------
def pool_by_bytes(runner, layout, max_model_len: int) -> TieredPool:
    """The pool's page bytes per tier (one tier untiered, `runner.tier_page_bytes`) and the
    pages one `max_model_len` sequence needs in each, which must fit or nothing could be
    served."""
    one = pages_for(layout.retained_counts(max_model_len), layout.page_size)
    if isinstance(layout, TieredLayout):
        return TieredPool(runner.tier_page_bytes, layout.pool_pages,
                          (int(one[:, 0::2].sum()) + 1, int(one[:, 1::2].sum()) + 1))
    return TieredPool.single(runner.kv_bytes_per_page, int(one.sum()) + 1)


def pages_in_bytes(pool: TieredPool, nbytes: int, max_model_len: int):
    """The largest pool of at most `nbytes` (`kv_cache_memory_bytes`) in `pool`'s page
    format(s); raises ValueError when it cannot hold one max_model_len sequence."""
    pages = pool.pages_in(nbytes)
    if not pool.holds_min(pages):
        raise ValueError(
            f"kv_cache_memory_bytes={nbytes} holds {pool.describe(pages)}; one "
            f"max_model_len={max_model_len} sequence needs {pool.describe(pool.min_pages)}"
            f" ({pool.bytes_of(pool.min_pages):,} bytes): raise kv_cache_memory_bytes or "
            f"lower max_model_len")
    return pages


def size_pool(device, cfg, pool: TieredPool, step_peak: Callable[[object], int],
              fraction: float, *, in_use_bytes: int | None = None,
              weights_loaded: Callable[[], None] = lambda: None) -> PoolPlan:
    """The pool under `cfg.gpu_memory_utilization` (module docstring): compile the steps for a
    provisional pool that leaves `step_reserve` free, read their peak (`step_peak(pages)`:
    bytes), and keep the provisional size when the peak fits in the reserve (the compiled
    steps are then reused as they are), else shrink the pool to fit. While the weights still
    load (on another thread), `in_use_bytes` is what the allocator will hold with them, and
    `weights_loaded()` waits for them before the plan reads what it holds."""
    now = DeviceMemory.read(device, fraction)
    in_use = now.bytes_in_use if in_use_bytes is None else in_use_bytes
    budget, _ = budget_bytes(now.card_bytes, cfg.gpu_memory_utilization, now.bytes_limit)
    provisional = pool.pages_in(budget - in_use - step_reserve(budget))
    peak = step_peak(pool.at_least_min(provisional))
    weights_loaded()
    return plan_pool(DeviceMemory.read(device, fraction), cfg.gpu_memory_utilization, peak,
                     pool, prefer_pages=provisional if pool.holds_min(provisional) else None)


def check_fixed_pool_fits(runner, device, cfg, pool: TieredPool, pages,
                          step_peak: Callable[[object], int], allocator: AllocatorSetup, *,
                          weights_loaded: Callable[[], None] = lambda: None) -> int:
    """The bytes the steps have beside a pool the user fixed (`check_fixed_pool`); refuse
    (ValueError) a pool the user fixed that cannot fit under the allocator's cap in
    force beside the weights and the steps' peak (`step_peak(pages)`: compiled here for that
    pool, as warm-up would: the executables are reused), naming the figures and what would
    fit. `weights_loaded()` waits for weights still loading before the allocator is read."""
    peak = step_peak(pages)
    weights_loaded()
    now = DeviceMemory.read(device, allocator.fraction)   # the weights are in
    setting = next(f"{name}={getattr(cfg, name)}" for name in
                   ("num_pages", "kv_cache_tokens", "kv_cache_memory_bytes")
                   if getattr(cfg, name) is not None)
    return check_fixed_pool(now, pool, pages, peak, setting=setting,
                     tokens_of=lambda pages: full_kv_tokens(runner, pages),
                     note=f": {allocator.note}" if allocator.note else "")


def full_kv_tokens(runner, pages) -> int:
    """Full-KV tokens a pool of `pages` holds: its head-token slots (null pages excluded) over
    every layer's KV heads (every layer and KV head keeping every token)."""
    layout = runner.base_layout
    slots = sum(n - 1 for n in runner.tier_pages(pages)) * layout.page_size * layout.group_size
    return slots // (runner.config.num_layers * runner.config.num_kv_heads)


def pool_report(runner, layout, tier_names, cfg, plan: PoolPlan | None) -> dict:
    """The pool's size: pages (null pages included), bytes (the arrays', on each device), the
    head-token slots its pages hold and the full-KV tokens that is (every layer and KV head
    keeping every token; compressed modes hold more), bytes per slot, what sized it and, when
    `gpu_memory_utilization` did, the figures it used (`plan`). With precision tiers also
    `tiers`: each tier's pool (page format -> pages, bytes, slots); its slots hold that tier's
    retained tokens only."""
    counts = runner.tier_pages(runner.num_pages)
    slots_per_page = layout.page_size * layout.group_size
    tiers = {name: {"num_pages": n, "bytes": n * b, "slots": (n - 1) * slots_per_page}
             for name, n, b in zip(tier_names, counts, runner.tier_page_bytes)}
    slots = sum(t["slots"] for t in tiers.values())               # no null pages
    pool_bytes = runner.pool_bytes()
    pool = {"num_pages": sum(counts), "bytes": pool_bytes, "slots": slots,
            "bytes_per_slot": pool_bytes / slots,
            "full_kv_tokens": full_kv_tokens(runner, runner.num_pages),
            "sized_by": ("num_pages" if cfg.num_pages is not None else
                         "kv_cache_memory_bytes" if cfg.kv_cache_memory_bytes is not None else
                         "kv_cache_tokens" if plan is None else "gpu_memory_utilization")}
    if isinstance(layout, TieredLayout):
        pool["tiers"] = tiers
    if plan is not None:
        pool["plan"] = dataclasses.asdict(plan)
    return pool


def describe_pool(pool: dict, plan: PoolPlan | None) -> str:
    """One line of `pool_report`'s figures, for the start-up log."""
    tiers = "".join(f", {name} {t['num_pages']:,} pages" for name, t in
                    pool.get("tiers", {}).items())
    if plan is not None:
        return plan.describe(pool["full_kv_tokens"]) + tiers
    return (f"KV pool {pool['num_pages']:,} pages ({pool['full_kv_tokens']:,} full-KV "
            f"tokens, {pool['bytes'] / GIB:.2f} GiB{tiers}), sized by {pool['sized_by']}")
