"""`Engine`: requests in, tokens out, one `step()` at a time (embeddable in a research loop).

    engine = Engine(EngineConfig(mode="tangram"))
    engine.add_request(request_id="a", prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...

One step, top to bottom (tokens arrive one step late, so the device never waits on Python):
1. the scheduler decides (decode batch, prefill pieces, admissions by reservation);
2. prefill pieces run chunk by chunk (each compresses and writes its kept K/V into the pool);
3. the decode batch runs (one token for every decoding sequence, padded to its bucket; input
   tokens come from the device, so the previous step's tokens need not be on the host yet);
4. first tokens of finished prefills are sampled;
5. the scheduler commits this step's lengths with placeholder tokens;
6. only now the host waits, for the *previous* step's tokens (the device is busy with this
   step meanwhile): placeholders are filled in, stop conditions end requests, outputs return.

Bad input raises from `add_request` (ValueError/TypeError naming the problem) before anything is
queued, so the other requests keep being served.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax.engine import memory
from tangram_jax.engine.compile_cache import enable_compile_cache
from tangram_jax.engine.config import (DEFAULT_KV_CACHE_TOKENS, EngineConfig, build_layout,
                                       pool_is_fixed, pool_pages)
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
from tangram_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tangram_jax.kv_layout import pages_for
from tangram_jax.models.registry import DEFAULT_MODEL, load_model
from tangram_jax.pallas_kernels.split_map import build_split_map
from tangram_jax.sampling import SamplingParams, StopChecker, resolve_seed
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import Sequence, SequenceStatus


log = logging.getLogger(__name__)

# Token value of a sampled token the host has not fetched yet (token ids are never negative).
_PLACEHOLDER = -1


@dataclasses.dataclass
class _Request:
    """Engine-side state of one live request (the scheduler holds its `Sequence`)."""

    seq: Sequence
    params: SamplingParams
    seed: int
    stop: StopChecker
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


class _InFlightToken(NamedTuple):
    """A token sampled by a dispatched step: row `row` of device array `tokens`, which goes to
    ``request.seq.token_ids[index]`` (a placeholder until then)."""

    request: _Request
    tokens: jax.Array
    row: int
    index: int


class Engine:
    """The serving engine: model, KV layout, page manager, scheduler and runner of one config."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        cfg = config if config is not None else EngineConfig(**kwargs)
        if config is not None and kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.config = cfg
        started = time.perf_counter()
        # Both before anything compiles or touches the GPU: JAX fixes its allocator cap when
        # its backend starts, and caches only what compiles after the folder is set.
        self.compile_cache_dir = enable_compile_cache(cfg.compile_cache_dir)
        allocator = memory.configure_allocator(cfg.gpu_memory_utilization)
        loaded = load_model(cfg.model, dtype=jnp.dtype(cfg.dtype))
        load_seconds = time.perf_counter() - started
        self.model_name = loaded.name
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.layout = build_layout(cfg, mc, is_embedded=loaded.name == DEFAULT_MODEL)
        self.max_model_len = int(cfg.max_model_len or mc.max_position_embeddings)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"length {mc.max_position_embeddings}")
        if mc.sliding_window is not None and mc.sliding_window < self.max_model_len:
            # Paged attention here reads every retained token; a window would need a per-step
            # lower bound on positions, which the kernels do not take.
            raise ValueError(f"{mc.architecture} with sliding_window {mc.sliding_window} is not "
                             f"supported by the paged engine; set max_model_len <= "
                             f"{mc.sliding_window}")
        buckets = [b for b in cfg.decode_buckets if b < cfg.max_num_seqs]
        buckets.append(next((b for b in cfg.decode_buckets if b >= cfg.max_num_seqs),
                            cfg.max_num_seqs))
        split_maps = {b: build_split_map(self.layout.group_budgets, cfg.num_programs, b,
                                         group_size=self.layout.group_size) for b in buckets}
        max_pages = int(pages_for(self.max_model_len, cfg.page_size)) + 1
        # The manager's block table: [max_seqs + 1 (the null slot), layers, groups, max_pages].
        table_shape = (cfg.max_num_seqs + 1, mc.num_layers, self.layout.num_groups, max_pages)
        device_memory = None if pool_is_fixed(cfg) else memory.DeviceMemory.read(
            jax.devices()[0], allocator.fraction)
        if device_memory is None and not pool_is_fixed(cfg) and jax.default_backend() != "cpu":
            log.warning("the %s allocator reports no memory cap (XLA_PYTHON_CLIENT_ALLOCATOR="
                        "platform?): gpu_memory_utilization cannot size the KV pool, which gets "
                        "the default %d tokens; set kv_cache_tokens or num_pages",
                        jax.default_backend(), DEFAULT_KV_CACHE_TOKENS)
        self.runner = ModelRunner(
            loaded.model, mc, self.layout,
            pool_pages(cfg, mc, self.layout) if device_memory is None else None, table_shape,
            split_maps=split_maps,
            runner_config=RunnerConfig(mode=cfg.mode, obs_window=min(cfg.obs_window,
                                                                        cfg.chunk_size),
                                       dynamic_ratio=cfg.ratio, layer_loop=cfg.layer_loop))
        del loaded
        self.memory_plan: memory.PoolPlan | None = None
        if device_memory is not None:
            if allocator.note:
                log.warning(allocator.note)
            self.memory_plan = self._size_pool(max(buckets), allocator.fraction)
            self.runner.allocate_pool(self.memory_plan.num_pages)
        num_pages = int(self.runner.k_pages.shape[0])
        self.manager = KVCacheManager(
            self.layout, num_pages, cfg.max_num_seqs, max_pages,
            model_kv_shape=(mc.num_layers, mc.num_kv_heads, mc.head_dim),
            policy="reclaim" if cfg.mode == "dynamic" else "reserve")
        assert self.manager.block_tables.shape == table_shape, (self.manager.block_tables.shape,
                                                                table_shape)
        self.scheduler = Scheduler(
            self.manager, decode_buckets=tuple(buckets),
            max_num_batched_tokens=max(cfg.max_num_batched_tokens,
                                       cfg.max_num_seqs + cfg.chunk_size))
        log.info("%s", self._pool_line())
        self._requests: dict[str, _Request] = {}
        self._sessions: dict[str, Sequence] = {}
        self._next_id = 0
        self._in_flight: list[_InFlightToken] = []
        self.tokens_processed = 0
        # Seconds of the start-up: loading the weights, the rest of the build (pool sizing
        # included), warm-up (compiling every step shape), total.
        self.startup_seconds = {"load_model": load_seconds,
                                "build": time.perf_counter() - started - load_seconds,
                                "warmup": 0.0}
        if cfg.warmup or (cfg.warmup is None and self.runner.ops.name == "pallas"):
            self.warmup()
        self.startup_seconds["total"] = time.perf_counter() - started

    def _size_pool(self, max_bucket: int, fraction: float) -> memory.PoolPlan:
        """The pool under `gpu_memory_utilization` (see `engine/memory.py`): compile the largest
        decode bucket and prefill for a provisional pool that leaves `step_reserve` free, read
        their peak, and keep the provisional size when the peak fits in the reserve (the
        compiled steps are then reused as they are), else shrink the pool to fit."""
        cfg, layout = self.config, self.layout
        device = jax.devices()[0]
        now = memory.DeviceMemory.read(device, fraction)        # weights are in memory now
        page_bytes = self.runner.kv_bytes_per_page
        budget, _ = memory.budget_bytes(now.card_bytes, cfg.gpu_memory_utilization,
                                        now.bytes_limit)
        # One max_model_len sequence must fit, or nothing could be served.
        min_pages = int(pages_for(layout.retained_counts(self.max_model_len),
                                  layout.page_size).sum()) + 1
        provisional = memory.pages_that_fit(budget, now.bytes_in_use,
                                            memory.step_reserve(budget), 0, page_bytes)
        compiled = self.runner.compile_steps(max(provisional, min_pages), max_bucket,
                                             cfg.max_prefill_rows)
        peak = max(memory.step_peak_bytes(c) for c in compiled.values())
        return memory.plan_pool(now, cfg.gpu_memory_utilization, peak, page_bytes,
                                min_pages=min_pages,
                                prefer_pages=provisional if provisional >= min_pages else None)

    def _pool_line(self) -> str:
        pool = self.kv_pool()
        if self.memory_plan is not None:
            return self.memory_plan.describe(pool["full_kv_tokens"])
        return (f"KV pool {pool['num_pages']:,} pages ({pool['full_kv_tokens']:,} full-KV "
                f"tokens, {pool['bytes'] / memory.GIB:.2f} GiB), sized by {pool['sized_by']}")

    def kv_pool(self) -> dict:
        """The pool's size: pages, bytes, full-KV tokens it holds (every layer and KV head
        keeping every token; compressed modes hold more), what sized it and, when
        `gpu_memory_utilization` did, the figures it used (`memory.PoolPlan`)."""
        mc, cfg = self.model_config, self.config
        num_pages = int(self.runner.k_pages.shape[0])
        slots = (num_pages - 1) * self.layout.page_size * self.layout.group_size  # no null page
        pool = {"num_pages": num_pages, "bytes": num_pages * self.runner.kv_bytes_per_page,
                "full_kv_tokens": slots // (mc.num_layers * mc.num_kv_heads),
                "sized_by": ("num_pages" if cfg.num_pages is not None else "kv_cache_tokens"
                             if self.memory_plan is None else "gpu_memory_utilization")}
        if self.memory_plan is not None:
            pool["plan"] = dataclasses.asdict(self.memory_plan)
        return pool

    # ----- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str | None = None, prompt: str | None = None, *,
                    prompt_token_ids: SequenceABC[int] | None = None,
                    messages: SequenceABC[dict] | None = None,
                    sampling_params: SamplingParams | None = None,
                    session_id: str | None = None) -> str:
        """Queue a request; returns its id. Give exactly one of `prompt` (text),
        `prompt_token_ids` or `messages` (chat, templated here). With `session_id`, the request
        is the next turn of that session: its tokens are appended to the session's history."""
        if request_id is None:
            request_id = f"request-{self._next_id}"
            self._next_id += 1
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got "
                            f"{type(sampling_params).__name__}")
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError(f"request {request_id!r}: the prompt is empty")
            ids = self.tokenizer.encode(prompt)
        elif messages is not None:
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        else:
            ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the "
                             f"vocabulary [0, {vocab})")
        history = 0
        if session_id is not None:
            seq = self._sessions.get(session_id)
            if seq is not None and seq.status.is_done:
                del self._sessions[session_id]
                seq = None
            history = seq.num_tokens if seq is not None else 0
        total = history + len(ids)
        if total >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {total} tokens (session history "
                             f"included) leaves no room to generate within max_model_len "
                             f"{self.max_model_len}")
        now = time.perf_counter()
        seq = self.scheduler.add_request(request_id, ids, sampling_params, session_id=session_id,
                                         arrival_time=now)
        if session_id is not None:
            self._sessions[session_id] = seq
        self._requests[request_id] = _Request(
            seq=seq, params=sampling_params, seed=resolve_seed(sampling_params),
            stop=StopChecker(self.tokenizer.decode, sampling_params,
                             self.tokenizer.eos_token_ids, ids),
            prompt=prompt, prompt_token_ids=ids, metrics=RequestMetrics(arrival_time=now))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages (a session's cache too)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"no live request {request_id!r}")
        self.scheduler.abort(request_id)
        if req.seq.session_id is not None:
            self._sessions.pop(req.seq.session_id, None)

    def end_session(self, session_id: str) -> None:
        """Free an idle session's pages."""
        self.scheduler.close_session(session_id)
        self._sessions.pop(session_id, None)

    def find_session(self, token_ids: SequenceABC[int]) -> tuple[str | None, list[int]]:
        """The idle session whose history is the longest prefix of `token_ids`, and the tokens
        after it (all of them and None when no session matches)."""
        best, best_len = None, 0
        for sid, seq in self._sessions.items():
            n = seq.num_tokens
            if (seq.status is SequenceStatus.IDLE and best_len < n < len(token_ids)
                    and list(token_ids[:n]) == seq.token_ids):
                best, best_len = sid, n
        return best, list(token_ids[best_len:])

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

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
        out = self.scheduler.schedule()
        self.runner.update_block_tables(*out.table_updates)
        in_flight = self._dispatch(out) if not out.is_empty else []
        if self.config.async_scheduling:
            outputs = self._resolve(self._in_flight)
            self._in_flight = in_flight
        else:
            outputs = self._resolve(in_flight)
        for seq in out.capped:   # ended by the scheduler: no KV room left to decode
            req = self._requests.pop(seq.request_id, None)
            if req is not None:
                self._drop_placeholders(seq)
                outputs[seq.request_id] = self._output(req, "length")
        return list(outputs.values())

    def _dispatch(self, out) -> list[_InFlightToken]:
        """Queue `out`'s device work and commit its lengths; returns its tokens to resolve."""
        first_logits, first_reqs, reclaim = self._prefill(out.prefill_chunks)
        decode_reqs = [self._requests[s.request_id] for s in out.decode_seqs]
        pending: list[tuple[_Request, jax.Array, int]] = []
        if decode_reqs:
            n, bucket = len(decode_reqs), out.decode_bucket
            positions = np.zeros(bucket, np.int32)
            steps = np.zeros(bucket, np.int32)
            positions[:n] = [r.seq.num_tokens - 1 for r in decode_reqs]
            steps[:n] = [r.seq.num_output_tokens for r in decode_reqs]
            tokens = self.runner.decode(positions, out.decode_slots, out.decode_lengths,
                                        *self._sampling_arrays(decode_reqs, bucket), steps)
            pending += [(r, tokens, i) for i, r in enumerate(decode_reqs)]
            self.tokens_processed += n
        if first_reqs:
            tokens = self.runner.sample(
                first_logits, [r.seq.slot for r in first_reqs],
                *self._sampling_arrays(first_reqs, len(first_reqs)),
                [r.seq.num_output_tokens for r in first_reqs])
            pending += [(r, tokens, i) for i, r in enumerate(first_reqs)]

        self.scheduler.commit(out, {r.seq.request_id: _PLACEHOLDER for r, _, _ in pending},
                              reclaim)
        # commit appended one placeholder per sampled token: remember where it sits.
        return [_InFlightToken(r, tokens, row, r.seq.num_tokens - 1)
                for r, tokens, row in pending]

    def _prefill(self, pieces) -> tuple[list[jax.Array], list[_Request],
                                        dict[str, np.ndarray] | None]:
        """Run this step's prefill pieces: a runner call takes the next compression chunk of up
        to `max_prefill_rows` pieces (chunks of one piece depend on each other, those of
        different pieces do not).
        Returns the last logits [V] and requests of pieces that end their prompt, and each
        piece's retained lengths after compression in dynamic mode (None otherwise)."""
        chunk_size = self.layout.chunk_size
        hist = {p.seq.request_id: self.manager.lengths[p.seq.slot].astype(np.int64)
                for p in pieces}
        first_logits, first_reqs = [], []
        per_call = self.config.max_prefill_rows
        calls = []   # round by round: a piece's next chunk attends to its previous one
        for offset in range(0, max((p.num_tokens for p in pieces), default=0), chunk_size):
            due = [p for p in pieces if p.start + offset < p.end]
            calls += [(offset, due[i:i + per_call]) for i in range(0, len(due), per_call)]
        for offset, rows in calls:
            starts = [p.start + offset for p in rows]
            ends = [min(start + chunk_size, p.end) for start, p in zip(starts, rows)]
            logits, kept = self.runner.prefill(
                [np.asarray(p.seq.token_ids[a:b], np.int32) for p, a, b in zip(rows, starts, ends)],
                starts, [p.seq.slot for p in rows], [hist[p.seq.request_id] for p in rows])
            kept_host = np.asarray(kept) if self.config.mode == "dynamic" else None
            for b, (p, start, end) in enumerate(zip(rows, starts, ends)):
                rid = p.seq.request_id
                if kept_host is not None:   # the per-input count: a host round trip
                    hist[rid] = hist[rid] + kept_host[b]
                else:
                    hist[rid] = hist[rid] + self.layout.chunk_keep_counts(end - start)
                if end == p.end and p.is_last:
                    first_logits.append(logits[b])
                    first_reqs.append(self._requests[rid])
        self.tokens_processed += sum(p.num_tokens for p in pieces)
        return first_logits, first_reqs, (hist if self.config.mode == "dynamic" else None)

    def warmup(self) -> None:
        """Compile every step shape now (decode buckets, prefill rows, first-token sampling)
        instead of when the first requests meet them; takes a while on a GPU."""
        started = time.perf_counter()
        self.runner.warmup(self.scheduler.decode_buckets, self.config.max_prefill_rows,
                           self.config.max_num_seqs)
        self.startup_seconds["warmup"] = time.perf_counter() - started
        log.info("warm-up compiled every step shape in %.1f s (compile cache: %s)",
                 self.startup_seconds["warmup"], self.compile_cache_dir or "off")

    def _resolve(self, in_flight: list[_InFlightToken]) -> dict[str, RequestOutput]:
        """Fetch a dispatched step's tokens (blocking on it), run the stop checks, end requests."""
        host = {id(t.tokens): np.asarray(t.tokens) for t in in_flight}
        now = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        for t in in_flight:
            req, seq = t.request, t.request.seq
            if self._requests.get(seq.request_id) is not req:
                continue   # aborted meanwhile
            token = int(host[id(t.tokens)][t.row])
            seq.token_ids[t.index] = token
            req.metrics.token_times.append(now)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.stop.append(token)
            reason = req.stop.finish_reason
            if reason is None and t.index + 1 >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._drop_placeholders(seq)
                if seq.status.is_running or seq.status is SequenceStatus.WAITING:
                    self.scheduler.finish(seq.request_id)
                del self._requests[seq.request_id]
            outputs[seq.request_id] = self._output(req, reason)
        return outputs

    @staticmethod
    def _drop_placeholders(seq: Sequence) -> None:
        """Forget the tokens of steps dispatched after the request ended."""
        while seq.token_ids and seq.token_ids[-1] == _PLACEHOLDER:
            seq.token_ids.pop()

    @staticmethod
    def _sampling_arrays(reqs: list[_Request], rows: int):
        """Per-row sampling arrays for `rows` rows (padding rows greedy)."""
        t = np.zeros(rows, np.float32)
        k = np.full(rows, -1, np.int32)
        p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        for i, r in enumerate(reqs):
            t[i], k[i], p[i], seeds[i] = (r.params.temperature, r.params.top_k, r.params.top_p,
                                          r.seed)
        return t, k, p, seeds

    def _output(self, req: _Request, finish_reason: str | None) -> RequestOutput:
        if finish_reason is not None:
            req.metrics.finished_time = time.perf_counter()
        return RequestOutput(
            request_id=req.seq.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, req.stop.text, list(req.stop.token_ids), finish_reason)],
            finished=finish_reason is not None, metrics=req.metrics,
            session_id=req.seq.session_id)

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
        # scheduler returns them (it does so lazily).
        held = sum(self.manager.pages_held(s.slot) for s in cached_seqs)
        usage.update(
            kv_bytes_held=held * self.runner.kv_bytes_per_page,
            full_kv_bytes=full_slots * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * itemsize,
            tokens_processed=self.tokens_processed,
            scheduler=scheduler,
            pool=self.kv_pool(),
        )
        return usage

    def _cached_sequences(self) -> list[Sequence]:
        seqs = {id(r.seq): r.seq for r in self._requests.values()}
        seqs.update({id(s): s for s in self._sessions.values()})
        return [s for s in seqs.values() if s.is_cached]
