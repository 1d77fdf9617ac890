"""Compiling the runner's programs ahead of serving: warm-up and memory analysis.

`StepCompilation` is the part of `ModelRunner` that lowers and compiles every program a request
can meet (`warmup`: prefill row counts and flat-token buckets, region widths, table widths,
mixed steps, decode buckets, first-token sampling, block-table updates, fork page copies)
without running them, and the largest steps for a pool that is not allocated yet
(`compile_steps`: `engine/memory.py` sizes the pool from their memory analysis). Warm-up may
leave the narrower variants of a covering program (the narrower regions of turn compactions,
the decode buckets below the largest, all but two prefill token buckets) to one background
thread after the engine is ready (`background`): serving takes the covering program until they
are compiled (`_ready`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from tangram_jax.engine.decode_step import _check_logprob_mode, _copy_pages, _greedy_rows
from tangram_jax.engine.host_offload import swap_lowerings
from tangram_jax.engine.memory import step_peak_bytes
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.prefill_attention import row_alignment
from tangram_jax.sampling import write_penalty_row

log = logging.getLogger(__name__)


class _HeldCompile(NamedTuple):
    """A background compile waiting to be judged against the room the pool left."""
    key: tuple
    covering: tuple
    program: "WarmupProgram"
    compiled: object
    record: dict
    waiting: list


class StepCompilation:
    """Ahead-of-time compilation for `ModelRunner` (a mixin over the prefill and decode
    programs)."""

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
        """`_decode` inputs and static arguments of `bucket` rows on the null slot."""
        return self._decode_call(k_pages, v_pages, np.zeros(bucket, np.int32),
                                 np.full(bucket, self.null_slot, np.int32),
                                 np.zeros((bucket, *self.counts_shape), np.int32))

    def _pool_specs(self, num_pages) -> tuple:
        """(k_pages, v_pages) of a pool of `num_pages` pages as `jax.ShapeDtypeStruct`s with the
        pool's sharding: what programs are lowered for before the pool exists."""
        return self._pool(num_pages, lambda shape, dtype: jax.ShapeDtypeStruct(
            shape, dtype, sharding=self.placement.pool))

    def compile_steps(self, num_pages, decode_bucket: int, prefill_rows: int, *,
                      on_lowered: Callable[[], None] = lambda: None) -> dict:
        """Compile (without running, and without a pool in memory) the decode step at
        `decode_bucket` and the prefill step at `prefill_rows` for a pool of `num_pages`
        pages, side by side (`compile_programs`). Returns {"decode": compiled, "prefill":
        compiled} and, where prefill plans its writes, "prefill_writes" (the program that
        scatters them) (`jax.stages.Compiled`: read `memory_analysis()`, `as_text()`). The
        jitted steps reuse these executables when later called with the same shapes."""
        pool = self._pool_specs(num_pages)
        rows = backend.next_power_of_2(prefill_rows)
        decode_args, decode_static = self._null_decode_call(decode_bucket, *pool)
        prefill_args, prefill_static = self._null_prefill_call(rows, *pool)
        key = dict(pages=int(np.sum(num_pages)), bucket=decode_bucket, rows=rows)
        programs = [WarmupProgram("decode", key, functools.partial(
                        self._decode.lower, *decode_args, **decode_static)),
                    WarmupProgram("prefill", key, functools.partial(
                        self._prefill.lower, *prefill_args, **prefill_static))]
        if self.plans_prefill_writes:
            programs.append(WarmupProgram("prefill_writes", key, functools.partial(
                self._apply_writes_lowering, prefill_args, prefill_static)))
        if self.mixes_steps:
            programs.append(WarmupProgram("mixed", key, lambda: self._mixed.lower(
                *self._mixed_args(prefill_args, prefill_static, decode_args, decode_static,
                                  _greedy_rows(decode_bucket), None)[0],
                **prefill_static | dict(logprobs=None))))
        compiled = self.compile_programs(programs, phase="pool", pages=num_pages,
                                         progress=False, on_lowered=on_lowered)
        return {p.name: c for p, c in zip(programs, compiled)}

    def precompile(self, num_pages, *, on_lowered: Callable[[], None] = lambda: None,
                   **warmup_arguments) -> list[tuple[str, object]]:
        """Every program `warmup` compiles (`warmup_programs`' arguments), compiled now for a
        pool of `num_pages` pages that need not exist yet (its shapes only), side by side. The
        executables are kept: when the pool is allocated at that size, `warmup` finds them
        and lowers nothing again, and jit reuses them when serving meets the shapes. Engine
        construction calls this to size the pool from every program's peak, so the largest
        compiles start at once instead of after the sizing. Returns (program name,
        `jax.stages.Compiled`) pairs."""
        programs = self.warmup_programs(pool=self._pool_specs(num_pages), **warmup_arguments)
        return [(p.name, c) for p, c in zip(
            programs, self.compile_programs(programs, phase="pool", pages=num_pages,
                                            on_lowered=on_lowered))
            if c is not None]

    def compile_programs(self, programs: list[WarmupProgram], *, phase: str, pages,
                         threads: int | None = None, progress: bool | None = None,
                         on_lowered: Callable[[], None] = lambda: None) -> list:
        """Lower `programs` (for a pool of `pages` pages) one after another (tracing holds
        Python's lock) and compile them `threads` at a time as they are lowered (XLA compiles
        outside the lock; default: the CPU count, at most 8), behind a progress bar
        (`progress`: None shows it on a terminal). A program this runner already compiled (or
        is compiling in the background) for the same pool size is neither lowered nor compiled
        again. Programs marked `background` are lowered now and compiled after the others, one
        at a time on the runner's background thread (`_compile_in_background`), so the
        covering programs they stand beside get the machine to themselves. Returns the
        `jax.stages.Compiled`s in order (None for a background program); each new one is
        recorded in `compile_log` ({"program", "key", "phase", "lower_seconds",
        "compile_seconds", "hlo_chars"}; phase "background" for those). `on_lowered()` is called
        once every program is lowered, while they compile (the engine starts loading its
        weights then: a loader's Python beside the lowering slows both)."""
        threads = threads or min(8, os.cpu_count() or 1)
        pool_key = _pool_key(pages)
        keys = [(p.name, repr(sorted(p.key.items())), pool_key) for p in programs]
        new = [(k, p) for k, p in zip(keys, programs)
               if k not in self._compiled and k not in self._background_jobs]
        later = [(k, p) for k, p in new if p.background]
        now = [(k, p) for k, p in new if not p.background]
        bar = tqdm(total=len(now), desc="compiling", unit="program", leave=False,
                   disable=None if progress is None else not progress)

        finished = []   # this call's compiles done (`compile_log` is filled in order, later)

        def compile_one(program, lowered, lower_seconds):
            _check_memory_maps(program, len(finished), len(now))
            started = time.perf_counter()
            compiled = lowered.compile()
            finished.append(program)
            return compiled, dict(program=program.name, key=program.key, phase=phase,
                                  lower_seconds=lower_seconds,
                                  compile_seconds=time.perf_counter() - started,
                                  hlo_chars=len(lowered.as_text()))

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = []
            for key, program in now:
                bar.set_postfix_str(f"{program.name} {program.describe()}", refresh=False)
                started = time.perf_counter()
                lowered = program.lower()
                futures.append(pool.submit(compile_one, program, lowered,
                                           time.perf_counter() - started))
                futures[-1].add_done_callback(lambda _: bar.update())
            lowered_later = []
            for key, program in later:
                started = time.perf_counter()
                lowered_later.append((key, program, program.lower(),
                                      time.perf_counter() - started))
            on_lowered()
            for (key, _), future in zip(now, futures):
                self._compiled[key], record = future.result()
                self.compile_log.append(record)
        bar.close()
        # Jobs queued for another pool size (the build's provisional pool, since resized) would
        # only delay these.
        for key, job in list(self._background_jobs.items()):
            if key[2] != pool_key and job.cancel():
                del self._background_jobs[key]
        for key, program, lowered, lower_seconds in lowered_later:
            self._compile_in_background(key, program, lowered, lower_seconds)
        return [None if p.background else self._compiled[k] for k, p in zip(keys, programs)]

    def _compile_in_background(self, key, program: WarmupProgram, lowered,
                               lower_seconds: float) -> None:
        """Queue `lowered` (`program`, this runner's `key`) on the background compile thread.
        Its values of the fields it is covered in (`WarmupProgram.covered_by`: a region width,
        a decode bucket, a prefill token bucket) stay out of serving's choice (`_ready`) until
        every program queued for that value and pool size is compiled and needs no more memory
        beside the pool than the engine left room for (`step_peak_budget`; without one, its
        covering program's peak); a program that fails or needs more is logged and that value
        is never used. A program compiled before the pool exists is judged when it is
        allocated (`_judge_held_compiles`): until then the room is provisional."""
        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tangram-background-compile")
            _BACKGROUND_EXECUTORS.add(self._background)
        waiting = [(field, program.key[field], key[2]) for field, _ in program.covered_by]
        with self._background_lock:   # the thread counts them down (`_judge`)
            for (field, covering_value), wait in zip(program.covered_by, waiting):
                self._covered_by[(field, program.key[field])] = covering_value
                self._compiling[wait] = self._compiling.get(wait, 0) + 1
        covering = (key[0], repr(sorted(dict(program.key, **dict(program.covered_by)).items())),
                    key[2])

        def run():
            try:
                _check_memory_maps(program, 0, 1)
                started = time.perf_counter()
                compiled = lowered.compile()
                seconds = time.perf_counter() - started
            except Exception as e:
                log.warning("background compile of %s (%s) failed, so its calls keep the "
                            "covering program: %s", program.name, program.describe(), e)
                raise
            record = dict(program=program.name, key=program.key, phase="background",
                          lower_seconds=lower_seconds, compile_seconds=seconds,
                          hlo_chars=len(lowered.as_text()))
            judged = _HeldCompile(key, covering, program, compiled, record, waiting)
            with self._background_lock:
                if self.k_pages is None:   # the engine has not yet decided the room
                    self._held_compiles.append(judged)
                    return
            self._judge(judged)

        self._background_jobs[key] = self._background.submit(run)

    def _judge_held_compiles(self) -> None:
        """Judge the background compiles that finished before the pool was allocated, now
        that `step_peak_budget` is the room it left (`allocate_pool` calls this)."""
        with self._background_lock:
            held, self._held_compiles = self._held_compiles, []
        for judged in held:
            self._judge(judged)

    def _judge(self, judged: "_HeldCompile") -> None:
        """Admit a background compile whose peak fits the room the pool left (a narrower
        program can need a few hundred bytes more than the one it stands in for: 8B
        prefill, 512 bytes, and fits all the same), or log and record its refusal."""
        peak = step_peak_bytes(judged.compiled)
        limit = self.step_peak_budget or step_peak_bytes(self._compiled[judged.covering])
        if peak > limit:
            log.warning("background compile of %s (%s) failed, so its calls keep the covering "
                        "program: it needs %s bytes beside the pool, more than the %s the "
                        "engine left room for", judged.program.name, judged.program.describe(),
                        f"{peak:,}", f"{limit:,}")
            self._refused_compiles.append(judged.key)
            return
        # The thread and `allocate_pool` may judge at once: the counts change under the lock.
        with self._background_lock:
            self._compiled[judged.key] = judged.compiled
            self.compile_log.append(judged.record)
            for wait in judged.waiting:
                self._compiling[wait] -= 1
                if not self._compiling[wait]:
                    del self._compiling[wait]

    def _ready(self, field: str, value: int) -> bool:
        """Whether calls of `field` = `value` ("region_pages": a turn compaction's width;
        "bucket": a decode bucket; "tokens": a prefill call's flat-token bucket) may run: no
        program of that value is still compiling in the background for the allocated pool (or
        failed to)."""
        if not self._compiling or self.k_pages is None:
            return True
        return (field, value, _pool_key(self.num_pages)) not in self._compiling

    def compiles_running(self) -> int:
        """Programs queued or compiling on the background thread."""
        return sum(not job.done() for job in self._background_jobs.values())

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for the programs compiling in the background.
        Returns whether every one of them compiled (False: still running after `timeout`, or
        one failed: see the log; serving then keeps the covering programs)."""
        jobs = list(self._background_jobs.values())
        done, running = concurrent.futures.wait(jobs, timeout)
        return (not running and not self._refused_compiles
                and all(j.exception() is None for j in done if not j.cancelled()))

    def _mixed_lowering(self, rows: int, num_tokens: int | None, bucket: int, logprobs,
                        region_pages: int | None, k_pages, v_pages):
        """`_mixed` lowered for a prefill call of `rows` rows (over `num_tokens` flat tokens,
        whole rows; turn compactions over `region_pages`) beside a decode step of `bucket`
        rows."""
        prefill_args, prefill_static = self._null_prefill_call(rows, k_pages, v_pages,
                                                               num_tokens, region_pages)
        decode_args, decode_static = self._null_decode_call(bucket, k_pages, v_pages)
        args, static = self._mixed_args(prefill_args, prefill_static, decode_args,
                                        decode_static, _greedy_rows(bucket), logprobs)
        return self._mixed.lower(*args, **static)

    def _apply_writes_lowering(self, prefill_args, prefill_static):
        """`_apply_writes` lowered for the write plan a prefill call with these arguments
        returns (its shapes do not depend on the table width)."""
        writes = jax.eval_shape(functools.partial(self._prefill, **prefill_static),
                                *prefill_args)[0]
        k_pages, v_pages = prefill_args[2], prefill_args[3]
        return self._apply_writes.lower(k_pages, v_pages, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.placement.replicated),
            writes))

    def warmup_programs(self, decode_buckets, max_prefill_rows: int, max_first_tokens: int, *,
                        logprob_modes=(None,), prompt_logprobs=(False,),
                        max_page_copies: int = 0, max_swap_pages: int = 0,
                        background: bool = False,
                        pool: tuple | None = None) -> list[WarmupProgram]:
        """Every program serving can meet, as `WarmupProgram`s to compile (`warmup` has the
        arguments): decode buckets, prefill row counts and, for whole rows, flat-token buckets;
        where the runner `mixes_steps`, each prefill shape beside each decode bucket;
        first-token sampling row counts; fork page copies; the host tier's page copies of up to
        `max_swap_pages` pages a tier (`host_offload.swap_lowerings`). `background`: mark the
        programs of turn compactions narrower than the whole table, of prefill token buckets
        other than the largest and the first of `SHORT_TURN_TOKENS` (`_token_covers`), and
        decode programs of buckets below the largest, for the background
        (`compile_programs`; the whole-table program, those two token buckets and the largest
        decode bucket cover their calls until then). `pool`:
        (k_pages, v_pages) to lower for (arrays or `jax.ShapeDtypeStruct`s; default the
        runner's pool)."""
        for mode in logprob_modes:
            _check_logprob_mode(mode)
        k_pages, v_pages = pool if pool is not None else (self.k_pages, self.v_pages)
        programs = []
        widest, largest = max(self._region_widths()), max(decode_buckets, default=0)
        token_cover: dict[int, int] = {}   # this row count's token buckets -> covering bucket

        def add(name, lower, **key):
            covered_by = []
            if background and key.get("region_pages", widest) < widest:
                covered_by.append(("region_pages", widest))
            if background and key.get("tokens") in token_cover:
                covered_by.append(("tokens", token_cover[key["tokens"]]))
            if background and name == "decode" and key["bucket"] < largest:
                covered_by.append(("bucket", largest))
            programs.append(WarmupProgram(name, key, lower, tuple(covered_by) or None))
        for rows in _padded_row_counts(max_prefill_rows):
            # Whole rows: every flat-token bucket a call of `rows` rows can meet.
            buckets = [b for b in self.prefill_token_buckets(rows)
                       if b >= rows * row_alignment(self.prefill_tuning)] \
                if self.prefill_whole_rows else self.chunk_token_buckets(rows)
            token_cover = _token_covers(buckets)
            # Retention "turn": every region width a turn compaction of the call can read.
            regions = [0] if self.prefill_whole_rows else self._region_widths()
            for num_tokens, region in itertools.product(buckets, regions):
                args, static = self._null_prefill_call(rows, k_pages, v_pages,
                                                       num_tokens, region)
                for width, targets in itertools.product(self._table_widths(prefill=True),
                                                        prompt_logprobs):
                    extra = (np.full(args[4].shape[0], -1, np.int32),) if targets else ()
                    add("prefill", functools.partial(
                        self._prefill.lower, *args, *extra, **dict(static, table_width=width)),
                        rows=rows, tokens=num_tokens, region_pages=region, table_width=width,
                        prompt_logprobs=targets)
                if self.plans_prefill_writes:
                    add("prefill_writes", functools.partial(self._apply_writes_lowering, args,
                                                            static),
                        rows=rows, tokens=num_tokens, region_pages=region)
                # This prefill call beside each decode bucket (a mixed step's one program).
                for bucket, mode in itertools.product(
                        decode_buckets if self.mixes_steps else (), logprob_modes):
                    add("mixed", functools.partial(self._mixed_lowering, rows, num_tokens,
                                                   bucket, mode, region, k_pages, v_pages),
                        rows=rows, tokens=num_tokens, region_pages=region, bucket=bucket,
                        logprobs=mode)
        token_cover = {}
        # The sampler of first tokens (padded row counts) and of decode steps (buckets), in
        # both forms (`_sampling_rows`: greedy rows' argmax, or the general sampler).
        sample_rows = sorted(set(_padded_row_counts(max_first_tokens)) | set(decode_buckets))
        for n, mode, greedy in itertools.product(sample_rows, logprob_modes, (False, True)):
            add("sample", functools.partial(
                self._sample_rows.lower, self.slot_state, jax.ShapeDtypeStruct(
                    (n, self.config.vocab_size), jnp.float32,
                    sharding=self.placement.replicated),
                np.zeros(n, np.int32), _greedy_rows(n), logprobs=mode, greedy=greedy),
                rows=n, logprobs=mode, greedy=greedy)
        add("penalty_row", functools.partial(
            write_penalty_row.lower, self.slot_state, np.int32(0),
            np.zeros(self.config.vocab_size, np.int32), np.int32(0)))
        for bucket in decode_buckets:
            args, static = self._null_decode_call(bucket, k_pages, v_pages)
            for width in self._table_widths(prefill=False):
                add("decode", functools.partial(
                    self._decode.lower, *args, **dict(static, table_width=width)),
                    bucket=bucket, table_width=width)
        for size in (1 << b for b in range(3, max(3, int(max_page_copies - 1).bit_length()) + 1)):
            index = np.zeros(size, np.int32)
            add("copy_pages", functools.partial(_copy_pages.lower, k_pages, v_pages,
                                                index, index), pages=size)
        if max_swap_pages:
            for name, key, lower in swap_lowerings(k_pages, v_pages,
                                                   self.placement.pool, max_swap_pages):
                add(name, lower, **key)
        return programs

    def warmup(self, decode_buckets, max_prefill_rows: int, max_first_tokens: int, *,
               logprob_modes=(None,), prompt_logprobs=(False,), max_page_copies: int = 0,
               max_swap_pages: int = 0, background: bool = False, threads: int | None = None,
               progress: bool | None = None) -> list[dict]:
        """Compile every step shape serving can meet (`warmup_programs`) ahead of time, without
        running them: jit reuses these executables when serving meets the shapes, so nothing
        compiles while requests wait (running the steps would add nothing but time: on a CPU
        the reference attention is slow). `compile_programs` compiles them, `threads` at once.

        logprob_modes: the `LOGPROB_MODES` decode and first-token sampling are compiled for
        (any top-k count up to `MAX_TOP_LOGPROBS` is one "top" variant); prompt_logprobs: the
        prefill variants, without (False) and with (True) prompt log-probabilities. Compiling
        a variant again costs little (jit finds it cached), so a later call may add modes.
        max_page_copies: the most pages one step's forks copy (`copy_pages`' sizes up to it);
        max_swap_pages: the most pages of a tier one session swapped to host memory holds.
        background: leave the programs a wider one covers (the narrower turn-compaction regions,
        all but two prefill token buckets, decode buckets below the largest) to the background
        thread (`warmup_programs`;
        `wait_for_compiles` waits for them). Programs `precompile` compiled for this pool's
        size are not compiled again. Returns one record a program compiled now
        (`compile_programs`, phase "warmup"), also in `compile_log`."""
        programs = self.warmup_programs(decode_buckets, max_prefill_rows, max_first_tokens,
                                        logprob_modes=logprob_modes,
                                        prompt_logprobs=prompt_logprobs,
                                        max_page_copies=max_page_copies,
                                        max_swap_pages=max_swap_pages,
                                        background=background)
        before = len(self.compile_log)
        self.compile_programs(programs, phase="warmup", pages=self.num_pages, threads=threads,
                              progress=progress)
        records = [r for r in self.compile_log[before:] if r["phase"] != "background"]
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
        return records


def _pool_key(pages) -> tuple[int, ...]:
    """A pool size (pages, or pages per tier) as the key compiled programs are kept under."""
    return tuple(int(n) for n in np.atleast_1d(pages))


# Every runner's background compile thread: a process that exits drops the compiles not yet
# started (it still waits for the one running, whose executable reaches the compile cache).
_BACKGROUND_EXECUTORS: "weakref.WeakSet[concurrent.futures.ThreadPoolExecutor]" = \
    weakref.WeakSet()


def _drop_queued_compiles() -> None:
    for executor in _BACKGROUND_EXECUTORS:
        executor.shutdown(wait=False, cancel_futures=True)


# Runs before concurrent.futures joins its threads (threading's exit hooks run last first).
getattr(threading, "_register_atexit", lambda f: None)(_drop_queued_compiles)


class MemoryMapLimitError(RuntimeError):
    """Compiling more programs would pass the memory mappings Linux allows a process."""


# The share of `vm.max_map_count` past which no program starts compiling: XLA's CPU backend
# keeps ~600 mappings a compiled program of the embedded model (130 programs in its warm-up),
# and a compile that finds none left dies with a segmentation fault, not an error.
MEMORY_MAPS_HEADROOM = 0.9


def _memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the most Linux allows: vm.max_map_count), or
    None where /proc does not say."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def _check_memory_maps(program, compiled: int, total: int) -> None:
    """Raise `MemoryMapLimitError` instead of starting `program`'s compile when the process
    holds more than `MEMORY_MAPS_HEADROOM` of the mappings it may (`compiled` of the `total`
    programs of this call are done)."""
    maps = _memory_maps()
    if maps is not None and maps[0] > MEMORY_MAPS_HEADROOM * maps[1]:
        raise MemoryMapLimitError(
            f"compiling {program.name} ({program.describe()}) stopped: this process holds "
            f"{maps[0]} memory mappings of the {maps[1]} Linux allows it (vm.max_map_count), "
            f"and each compiled program adds hundreds on a CPU ({compiled} of the {total} "
            f"programs of this compile call done); raise the limit (sysctl -w vm.max_map_count=262144) or "
            f"build the engine with warmup=False (programs then compile when first used)")


class WarmupProgram(NamedTuple):
    """One program `warmup` compiles: its jitted function's name, the shape key it is compiled
    for, a thunk that lowers it (`jax.stages.Lowered`), and for a program that may compile in
    the background (`compile_programs`) the key field and value of the program covering it."""

    name: str
    key: dict
    lower: Callable
    covered_by: tuple[tuple[str, int], ...] | None = None

    @property
    def background(self) -> bool:
        """Whether the program may compile after the engine is ready: a wider program, the
        same key with each (field, value) of `covered_by` in place, serves its calls until
        then."""
        return self.covered_by is not None

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.key.items())


# Prefill token buckets compiled before the engine is ready (`warmup_programs` with
# `background`): the largest (a long prompt's chunks) and the smallest of at least this many
# tokens (short turns: follow-ups, chat messages). The others compile in the background, their
# calls padded to the next of these two until then: at the 8B shape a 1024-token prefill step
# costs a few times a 64-token one (weights are read either way), while each bucket compiled
# before the first token costs ~25 s of a cold start's compile threads.
SHORT_TURN_TOKENS = 1024


def _token_covers(buckets: list[int]) -> dict[int, int]:
    """{bucket: the bucket covering it} for the token `buckets` of one row count that may
    compile in the background: every bucket but the largest and the smallest of at least
    `SHORT_TURN_TOKENS`, each covered by the smallest of those two above it."""
    covering = sorted({buckets[-1], next(b for b in buckets if b >= SHORT_TURN_TOKENS
                                         or b == buckets[-1])})
    return {b: next(c for c in covering if c > b) for b in buckets if b not in covering}


def _padded_row_counts(max_rows: int) -> list[int]:
    """Every row count `_pad_rows` makes for 1 .. max_rows rows: 1, 2, 4, ..."""
    return [1 << i for i in range(backend.next_power_of_2(max_rows).bit_length())]
