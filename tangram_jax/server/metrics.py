"""Prometheus metrics of the server (`/metrics`, text exposition format).

Counters and histograms are updated as requests end; gauges (live requests, KV pool use (the
fullest tier's pool, and each tier's) and the bytes the cached sequences hold against full KV)
are read from the engine when scraped. Each
server has its own registry, so several servers in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from tangram_jax.engine.async_engine import AsyncEngine
from tangram_jax.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine
        self.registry = r = CollectorRegistry()
        self.finished = Counter("tangram_request_finished", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("tangram_request_rejected",
                                "Requests refused with 429 because the engine was full", registry=r)
        self.prompt_tokens = Counter("tangram_prompt_tokens", "Prompt tokens of ended requests "
                                     "(session history included)", registry=r)
        self.cached_prompt_tokens = Counter("tangram_cached_prompt_tokens", "Prompt tokens a "
                                            "continued session already held in the KV cache",
                                            registry=r)
        self.generation_tokens = Counter("tangram_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("tangram_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tangram_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.live = Gauge("tangram_num_requests_live", "Requests admitted and not yet ended",
                          registry=r)
        self.pool = Gauge("tangram_kv_pool_pages_used_ratio", "Fraction of KV pool pages in use "
                          "(with precision tiers: of the fullest tier's pool, the one that stops "
                          "admission)", registry=r)
        self.tier_pool = Gauge("tangram_kv_tier_pool_pages_used_ratio", "Fraction of each tier's "
                               "KV pool pages in use (tier: its page format; 'pages' untiered)",
                               ["tier"], registry=r)
        self.kv_held = Gauge("tangram_kv_bytes_held", "KV bytes the cached sequences hold",
                             registry=r)
        self.kv_full = Gauge("tangram_kv_full_bytes", "KV bytes the same tokens take uncompressed",
                             registry=r)

    def observe(self, last: RequestOutput | None, generated: int | None = None) -> None:
        """Account one request that ended: `last` is its last output (not finished: aborted),
        None when it was aborted before its first output; `generated`: the tokens all its
        completions generated (default: the last output's completion's)."""
        if last is None or not last.finished:
            self.finished.labels(finish_reason="abort").inc()
            if last is None:
                return
        else:
            self.finished.labels(finish_reason=last.outputs[0].finish_reason).inc()
        m = last.metrics
        self.prompt_tokens.inc(last.num_cached_tokens + len(last.prompt_token_ids))
        self.cached_prompt_tokens.inc(last.num_cached_tokens)
        self.generation_tokens.inc(len(m.token_times) if generated is None else generated)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    async def render(self) -> tuple[bytes, str]:
        self.live.set(self.async_engine.num_live_requests)
        if self.async_engine.is_alive:
            usage = await self.async_engine.call(lambda engine: engine.kv_usage())
            self.pool.set(usage["fullest_pool_utilisation"])
            for tier, pages in usage["tiers"].items():
                self.tier_pool.labels(tier=tier).set(pages["pages_used"] /
                                                     max(1, pages["pages_total"]))
            self.kv_held.set(usage["kv_bytes_held"])
            self.kv_full.set(usage["full_kv_bytes"])
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
