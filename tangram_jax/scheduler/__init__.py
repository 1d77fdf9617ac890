"""Host-side page pool, block tables, KV-cache manager and scheduler (plain numpy).

- `page_pool.PagePool`: one pool of identical pages (page 0 is the never-allocated null page);
  the manager keeps one per precision tier (`kv_layout.TieredLayout`), one otherwise.
- `block_table.BlockTable`: ``[slot, layer, group, max_pages]`` page ids, whole-array updates,
  with an update log for a device-resident copy.
- `kv_cache_manager.KVCacheManager`: slots, Budget Reservation (``policy="reserve"``), decode
  growth, and the dynamic compress-and-reclaim baseline (``policy="reclaim"``).
- `sequence.Sequence`: per-request / per-session state.
- `sessions.SessionTable`: the one owner of multi-turn sessions (id -> sequence, eviction
  ranking by idle time and recompute cost, prefix lookup).
- `scheduler.Scheduler`: continuous batching, chunked prefill with a cap on long prefills,
  admission by reservation (`admission.AdmissionScheduling`, a part of it), preemption by
  recompute, session eviction; each step's work is a `output.SchedulerOutput`.
- `metrics.SchedulerMetrics`: control-plane host time, preemptions, evictions, rejections.
"""
