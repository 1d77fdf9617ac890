"""The host tier end to end on the tiny model (`engine/host_offload.py`,
`scheduler/host_pool.py`): a session swapped to host memory between turns and copied back
gives the same greedy tokens as the same session never evicted, in every mode and KV precision
(the page formats as stored: quantised codes and scales, both tiers of a tiered pool); with no
host room it falls back to recompute and is still right; every device page and host byte comes
back at the end."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams

from test_kv_tiers_serving import _tiered_profile
from tiny_engine import tiny_engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CASES = {   # name: (mode, config overrides)
    "full": ("full", {}),
    "tangram": ("tangram", {}),
    "dynamic": ("dynamic", {}),
    "k8v4": ("tangram", {"kv_precision": "k8v4"}),
    "k8v4-k4v2": ("tangram", {"kv_precision": "k8v4-k4v2"}),
}


def _engine(folder, case, **overrides):
    mode, extra = CASES[case]
    extra = dict(extra, **overrides)
    if extra.get("kv_precision") == "k8v4-k4v2":
        extra["profile"] = _tiered_profile(folder, np.random.default_rng(1).uniform(
            0.2, 0.8, (2, 2)))
    return Engine(tiny_engine_config(folder, mode, **extra))


def _turn(engine, request_id, tokens, session_id="s"):
    engine.add_request(request_id, prompt_token_ids=tokens, session_id=session_id,
                       sampling_params=GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = [o for o in outs if o.request_id == request_id]
    return out.outputs[0].token_ids


def _turns():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 250, size=n).tolist() for n in (37, 11, 20)]


def _conversation(engine, evict: str | None):
    """Three turns of session "s"; between turns `evict` ("host" or "drop") forces it out."""
    answers = []
    for i, tokens in enumerate(_turns()):
        if i and evict is not None:
            swapped = engine.scheduler.evict_session("s")
            assert swapped == (evict == "host")
            _clobber_pool(engine)
        answers.append(_turn(engine, f"t{i}", tokens))
    return answers


def _clobber_pool(engine):
    """Copy the evicted session's pages out now (to host memory), then overwrite every page
    of the pool: what its next turn reads must come back from the host copy (or the replay),
    not from pages that happened to keep their contents."""
    engine._move_host_kv()
    engine.runner.host_tier.settle_all()
    runner = engine.runner
    runner.k_pages, runner.v_pages = jax.tree.map(
        lambda x: jax.device_put(jnp.full_like(x, 3), x.sharding),
        (runner.k_pages, runner.v_pages))


def _all_returned(engine):
    engine.end_session("s")
    m, host = engine.manager, engine.host_pool
    assert m.num_free_slots == m.max_seqs
    np.testing.assert_array_equal(m.num_free_pages, m.capacity)
    assert host.used_bytes == 0 and host.num_held == 0
    assert engine.runner.host_tier.num_copies == 0


@pytest.mark.parametrize("case", list(CASES))
def test_swapped_session_answers_as_if_never_evicted(tiny_folder, case):
    reference = _conversation(_engine(tiny_folder, case), evict=None)
    engine = _engine(tiny_folder, case)
    engine.host_pool.host_bandwidth = 1e15   # swap, whatever the measured rates say
    got = _conversation(engine, evict="host")
    assert got == reference
    metrics = engine.scheduler.metrics
    assert metrics.num_swapped_out == metrics.num_swapped_in == 2
    assert metrics.evicted_recompute_tokens == 0
    _all_returned(engine)


@pytest.mark.parametrize("case", ["tangram", "k8v4-k4v2"])
def test_no_host_room_falls_back_to_recompute(tiny_folder, case):
    reference = _conversation(_engine(tiny_folder, case), evict=None)
    engine = _engine(tiny_folder, case, host_kv_cache_bytes=1)
    got = _conversation(engine, evict="drop")
    assert got == reference   # the replay of the history keeps greedy output exact
    assert engine.scheduler.metrics.num_swapped_out == 0
    assert engine.scheduler.metrics.evicted_recompute_tokens > 0
    _all_returned(engine)


def test_pool_pressure_swaps_idle_sessions_and_restores_them(tiny_folder):
    """No direct call: a small pool, two sessions and a long competing request; the idle
    sessions leave the pool for host memory under pressure and their next turns are the same
    as on a pool large enough for all."""
    def serve(num_pages):
        engine = _engine(tiny_folder, "tangram", num_pages=num_pages)
        engine.host_pool.host_bandwidth = 1e15
        rng = np.random.default_rng(3)
        first = {sid: _turn(engine, f"{sid}-1", rng.integers(0, 250, 60).tolist(), sid)
                 for sid in ("a", "b")}
        _turn(engine, "big", rng.integers(0, 250, 150).tolist(), None)
        second = {sid: _turn(engine, f"{sid}-2", rng.integers(0, 250, 9).tolist(), sid)
                  for sid in ("a", "b")}
        return engine, first, second
    roomy, first, second = serve(160)
    assert roomy.scheduler.metrics.num_evictions == 0
    tight, first_t, second_t = serve(92)
    metrics = tight.scheduler.metrics
    assert metrics.num_swapped_out == metrics.num_swapped_in == 2
    assert (first_t, second_t) == (first, second)
    for sid in ("a", "b"):
        tight.end_session(sid)
    assert tight.host_pool.used_bytes == 0 and tight.runner.host_tier.num_copies == 0
    np.testing.assert_array_equal(tight.manager.num_free_pages, tight.manager.capacity)


def test_swapping_after_warm_up_compiles_nothing(tiny_folder):
    """Warm-up compiles the host tier's page copies (every size a swapped session can need,
    of each tier's pool): a session swapped out and back after it compiles nothing."""
    engine = _engine(tiny_folder, "k8v4-k4v2", warmup=True)
    engine.host_pool.host_bandwidth = 1e15
    assert {"host_copy_out", "host_copy_in"} <= {r["program"] for r in engine.runner.compile_log}
    turns = _turns()
    _turn(engine, "t0", turns[0])
    _turn(engine, "t1", turns[1])   # the follow-up's shapes, before anything is recorded
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    assert engine.scheduler.evict_session("s")
    _turn(engine, "t2", turns[1])
    jax.block_until_ready(engine.runner.k_pages)
    assert compiles == [] and engine.scheduler.metrics.num_swapped_in == 1


TENSOR_PARALLEL_CHILD = r"""
import json, sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[2] + "/engine")
from tiny_engine import tiny_engine_config, tiny_profile
from tangram_jax.engine.llm_engine import Engine
from test_host_offload import _conversation

folder = sys.argv[1]
assert len(jax.devices()) == 2, jax.devices()
report = {}
for precision in ("bf16", "k8v4"):
    runs = {}
    for evict in (None, "host"):
        engine = Engine(tiny_engine_config(folder, "tangram", tensor_parallel_size=2,
                                           kv_precision=precision,
                                           profile=tiny_profile(folder, group_size=2)))
        engine.host_pool.host_bandwidth = 1e15
        runs[str(evict)] = _conversation(engine, evict)
        swapped = engine.scheduler.metrics.num_swapped_in
    report[precision] = dict(equal=runs["None"] == runs["host"], swapped_in=swapped)
print("REPORT " + json.dumps(report))
"""


def test_swapping_a_pool_split_over_two_devices(tmp_path):
    """Tensor parallelism: the pool's head axis is split over the devices; a session swapped
    out of it and back answers as never evicted (bf16 and quantised pages)."""
    from tiny_engine import build_tiny_model, report_of_child
    report = report_of_child(TENSOR_PARALLEL_CHILD, build_tiny_model(tmp_path / "tiny"))
    for precision in ("bf16", "k8v4"):
        assert report[precision] == dict(equal=True, swapped_in=2), report


@pytest.mark.parametrize("bad,match", [
    (-1, "host_kv_cache_bytes must be an int >= 0 or None, got -1"),
    (1.5, "host_kv_cache_bytes must be an int >= 0 or None, got 1.5"),
    ("4G", "host_kv_cache_bytes must be an int >= 0 or None, got '4G'"),
    (True, "host_kv_cache_bytes must be an int >= 0 or None, got True"),
    (1 << 60, "host_kv_cache_bytes=1152921504606846976 exceeds this machine's memory")])
def test_bad_host_budget_is_one_clear_error(bad, match):
    from tangram_jax.engine.config import EngineConfig, EngineConfigError
    with pytest.raises(EngineConfigError, match=match):
        EngineConfig(host_kv_cache_bytes=bad)


def test_host_budget_default_and_off(tiny_folder):
    from tangram_jax.host_memory import default_host_kv_cache_bytes, host_memory_bytes
    default = default_host_kv_cache_bytes()
    assert 0 < default <= min(16 << 30, host_memory_bytes() // 4)
    off = _engine(tiny_folder, "tangram", host_kv_cache_bytes=0)
    assert off.scheduler.host is None and not off.host_pool.enabled
    assert off.kv_usage()["host"]["host_kv_capacity_bytes"] == 0
    _turn(off, "t0", _turns()[0])
    assert off.scheduler.evict_session("s") is False   # recomputed, as without a host tier


@pytest.mark.parametrize("formats", [("bf16",), ("k8v4",), ("k8v4", "k4v2")])
@pytest.mark.parametrize("settle", [True, False])
@pytest.mark.parametrize("pinned", [True, False])
def test_host_tier_moves_whole_pages_of_every_array(formats, settle, pinned):
    """`HostKVTier` on a pool of random contents: pages copied out and back into other page
    ids hold exactly what they held (codes, scales and zeros of quantised formats; each tier's
    pool), whether the copy reached host memory first or is still in flight (the same step's
    gather), kept in page-locked host memory (device arrays of memory kind pinned_host) or,
    where a device has none, as numpy; a dropped copy is gone; other pages are untouched."""
    from tangram_jax import kv_quant
    from tangram_jax.engine.host_offload import HostKVTier
    from tangram_jax.scheduler.host_pool import HostTransfer
    rng = np.random.default_rng(0)

    def make(shape, dtype):
        dtype = jnp.dtype(dtype)
        if jnp.issubdtype(dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 200, shape), dtype)
        return jnp.asarray(rng.normal(size=shape), dtype)
    k, v = kv_quant.allocate_pools([kv_quant.page_format(f) for f in formats],
                                   [20] * len(formats), (2, 4, 16), jnp.bfloat16, make=make)
    before = [jax.tree.map(np.asarray, pool) for pool in kv_quant.tier_pools(k, v)]
    src = tuple(np.array([3, 7, 1, 12], np.int32)[:4 - t] for t in range(len(formats)))
    dst = tuple(np.array([15, 2, 19, 5], np.int32)[:4 - t] for t in range(len(formats)))
    tier = HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert tier.host_sharding is not None      # the CPU backend has pinned host memory too
    if not pinned:
        tier.host_sharding = None
    moves = [HostTransfer("out", 1, src), HostTransfer("out", 2, src)]
    if settle:
        k, v = tier.apply(k, v, moves)
        tier.settle_all()
        assert tier.num_copies == 2 and tier.host_bytes > 0
        kinds = {getattr(leaf, "sharding", None) and leaf.sharding.memory_kind
                 for chunks in tier._copies[1] for _, rows in chunks
                 for leaf in jax.tree.leaves(rows)}
        assert kinds == ({"pinned_host"} if pinned else {None})
        k, v = tier.apply(k, v, [HostTransfer("in", 1, dst), HostTransfer("drop", 2)])
    else:
        k, v = tier.apply(k, v, moves + [HostTransfer("in", 1, dst), HostTransfer("drop", 2)])
    assert tier.num_copies == 0
    for t, (old, new) in enumerate(zip(before, (jax.tree.map(np.asarray, p)
                                                 for p in kv_quant.tier_pools(k, v)))):
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
            np.testing.assert_array_equal(b[dst[t]], a[src[t]])
            others = np.setdiff1d(np.arange(20), dst[t])
            np.testing.assert_array_equal(b[others], a[others])
    with pytest.raises(KeyError, match="no copy 2"):
        tier.apply(k, v, [HostTransfer("drop", 2)])


def test_a_long_session_moves_in_bounded_chunks(monkeypatch):
    """Pages move in chunks of at most `chunk_pages` (`CHUNK_BYTES` of pages): a copy of 21
    pages in chunks of 8 is three gathers of at most 8 pages, restored exactly, and the copy
    sizes warm-up compiles stop at the chunk's."""
    from tangram_jax import kv_quant
    from tangram_jax.engine import host_offload
    from tangram_jax.scheduler.host_pool import HostTransfer
    rng = np.random.default_rng(1)
    k, v = kv_quant.allocate_pools(
        [kv_quant.page_format("k8v4")], [64], (2, 4, 16), jnp.bfloat16,
        make=lambda shape, dtype: jnp.asarray(rng.integers(0, 200, shape) if jnp.issubdtype(
            dtype, jnp.integer) else rng.normal(size=shape), dtype))
    page_bytes = sum(leaf.nbytes // 64 for leaf in jax.tree.leaves((k, v)))
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 8 * page_bytes + page_bytes // 2)
    assert host_offload.chunk_pages((k, v)) == 8
    before = jax.tree.map(np.asarray, (k, v))
    src, dst = np.arange(1, 22, dtype=np.int32), np.arange(63, 42, -1, dtype=np.int32)
    tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    k, v = tier.apply(k, v, [HostTransfer("out", 1, (src,))])
    assert [n for n, _ in tier._copies[1][0]] == [8, 8, 5]
    tier.settle_all()
    k, v = tier.apply(k, v, [HostTransfer("in", 1, (dst,))])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, (k, v)))):
        np.testing.assert_array_equal(b[dst], a[src])
    sizes = {key["pages"] for name, key, _ in host_offload.swap_lowerings(
        k, v, jax.sharding.SingleDeviceSharding(jax.devices()[0]), 64)}
    assert sizes == {8}


def test_a_full_pinned_pool_keeps_copies_in_pageable_memory(monkeypatch):
    """When XLA's page-locked host pool is full (its cap, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB,
    below the host budget: the GPU run that found it crashed the engine), the chunks that do
    not fit are kept in pageable memory: one warning naming the setting, and the session is
    restored exactly, chunks of both kinds."""
    from tangram_jax import kv_quant
    from tangram_jax.engine import host_offload
    from tangram_jax.scheduler.host_pool import HostTransfer
    rng = np.random.default_rng(2)
    k, v = kv_quant.allocate_pools(
        [kv_quant.page_format("bf16")], [64], (2, 4, 16), jnp.bfloat16,
        make=lambda shape, dtype: jnp.asarray(rng.normal(size=shape), dtype))
    page_bytes = sum(leaf.nbytes // 64 for leaf in jax.tree.leaves((k, v)))
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 8 * page_bytes)
    before = jax.tree.map(np.asarray, (k, v))
    tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert tier.host_sharding is not None
    real_put, puts = jax.device_put, []

    def put(x, sharding=None, **kw):   # the pinned pool holds one chunk, then is full
        if sharding is tier.host_sharding:
            puts.append(1)
            if len(puts) > 1:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Out of host memory while trying to allocate 128.00MiB "
                    "with allocator xla_gpu_host_bfc on device 0.")
        return real_put(x, sharding, **kw)
    monkeypatch.setattr(jax, "device_put", put)
    src, dst = np.arange(1, 22, dtype=np.int32), np.arange(63, 42, -1, dtype=np.int32)
    with pytest.warns(RuntimeWarning, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB") as caught:
        k, v = tier.apply(k, v, [HostTransfer("out", 1, (src,))])
    assert len(caught) == 1 and len(puts) == 3
    kinds = [host_offload._pinned(rows) for _, rows in tier._copies[1][0]]
    assert kinds == [True, False, False]
    tier.settle_all()
    assert all(isinstance(leaf, np.ndarray) for _, rows in tier._copies[1][0]
               for leaf in jax.tree.leaves(rows))
    k, v = tier.apply(k, v, [HostTransfer("in", 1, (dst,))])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, (k, v)))):
        np.testing.assert_array_equal(b[dst], a[src])


def test_import_raises_the_pinned_pool_cap_to_host_memory(monkeypatch):
    """`let_pinned_pool_reach_host_memory` sets XLA's pinned-pool cap to the machine's memory
    where that exceeds XLA's 64 GiB default, and never overrides a cap the user set."""
    from tangram_jax import host_memory
    monkeypatch.delenv(host_memory.PINNED_LIMIT_ENV, raising=False)
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 512 << 30)
    host_memory.let_pinned_pool_reach_host_memory()
    assert host_memory.pinned_pool_limit_bytes() == 512 << 30
    monkeypatch.setenv(host_memory.PINNED_LIMIT_ENV, "100")
    host_memory.let_pinned_pool_reach_host_memory()
    assert host_memory.pinned_pool_limit_bytes() == 100 << 30
    monkeypatch.delenv(host_memory.PINNED_LIMIT_ENV)
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 32 << 30)
    host_memory.let_pinned_pool_reach_host_memory()   # below XLA's default: left alone
    assert host_memory.pinned_pool_limit_bytes() == 64 << 30


def test_host_memory_is_pinned_ahead_of_the_swaps(monkeypatch):
    """`pin_host_memory` grows the pinned pool by the budget in a background thread (so the
    step loop never page-locks memory inside a copy out), a chunk at a time, holding nothing
    afterwards; off the GPU, and with no budget, it does nothing."""
    from tangram_jax.engine import host_offload
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 1 << 20)
    tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert tier.pin_host_memory(8 << 20) is None          # the CPU backend: nothing pinned
    assert tier.pin_host_memory(0, platforms=("cpu",)) is None
    thread = tier.pin_host_memory((5 << 20) + 1, platforms=("cpu",), wait=True)
    assert not thread.is_alive() and tier.pinned_bytes == 6 << 20
    assert tier.pin_seconds is not None and tier.num_copies == 0


def test_host_memory_is_pinned_only_while_the_engine_is_idle(monkeypatch):
    """Each chunk waits until the engine has been without a request for `IDLE_SECONDS` (the
    page-locking holds CUDA calls, a first request's too): nothing is pinned while it is busy,
    and the pinning goes on once it is idle again."""
    import threading
    import time

    from tangram_jax.engine import host_offload
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(host_offload, "IDLE_SECONDS", 0.05)
    tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    busy = threading.Event()
    busy.set()
    thread = tier.pin_host_memory(3 << 20, platforms=("cpu",), idle=lambda: not busy.is_set())
    time.sleep(0.3)
    assert thread.is_alive() and tier.pinned_bytes == 0 and tier.pin_seconds is None
    busy.clear()
    thread.join(10)
    assert not thread.is_alive() and tier.pinned_bytes == 3 << 20


def test_pinning_stops_when_the_process_exits(monkeypatch):
    """The exit hook (`_stop_pinning`, run by threading before the interpreter reaches daemon
    threads) stops a pinning thread between chunks, whether it is waiting for the engine to go
    idle or pinning: a thread left inside XLA's page-locking at shutdown aborted an 8B
    engine's process (rc -6) that exited right after its first token."""
    import threading
    import time

    from tangram_jax.engine import host_offload
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(host_offload, "IDLE_SECONDS", 0.05)
    tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    waiting = tier.pin_host_memory(3 << 20, platforms=("cpu",), idle=lambda: False)
    pinned = threading.Event()
    real_put = jax.device_put

    def slow_put(*args, **kwargs):   # a chunk at a time, slowly: the exit meets it mid-way
        pinned.set()
        time.sleep(0.05)
        return real_put(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", slow_put)
    pinning = tier.pin_host_memory(1 << 30, platforms=("cpu",))
    assert pinned.wait(10) and waiting.is_alive() and pinning.is_alive()
    started = time.perf_counter()
    host_offload._stop_pinning()
    assert time.perf_counter() - started < 5
    assert not waiting.is_alive() and not pinning.is_alive() and not host_offload._PINNING
    assert 0 < tier.pinned_bytes < 1 << 30 and tier.pin_seconds is None


def test_a_process_that_exits_while_pinning_ends_cleanly(tmp_path):
    """An engine's process that ends while its host tier is still being page-locked exits with
    status 0, promptly."""
    import subprocess
    import sys
    import time

    script = tmp_path / "exit_while_pinning.py"
    script.write_text(
        "import jax\n"
        "from tangram_jax.engine import host_offload\n"
        "import time\n"
        "put = jax.device_put\n"
        "jax.device_put = lambda *a, **k: (time.sleep(0.01), put(*a, **k))[1]\n"
        "host_offload.CHUNK_BYTES = 1 << 20\n"
        "tier = host_offload.HostKVTier(jax.sharding.SingleDeviceSharding(jax.devices()[0]))\n"
        "thread = tier.pin_host_memory(64 << 30, platforms=('cpu',))\n"
        "assert thread.is_alive()\n"
        "print('exiting', flush=True)\n")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "PYTHONPATH": os.path.dirname(os.path.dirname(
                                   os.path.dirname(os.path.abspath(__file__))))})
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert time.perf_counter() - started < 60


def test_a_dropped_engine_is_freed_while_its_host_tier_is_still_pinning(tiny_folder,
                                                                        monkeypatch):
    """The pinning thread sees its engine through a weak reference: an engine dropped while
    the thread still pins is collected (its device pool with it; `bench serve` builds the next
    configuration's engine next), and the thread stops."""
    import gc
    import time
    import weakref

    from tangram_jax.engine import host_offload
    monkeypatch.setattr(host_offload, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(host_offload, "IDLE_SECONDS", 0.02)
    pin = host_offload.HostKVTier.pin_host_memory
    monkeypatch.setattr(host_offload.HostKVTier, "pin_host_memory",   # the CPU stands in
                        lambda tier, nbytes, **kw: pin(tier, nbytes, platforms=("cpu",), **kw))
    put = jax.device_put

    def slow_put(*args, **kwargs):
        time.sleep(0.05)
        return put(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", slow_put)
    engine = Engine(tiny_engine_config(tiny_folder, "full", host_kv_cache_bytes=256 << 20))
    tier = engine.runner.host_tier
    (thread,) = [t for t in host_offload._PINNING if t.is_alive()]
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None
    thread.join(10)
    assert not thread.is_alive() and tier.pinned_bytes < 256 << 20 and tier.pin_seconds is None
