"""`Engine`: requests in, tokens out, one `step()` at a time (embeddable in a research loop).

    engine = Engine(EngineConfig(mode="tangram"))
    engine.add_request(request_id="a", prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...

One step, top to bottom (tokens arrive one step late, so the device never waits on Python):
1. the scheduler decides (decode batch, prefill pieces, admissions by reservation);
2. the engine turns its output into a `step_plan.StepPlan` (prefill rows, decode rows, the
   first-token rows of prompts that end, block-table writes: data only);
3. the runner executes the plan (`ModelRunner.execute`): prefill rows chunk by chunk (each
   compresses and writes its kept K/V into the pool), the decode batch (one token for every
   decoding sequence, padded to its bucket; input tokens come from the device, so the previous
   step's tokens need not be on the host yet), then the first tokens;
4. the scheduler commits this step's lengths with placeholder tokens (forks' page copies are
   queued: `ModelRunner.copy_pages`);
5. only now the host waits, for the *previous* step's tokens (the device is busy with this
   step meanwhile): placeholders are filled in, stop conditions end requests, outputs return
   (`requests.LiveRequest.output`).

Bad input raises from `add_request` (ValueError/TypeError naming the problem) before anything is
queued, so the other requests keep being served (the intake: `request_intake.RequestIntake`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Sequence as SequenceABC

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax.engine import inputs, kv_savings, memory
from tangram_jax.engine.collector import paused_collector
from tangram_jax.engine.compile_cache import enable_compile_cache
from tangram_jax.engine.host_offload import SWAP_PROGRAMS, time_host_copy
from tangram_jax.engine.config import (DEFAULT_KV_CACHE_TOKENS, EngineConfig, EngineConfigError,
                                       pool_is_fixed)
from tangram_jax.engine.decode_step import LOGPROB_MODES
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
from tangram_jax.engine.request_intake import RequestIntake
from tangram_jax.engine.requests import (PLACEHOLDER, InFlightToken, LiveRequest, ParentRequest,
                                         RequestFailed, sampling_rows)
from tangram_jax.engine.step_plan import DecodeRows, FirstTokenRows, StepPlan, prefill_rows
from tangram_jax.engine import distributed
from tangram_jax.engine.tensor_parallel import devices_for
from tangram_jax.engine.outputs import CompletionOutput, RequestOutput
from tangram_jax.kv_layout import TieredLayout, pages_for
from tangram_jax.models.generation_config import GenerationConfigError, default_sampling_params
from tangram_jax.models.registry import (DEFAULT_MODEL, ModelSource, load_in_background,
                                         load_model, open_model)
from tangram_jax.models.tokenizer import ChatTemplateError, load_chat_template
from tangram_jax.scheduler.host_pool import HostKVPool
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


class Engine(RequestIntake):
    """The serving engine: model, KV layout, page manager, scheduler and runner of one config."""

    def __init__(self, config: EngineConfig | None = None, *,
                 devices: SequenceABC[jax.Device] | None = None, **kwargs):
        """`config`, or its fields as keyword arguments. devices: the `tensor_parallel_size`
        devices this engine's weights, KV pool and steps live on (default: the first ones);
        `LLM`'s data-parallel replicas pass their own (after `memory.configure_allocator`:
        listing devices starts JAX's backend). Python's garbage collector is paused while the
        engine is built (`collector.paused_collector`)."""
        with paused_collector() as self._collector:
            self._build(config, devices, kwargs)

    def _build(self, config: EngineConfig | None, devices, kwargs: dict) -> None:
        cfg = config if config is not None else EngineConfig(**kwargs)
        if config is not None and kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.config = cfg
        distributed.start(cfg)   # before anything starts JAX's backend
        cfg.check()   # before the model loads: a bad combination is reported at once
        if cfg.data_parallel_size > 1 and devices is None:
            raise EngineConfigError(
                f"data_parallel_size must be 1 for an Engine (one replica), got "
                f"{cfg.data_parallel_size}: LLM(...) runs that many replicas, one per device "
                f"(the serve and chat commands run one engine)")
        started = time.perf_counter()
        # Both before anything compiles or touches the GPU: JAX fixes its allocator cap when
        # its backend starts, and caches only what compiles after the folder is set.
        self.compile_cache_dir = enable_compile_cache(cfg.compile_cache_dir)
        allocator = memory.configure_allocator(cfg.gpu_memory_utilization)
        self.devices = list(devices) if devices is not None else \
            devices_for(cfg.tensor_parallel_size)
        if len(self.devices) != cfg.tensor_parallel_size:
            raise EngineConfigError(f"tensor_parallel_size {cfg.tensor_parallel_size} needs as "
                                    f"many devices, got {len(self.devices)}")
        self.device = self.devices[0]
        # Where the model's config is known before its weights are read (a HF folder, a model
        # in the converted-model cache, a `ModelSource`), the weights load on another thread
        # while the runner compiles its steps for their shapes (`_weights_loaded` waits).
        source = (cfg.model if isinstance(cfg.model, ModelSource) else None
                  if callable(cfg.model) else open_model(cfg.model, dtype=cfg.dtype))
        loaded = None
        if source is None:
            with jax.default_device(self.device):   # the weights load onto the engine's device
                loaded = cfg.model() if callable(cfg.model) else load_model(cfg.model,
                                                                           dtype=cfg.dtype)
        load_seconds = time.perf_counter() - started
        model = source or loaded
        self.model_name = model.name
        self.model_config = mc = model.config
        # What a request without SamplingParams is served with (vLLM's generation_config).
        try:
            self.default_sampling_params, self.default_sampling_source = \
                default_sampling_params(cfg.generation_config, model.source)
        except GenerationConfigError as e:
            raise EngineConfigError(f"generation_config: {e}") from None
        chat_template = None
        if cfg.chat_template is not None:
            try:
                chat_template = load_chat_template(cfg.chat_template)
            except ChatTemplateError as e:
                raise EngineConfigError(f"chat_template: {e}") from None
        self.resolved = rc = cfg.resolve(mc, is_embedded=model.name == DEFAULT_MODEL)
        self.layout = rc.layout
        self.max_model_len = rc.max_model_len
        # Serve with the scorer the budgets were calibrated with (a profile made with a method
        # the chunk compression cannot run is refused here, by RunnerConfig).
        self.compression_method = rc.compression_method
        buckets = rc.decode_buckets
        # The manager's block table: [max_seqs + 1 (the null slot), layers, groups, max_pages].
        table_shape = (cfg.max_num_seqs + 1, mc.num_layers, self.layout.num_groups,
                       rc.max_pages_per_seq)
        # What the allocator reports (None on a CPU): sizes the pool, or checks a fixed one.
        device_memory = memory.DeviceMemory.read(self.device, allocator.fraction)
        # The load starts once the steps are lowered (`_start_loading`): the allocator read
        # above holds none of the weights.
        self._source = source
        self._loading, self._load_seconds, self._load_wait = None, None, 0.0
        fixed = pool_is_fixed(cfg)
        if device_memory is None and not fixed and jax.default_backend() != "cpu":
            log.warning("the %s allocator reports no memory cap (XLA_PYTHON_CLIENT_ALLOCATOR="
                        "platform?): gpu_memory_utilization cannot size the KV pool, which gets "
                        "the default %d tokens; set kv_cache_tokens or num_pages",
                        jax.default_backend(), DEFAULT_KV_CACHE_TOKENS)
        self.runner = ModelRunner(
            source.abstract_model() if source is not None else loaded.model, mc, self.layout,
            rc.num_pages if device_memory is None and not fixed else None,   # else below
            table_shape, devices=self.devices,
            runner_config=RunnerConfig(mode=cfg.mode, obs_window=rc.obs_window,
                                       method=self.compression_method,
                                       scoring_rule=rc.scoring_rule,
                                       dynamic_ratio=cfg.ratio, layer_loop=cfg.layer_loop,
                                       max_prefill_tokens=rc.max_num_batched_tokens,
                                       prefill_token_buckets=cfg.prefill_token_buckets,
                                       decode_buckets=tuple(rc.decode_buckets),
                                       num_programs=cfg.num_programs,
                                       split_map=cfg.split_map),
            pool_format=rc.pool_format)
        if loaded is not None:
            self.tokenizer = loaded.tokenizer
        del loaded, model
        # What the allocator will hold once the weights are in (it holds them already when
        # they loaded here).
        in_use = None if device_memory is None else device_memory.bytes_in_use + (
            self.runner.weight_bytes() if source is not None else 0)
        self.memory_plan: memory.PoolPlan | None = None
        pool = memory.pool_by_bytes(self.runner, self.layout, self.max_model_len)
        warm = cfg.warmup or (cfg.warmup is None and self.runner.ops.name == "pallas")

        def step_peak(pages) -> int:
            """Peak bytes of the steps compiled for a pool of `pages`: with warm-up, every
            program it compiles but the host tier's copies (all compiling at once, kept for
            warm-up), else the largest decode bucket and prefill."""
            if warm:
                compiled = [c for name, c in self.runner.precompile(
                    pages, on_lowered=self._steps_lowered,
                    **self._warmup_arguments(rc.host_kv_cache_bytes > 0, table_shape))
                    if name not in SWAP_PROGRAMS]
            else:
                compiled = self.runner.compile_steps(pages, max(buckets), cfg.max_prefill_rows,
                                                     on_lowered=self._steps_lowered).values()
            # Until the pool is sized, the room it leaves for steps is this peak (background
            # compiles are held to `step_peak_budget`).
            self.runner.step_peak_budget = max(memory.step_peak_bytes(c) for c in compiled)
            return self.runner.step_peak_budget

        if fixed:
            pages = rc.num_pages
            if cfg.kv_cache_memory_bytes is not None:
                try:
                    pages = memory.pages_in_bytes(pool, cfg.kv_cache_memory_bytes,
                                                  self.max_model_len)
                except ValueError as e:
                    raise EngineConfigError(str(e)) from None
            if device_memory is not None:   # before the pool exists: refused, not OOM later
                try:
                    # The room the pool leaves for steps, which a background compile may use
                    # (a narrower program can need a few hundred bytes more than the largest
                    # warm-up program: 512 bytes at the 8B shape).
                    self.runner.step_peak_budget = memory.check_fixed_pool_fits(
                        self.runner, self.device, cfg, pool, pages, step_peak, allocator,
                        weights_loaded=self._weights_loaded)
                except ValueError as e:
                    raise EngineConfigError(str(e)) from None
            self.runner.allocate_pool(pages)
        elif device_memory is not None:
            if allocator.note:
                log.warning(allocator.note)
            self.memory_plan = memory.size_pool(self.device, cfg, pool, step_peak,
                                                allocator.fraction, in_use_bytes=in_use,
                                                weights_loaded=self._weights_loaded)
            self.runner.step_peak_budget = self.memory_plan.step_room_bytes   # as above
            self.runner.allocate_pool(self.memory_plan.num_pages)
        self._weights_loaded()
        if chat_template is not None:
            self.tokenizer.use_chat_template(chat_template)
        self.manager = KVCacheManager(
            self.layout, self.runner.num_pages, cfg.max_num_seqs,
            rc.max_pages_per_seq,
            model_kv_shape=(mc.num_layers, mc.num_kv_heads, mc.head_dim), policy=rc.policy)
        assert self.manager.block_tables.shape == table_shape, (self.manager.block_tables.shape,
                                                                table_shape)
        # The host tier idle sessions are swapped to (`scheduler/host_pool.py`): its page bytes
        # are whole pages (every device's share), its bandwidth measured now.
        self.host_pool = HostKVPool(rc.host_kv_cache_bytes, [
            b * cfg.tensor_parallel_size for b in self.runner.tier_page_bytes])
        if self.host_pool.enabled:
            self.host_pool.observe_transfer(*time_host_copy(
                self.device, min(64 << 20, rc.host_kv_cache_bytes)))
        self.scheduler = Scheduler(self.manager, decode_buckets=buckets,
                                   max_num_batched_tokens=rc.max_num_batched_tokens,
                                   long_prefill_token_threshold=rc.long_prefill_token_threshold,
                                   max_long_partial_prefills=rc.max_long_partial_prefills,
                                   host=self.host_pool)
        # The one session table (id -> sequence, eviction ranking, prefix lookup).
        self.sessions = self.scheduler.sessions
        log.info("%s", memory.describe_pool(self.kv_pool(), self.memory_plan))
        self._requests: dict[str, LiveRequest] = {}
        # Requests of n > 1: parent id -> parent, and each live child's id -> (parent, index).
        self._parents: dict[str, ParentRequest] = {}
        self._child_of: dict[str, tuple[ParentRequest, int]] = {}
        self._next_id = 0
        self._in_flight: list[InFlightToken] = []
        self._steps_dispatched = 0    # numbers the steps for the host tier's rate meter
        self._in_flight_step = 0      # the step `_in_flight` came from
        self.tokens_processed = 0
        # Where the step loop's time goes: seconds inside `step`; of them, inside the runner's
        # dispatch of a step (which returns at once unless a call waits on the device) and
        # blocked on a dispatched step's tokens; the rest is the host's own work (scheduling,
        # planning, bookkeeping), which runs while the device computes only if neither wait
        # took the device's time.
        self.step_seconds = 0.0
        self.dispatch_seconds = 0.0
        self.token_wait_seconds = 0.0
        self._warm_variants: set = set()   # what `warmup` compiled (logprob modes, prefills)
        # Seconds of the start-up: loading the weights, the rest of the build (pool sizing
        # included), warm-up (compiling every step shape), total. Weights that loaded on their
        # own thread (`load_overlapped`) ran beside the build, which holds the seconds it
        # waited for them after its compiles (`load_wait`).
        self.load_overlapped = self._load_seconds is not None
        self.startup_seconds = {
            "load_model": self._load_seconds if self.load_overlapped else load_seconds,
            "build": time.perf_counter() - started - (0 if self.load_overlapped
                                                      else load_seconds),
            "load_wait": self._load_wait, "collect": self._collector.seconds or 0.0,
            "warmup": 0.0}
        if warm:
            self.warmup()
        # Page-lock the host tier's memory once the engine is ready, not beside the build, and
        # only while no request is in it (`pin_host_memory` says why).
        # It sees the engine through a weak reference, and stops when the engine is dropped:
        # a thread holding it would keep its pool on the device while the next engine of the
        # process sizes its own (`bench serve` builds one a configuration).
        engine = weakref.ref(self)

        def idle() -> bool:
            return (e := engine()) is not None and not e._requests

        self.runner.host_tier.pin_host_memory(rc.host_kv_cache_bytes, idle=idle)
        weakref.finalize(self, self.runner.host_tier.stop_pinning)
        self.startup_seconds["total"] = time.perf_counter() - started

    def _steps_lowered(self) -> None:
        """The build's programs are lowered and compiling outside Python's lock: start loading
        the weights, and run the build's one garbage collection (`collector`) meanwhile."""
        self._start_loading()
        self._collector.collect_once()

    def _start_loading(self) -> None:
        """Start loading the weights of a `ModelSource` on their own thread (once; with the
        steps lowered for their shapes, so the loader's Python does not slow the lowering)."""
        if self._source is not None:
            self._loading = load_in_background(self._source, self.device)
            self._source = None

    def _weights_loaded(self) -> None:
        """Wait for the weights loading on their own thread, if they are, and hand them to the
        runner (with the tokenizer that came with them); `_load_wait`: the seconds waited."""
        self._start_loading()   # nothing compiled before (a CPU engine): they load now
        if self._loading is None:
            return
        started = time.perf_counter()
        loading, self._loading = self._loading, None
        loaded, self._load_seconds = loading.result()
        self.runner.load_weights(loaded.model)
        self.tokenizer = loaded.tokenizer
        self._load_wait = time.perf_counter() - started

    def limit_kv_cache(self, nbytes: int | None) -> None:
        """Serve as if the KV pool held `nbytes` (`kv_cache_memory_bytes`; None: all of it):
        the scheduler hands out only that many bytes' pages, the arrays and the compiled steps
        stay as they are. For sweeping the pool's size over one build; the engine must be idle
        (no request, no session held)."""
        if self.has_unfinished_requests() or len(self.sessions):
            raise RuntimeError("limit_kv_cache needs an idle engine: finish the requests and "
                               "end the sessions first")
        physical = self.runner.num_pages
        if nbytes is None:
            self.manager.limit_pages(physical)
            return
        pages = memory.pages_in_bytes(memory.pool_by_bytes(self.runner, self.layout,
                                                           self.max_model_len),
                                      nbytes, self.max_model_len)
        if np.any(np.asarray(pages) > np.asarray(physical)):
            raise ValueError(f"kv_cache_memory_bytes={nbytes} is more than the pool's "
                             f"{self.kv_pool()['bytes']} bytes")
        self.manager.limit_pages(pages)

    def kv_pool(self) -> dict:
        """The pool's size: pages (null pages included), bytes (the arrays', on each device),
        the head-token slots its pages hold and the full-KV tokens that is, what sized it and
        its figures (`memory.pool_report`); with precision tiers each tier's pool too."""
        return memory.pool_report(self.runner, self.layout, self.manager.tier_names, self.config,
                                  self.memory_plan)

    # ----- requests (taken in by `RequestIntake`) ----------------------------------------
    def _report(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs as the caller sees them: a child's become its parent's (`ParentRequest`)."""
        reported = []
        for out in outputs:
            link = self._child_of.get(out.request_id)
            if link is None:
                reported.append(out)
                continue
            parent, index = link
            if out.finished:
                del self._child_of[out.request_id]
            merged = parent.report(index, out)
            if merged is not None:
                reported.append(merged)
            if merged is not None and merged.finished:
                del self._parents[parent.request_id]
        return reported

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now and free its pages (a session's cache too). Returns its final
        output (finish_reason "abort")."""
        inputs.check_id("request_id", request_id)
        parent = self._parents.pop(request_id, None)
        if parent is not None:   # every live completion ends; the output holds all of them
            last = None
            for child_id in parent.child_ids:
                if child_id in self._requests:
                    last = self._abort_one(child_id)
                    parent.report(self._child_of.pop(child_id)[1], last)
            return dataclasses.replace(
                last, request_id=request_id, finished=True,
                outputs=[parent.latest.get(i) or CompletionOutput(i, "", [], "abort")
                         for i in range(len(parent.child_ids))])
        out = self._abort_one(request_id)
        if request_id in self._child_of:   # one completion of n: its parent records the end
            merged = self._report([out])
            if merged and merged[0].finished:   # it was the last one running
                return merged[0]
        return out

    def _abort_one(self, request_id: str) -> RequestOutput:
        """End one live (child) request now: its pages go back, its output says "abort"."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"no live request {request_id!r}")
        self.scheduler.abort(request_id)
        self._move_host_kv()   # a swapped session's host copy goes
        req.drop_placeholders()
        return self._output(req, "abort")

    def end_session(self, session_id: str) -> None:
        """Free an idle session's pages."""
        inputs.check_id("session_id", session_id)
        self.scheduler.close_session(session_id)
        self._move_host_kv()   # a swapped session's host copy goes

    # Sessions: questions answered by the scheduler's `SessionTable` (`self.sessions`).
    def find_session(self, token_ids: SequenceABC[int]) -> tuple[str | None, list[int]]:
        """The idle session whose history is the longest prefix of `token_ids`, and the tokens
        after it (all of them and None when no session matches)."""
        token_ids = inputs.check_token_ids("token_ids", token_ids, self.model_config.vocab_size)
        best, n = self.sessions.find_prefix(token_ids)
        return best, list(token_ids[n:])

    def new_session_id(self, exclude: SequenceABC[str] = (), prefix: str = "session-") -> str:
        """A fresh id (`prefix` + a number) for a session found by prefix later (anonymous:
        forgotten when its cache is evicted while idle, see `SessionTable`)."""
        return self.sessions.new_id(prefix=prefix, exclude=exclude)

    def has_session(self, session_id: str) -> bool:
        """Whether `session_id` names a session the engine holds (running, queued or idle)."""
        return session_id in self.sessions

    def session_is_cached(self, session_id: str) -> bool:
        """Whether an idle session still holds its compressed history in the pool (an evicted
        one would re-prefill it)."""
        return self.sessions.is_cached(session_id)

    def session_is_busy(self, session_id: str) -> bool:
        """Whether a session's turn is queued or running."""
        return self.sessions.is_busy(session_id)

    def is_live(self, request_id: str) -> bool:
        """Whether `request_id` is queued or running."""
        return request_id in self._requests or request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stream(self):
        """Step until every request has finished, yielding each output as it comes (an
        iterator for a loop that owns the engine; `AsyncEngine` for an event loop)."""
        while self.has_unfinished_requests():
            yield from self.step()

    # ----- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Dispatch one scheduler step to the device, then report tokens.

        With ``config.async_scheduling`` (the default) tokens are learned one step late (vLLM's
        asynchronous scheduling): the scheduler commits this step's lengths with placeholder
        tokens before any token value is known, decode reads its input tokens from the device,
        and only after this step's work is queued does the host wait for the *previous* step's
        tokens, while the device runs this step. A request whose stop condition is met at step
        N was also scheduled in step N+1; that row's token is dropped (its input, the last real
        token, was written to the cache, so a session's next turn need not prefill it).
        Without it, the host waits for this step's own tokens (the device idles meanwhile).
        """
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - started

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:   # host moves of evictions that admitted nothing, or of closed sessions
            self._move_host_kv()
        in_flight = self._dispatch(out) if not out.is_empty else []
        if self.config.async_scheduling:
            resolving, self._in_flight = self._in_flight, in_flight
            resolved_step, self._in_flight_step = self._in_flight_step, self._steps_dispatched
        else:
            resolving, resolved_step = in_flight, self._steps_dispatched
        outputs = self._resolve(resolving)
        if resolving:   # blocked on that step's tokens: every step up to it has finished
            self.host_pool.steps_done(resolved_step, time.perf_counter())
        for seq in out.capped:   # ended by the scheduler: no KV room left to decode
            req = self._requests.pop(seq.request_id, None)
            if req is not None:
                req.drop_placeholders()
                outputs[seq.request_id] = self._output(req, "length")
        return self._report(list(outputs.values()))

    def _dispatch(self, out) -> list[InFlightToken]:
        """Queue `out`'s device work (`_plan`, `ModelRunner.execute`) and commit its lengths;
        returns its tokens to resolve."""
        plan, decode_reqs, first_reqs = self._plan(out)
        started = time.perf_counter()
        result = self.runner.execute(plan)
        self.dispatch_seconds += time.perf_counter() - started
        prefill_tokens = sum(r.num_tokens for r in plan.prefill)
        self.tokens_processed += prefill_tokens + len(decode_reqs)
        self._steps_dispatched += 1
        self.host_pool.step_dispatched(self._steps_dispatched, prefill_tokens, len(decode_reqs),
                                       started)
        for rid, entries in result.prompt_logprobs.items():
            self._requests[rid].prompt_lp.update(entries)
        for r in first_reqs:   # a family's children start from their parent's prompt entries
            if r.seq.fork_children:
                for c in r.seq.fork_children:
                    self._requests[c.request_id].prompt_lp = dict(r.prompt_lp)
        pending = [(r, result.decode_tokens, i, result.decode_logprobs)
                   for i, r in enumerate(decode_reqs)]
        pending += [(r, result.first_tokens, i, result.first_logprobs)
                    for i, r in enumerate(first_reqs)]
        self.scheduler.commit(out, {r.seq.request_id: PLACEHOLDER for r, *_ in pending},
                              result.retained)
        # Forks the commit made (parallel samples): copy their partly filled pages before any
        # forked sequence decodes (the copy is queued after this step's prefill wrote them).
        self.runner.copy_pages(*self.manager.take_page_copies())
        # commit appended one placeholder per sampled token: remember where it sits.
        return [InFlightToken(r, tokens, row, r.seq.num_tokens - 1, lp)
                for r, tokens, row, lp in pending]

    def _move_host_kv(self) -> None:
        """Run the host tier's moves logged outside a step plan (between steps only releases
        of host copies, of sessions closed or aborted)."""
        self.runner.move_host_kv(self.manager.take_host_transfers())

    def _plan(self, out) -> tuple[StepPlan, list[LiveRequest], list[LiveRequest]]:
        """The step plan of scheduler output `out` (`step_plan`), with the requests of its
        decode rows and of its first-token rows (in row order)."""
        decode_reqs = [self._requests[s.request_id] for s in out.decode_seqs]
        decode = None
        if decode_reqs:
            n, bucket = len(decode_reqs), out.decode_bucket
            positions = np.zeros(bucket, np.int32)
            steps = np.zeros(bucket, np.int32)
            positions[:n] = [r.seq.num_tokens - 1 for r in decode_reqs]
            steps[:n] = [r.seq.num_output_tokens for r in decode_reqs]
            decode = DecodeRows(positions=positions, slots=out.decode_slots,
                                lengths=self.manager.decode_write_lengths(out.decode_slots),
                                sampling=sampling_rows(decode_reqs, bucket, steps,
                                                       self.runner.config.vocab_size))
        pieces = out.prefill_chunks
        wanted = {p.seq.request_id for p in pieces
                  if self._requests[p.seq.request_id].params.prompt_logprobs is not None
                  and self._requests[p.seq.request_id].prompt_lp_entries is None}
        rows = prefill_rows(pieces, self.manager, wanted)
        # A prompt that ends here samples its first token from its last row's logits; a
        # family's (parallel samples) waiting children each sample from the same logits (their
        # own seeds) and are forked at the commit.
        sources, first_reqs = [], []
        for i, p in enumerate(pieces):
            if p.is_last:
                req = self._requests[p.seq.request_id]
                family = [req, *(self._requests[c.request_id] for c in p.seq.fork_children)]
                sources += [i] * len(family)
                first_reqs += family
        first = None
        if first_reqs:
            first = FirstTokenRows(
                sources=tuple(sources), slots=tuple(r.seq.slot for r in first_reqs),
                sampling=sampling_rows(first_reqs, len(first_reqs), np.asarray(
                    [r.seq.num_output_tokens for r in first_reqs], np.int32),
                    self.runner.config.vocab_size))
        plan = StepPlan(table_updates=self.manager.take_table_updates(), prefill=rows,
                        host_transfers=tuple(self.manager.take_host_transfers()),
                        decode=decode, first_tokens=first,
                        max_prefill_rows=self.config.max_prefill_rows)
        return plan, decode_reqs, first_reqs

    def warmup(self, *, logprobs: bool = False) -> None:
        """Compile every step shape now (decode buckets, prefill rows, first-token sampling,
        the page copies of parallel samples' forks) instead of when the first requests meet
        them; takes a while on a GPU.

        logprobs: also the variants of requests that ask for log-probabilities (`logprobs`
        top-k, any count, or -1; `prompt_logprobs`), as a server meets them (`tangram-jax
        serve` asks for them). A later call with it adds only those."""
        started = time.perf_counter()
        modes = LOGPROB_MODES if logprobs else (None,)
        arguments = self._warmup_arguments(self.host_pool.enabled,
                                           self.manager.block_tables.shape, logprobs)
        self.runner.warmup(**dict(
            arguments,
            logprob_modes=[m for m in arguments["logprob_modes"]
                           if m not in self._warm_variants],
            prompt_logprobs=[t for t in arguments["prompt_logprobs"]
                             if ("prompt", t) not in self._warm_variants]))
        self._warm_variants.update(modes)
        self._warm_variants.update(("prompt", t) for t in ((False, True) if logprobs
                                                           else (False,)))
        self.startup_seconds["warmup"] += time.perf_counter() - started
        log.info("warm-up compiled every step shape (%d programs) in %.1f s (compile cache: %s)",
                 len(self.runner.compile_log), self.startup_seconds["warmup"],
                 self.compile_cache_dir or "off")

    def _warmup_arguments(self, host_tier: bool, table_shape, logprobs: bool = False) -> dict:
        """`ModelRunner.warmup_programs`' arguments: what serving can meet (`warmup`): the
        decode buckets, prefill rows, first-token rows, the page copies of parallel samples'
        forks, with `host_tier` the swaps of a session's pages (at most a block table's:
        `table_shape` [slots, layers, groups, pages]), and with `logprobs` every log-prob
        variant."""
        cfg = self.config
        # A fork copies decode cells only (the high tier's groups of a tiered layout).
        decode_groups = (int(self.layout.decode_tier_groups.sum())
                         if isinstance(self.layout, TieredLayout) else self.layout.num_groups)
        return dict(decode_buckets=tuple(self.resolved.decode_buckets),
                    max_prefill_rows=cfg.max_prefill_rows, max_first_tokens=cfg.max_num_seqs,
                    max_page_copies=(cfg.max_num_seqs - 1) * self.model_config.num_layers
                    * decode_groups,
                    max_swap_pages=int(np.prod(table_shape[1:])) if host_tier else 0,
                    logprob_modes=LOGPROB_MODES if logprobs else (None,),
                    prompt_logprobs=(False, True) if logprobs else (False,),
                    background=cfg.background_compile)

    def startup_report(self) -> dict:
        """Where start-up went: `startup_seconds` (load_model, load_wait, build: runner, pool
        and scheduler, collect: the build's garbage collection beside its compiles, warmup,
        total), whether the weights loaded beside the build
        (`load_overlapped`), and one record a program the build (phase "pool": the
        largest steps, for the pool's size) and warm-up (phase "warmup") compiled ({"program",
        "key", "phase", "lower_seconds", "compile_seconds", "hlo_chars"}; phase "background"
        for those compiled after the engine was ready), slowest first, with their count, how
        many are still `compiling` in the background, and summed compile seconds (more than
        the wall time when programs compile side by side; a program warm-up meets again after
        the build is found in jit's cache in well under a second)."""
        programs = sorted(self.runner.compile_log, key=lambda r: -r["compile_seconds"])
        return dict(seconds=dict(self.startup_seconds), load_overlapped=self.load_overlapped,
                    num_programs=len(programs),
                    compile_seconds=sum(r["compile_seconds"] for r in programs),
                    programs=programs, compiling=self.runner.compiles_running())

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for what warm-up left to compile in the background
        (`EngineConfig.background_compile`); True when all of it compiled (False: still
        running, or a program failed and its steps keep the covering program: see the log)."""
        return self.runner.wait_for_compiles(timeout)

    @property
    def is_warm(self) -> bool:
        """Whether `warmup` has compiled the step shapes (see `EngineConfig.warmup`)."""
        return None in self._warm_variants

    def _resolve(self, in_flight: list[InFlightToken]) -> dict[str, RequestOutput]:
        """Fetch a dispatched step's tokens (blocking on it), run the stop checks, end requests.

        Whatever fails for one request (detokenisation, stop checks, a sampling row that could
        not be built) ends that request alone with finish_reason "error"; the others go on."""
        started = time.perf_counter()
        host = {id(t.tokens): np.asarray(t.tokens) for t in in_flight}
        self.token_wait_seconds += time.perf_counter() - started
        host_logprobs: dict[tuple[int, str], np.ndarray] = {}   # fetched once per step array
        now = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        for t in in_flight:
            req, seq = t.request, t.request.seq
            if self._requests.get(seq.request_id) is not req:
                continue   # aborted meanwhile
            try:
                if req.error is not None:
                    raise RequestFailed(req.error)
                reason = self._accept_token(req, t, int(host[id(t.tokens)][t.row]), now,
                                            host_logprobs)
                if reason is not None:
                    req.drop_placeholders()
                    if seq.status.is_running or seq.status is SequenceStatus.WAITING:
                        self.scheduler.finish(seq.request_id)
                    del self._requests[seq.request_id]
                output = self._output(req, reason)
                if output is not None:   # None: a running FINAL_ONLY request
                    outputs[seq.request_id] = output
            except Exception as e:   # noqa: BLE001 - isolate any failure to its own request
                outputs[seq.request_id] = self._end_with_error(req, e)
        return outputs

    def _accept_token(self, req: LiveRequest, t: InFlightToken, token: int, now: float,
                      host_logprobs: dict[tuple[int, str], np.ndarray]) -> str | None:
        """Record one resolved token of `req`; returns its finish reason (None: goes on)."""
        req.seq.token_ids[t.index] = token
        if req.params.logprobs is not None:
            req.record_logprobs(t, token, host_logprobs, self._token_text)
        req.metrics.token_times.append(now)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.stop.append(token)
        reason = req.stop.finish_reason
        if reason is None and t.index + 1 >= self.max_model_len:
            reason = "length"
        return reason

    def _end_with_error(self, req: LiveRequest, error: Exception) -> RequestOutput:
        """End `req` now because something failed for it alone: its pages (and its session's
        cache, whose state is unknown) are freed; the output carries the error text."""
        rid = req.seq.request_id
        text = str(error) if isinstance(error, RequestFailed) else \
            f"{type(error).__name__}: {error}"
        if self._requests.get(rid) is req:
            del self._requests[rid]
            status = req.seq.status
            if status.is_running or status is SequenceStatus.WAITING:
                self.scheduler.abort(rid)
            elif status is SequenceStatus.IDLE:   # failed after its turn was finished
                self.scheduler.close_session(req.seq.session_id)
        req.drop_placeholders()
        out = self._output(req, "error")
        out.error = text
        return out

    def _output(self, req: LiveRequest, finish_reason: str | None) -> RequestOutput | None:
        return req.output(finish_reason, self._token_text, self.model_config.vocab_size)

    def _token_text(self, token: int) -> str:
        """A token's text in log-prob entries: special tokens spelled out (as vLLM does)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # ----- reports -----------------------------------------------------------------------
    def kv_usage(self) -> dict:
        """Pool usage, and the bytes the cached sequences hold against full KV for the same
        tokens (full KV: every layer and KV head keeps every token, in pages of page_size)."""
        usage = self.manager.usage()
        scheduler = self.scheduler.metrics.summary(dict(usage))
        mc = self.model_config
        itemsize = jnp.dtype(self.runner.k_pages.dtype).itemsize
        cached_seqs = self._cached_sequences()
        cached = [s.num_computed_tokens for s in cached_seqs]
        full_slots = int(pages_for(np.asarray(cached, np.int64), self.layout.page_size).sum()) \
            * self.layout.page_size
        # Not usage["pages_used"]: the pool also holds finished requests' pages until the
        # scheduler returns them (it does so lazily). Parallel samples share the prompt's
        # pages: each counts once.
        held = np.atleast_1d(self.manager.distinct_pages_held([s.slot for s in cached_seqs]))
        usage.update(
            kv_bytes_held=int(held @ np.asarray(self.runner.tier_page_bytes)),
            full_kv_bytes=full_slots * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * itemsize,
            # How the retention rule treats the cached tokens (`kv_savings.token_breakdown`).
            token_breakdown=dataclasses.asdict(kv_savings.token_breakdown(cached_seqs,
                                                                          self.layout)),
            tokens_processed=self.tokens_processed,
            scheduler=scheduler,
            host=self.host_pool.summary(),
            pool=self.kv_pool(),
        )
        return usage

    def describe_kv_savings(self) -> str:
        """One sentence: the KV the cached sequences hold against full KV for the same tokens,
        and where those tokens came from; when nothing was saved, why (`kv_savings`)."""
        usage = self.kv_usage()
        return kv_savings.describe(usage["kv_bytes_held"], usage["full_kv_bytes"],
                                   kv_savings.TokenBreakdown(**usage["token_breakdown"]),
                                   self.layout, self.config.mode)

    def _cached_sequences(self) -> list[Sequence]:
        seqs = {id(r.seq): r.seq for r in self._requests.values()}
        seqs.update({id(s): s for s in self.sessions.sequences()})
        return [s for s in seqs.values() if s.is_cached]
