"""The host tier on the scheduler's side (`scheduler/host_pool.py`): an evicted idle session is
swapped to host memory when that is cheaper than recomputing it and the host holds it; its
next admission takes back exactly the pages it held (plus the turn's) with the same retained
lengths; a host that cannot hold it falls back to recompute; every page and host byte comes
back; the manager's moves are logged for the device in order."""

import numpy as np
import pytest

from tangram_jax.scheduler.host_pool import HostKVPool, SwappedKV
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

from test_multiturn import L, D, H, layout, run_step, serve_turn

PAGE_BYTES = 1000


def make_host(num_pages=40, capacity=10**6, **kw):
    m = KVCacheManager(layout(), num_pages, 4, 96, model_kv_shape=(L, H, D))
    host = HostKVPool(capacity, [PAGE_BYTES], **kw)
    s = Scheduler(m, max_num_batched_tokens=64, decode_buckets=(1, 2, 4, 8),
                  clock=lambda: 0.0, host=host)
    return m, s, host


def crowd_out(s, session_id, n=60):
    """Serve a first turn big enough that the idle session `session_id` must leave the pool."""
    s.add_request("big", list(range(n)))
    for _ in range(40):
        run_step(s, finish_after=1)
        if not s.has_unfinished():
            return
    raise AssertionError("the big request did not finish")


def test_evicted_session_goes_to_host_and_comes_back_with_the_same_lengths():
    m, s, host = make_host()
    serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
    a = s.sessions.get("a")
    held, lengths = m.pages_held(a.slot), m.lengths[a.slot].copy()
    computed = a.num_computed_tokens
    m.take_host_transfers()
    crowd_out(s, "a")
    assert a.is_swapped and not a.is_cached and a.num_computed_tokens == computed
    assert s.metrics.num_swapped_out == 1 and s.metrics.evicted_recompute_tokens == 0
    assert host.used_bytes == held * PAGE_BYTES and host.holds(a)
    (out,) = [t for t in m.take_host_transfers() if t.kind == "out"]
    assert out.handle == a.host_kv.handle and out.pages[0].size == held
    # The next turn takes the same number of pages per (layer, group) back, then its own.
    s.add_request("a2", [3] * 5, session_id="a")
    out_step = s.schedule()
    assert a.status is SequenceStatus.PREFILL and not a.is_swapped and host.used_bytes == 0
    (back,) = m.take_host_transfers()
    assert back.kind == "in" and back.handle == out.handle and back.pages[0].size == held
    np.testing.assert_array_equal(m.table.pages_of(a.slot)[:0], [])   # a real slot
    # Only the new turn is prefilled, on top of the restored lengths.
    (piece,) = [c for c in out_step.prefill_chunks if c.seq is a]
    assert (piece.start, piece.end) == (computed, a.num_tokens)
    np.testing.assert_array_equal(m.retained_lengths(a.slot), lengths)
    restored = m.table.num_pages[a.slot]
    assert (restored >= np.ceil(lengths / m.page_size)).all()


def test_host_too_small_falls_back_to_recompute():
    m, s, host = make_host(capacity=PAGE_BYTES)   # not even one session
    serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
    a = s.sessions.get("a")
    crowd_out(s, "a")
    assert not a.is_swapped and not a.is_cached and a.num_computed_tokens == 0
    assert s.metrics.num_swapped_out == 0 and s.metrics.evicted_recompute_tokens == a.num_tokens
    assert not [t for t in m.take_host_transfers() if t.kind != "drop"]


def test_recompute_chosen_when_it_is_cheaper():
    # A slow host link: copying back costs more than re-prefilling.
    m, s, host = make_host(host_bandwidth=1.0, prefill_rate=1e6)
    serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
    crowd_out(s, "a")
    assert s.metrics.num_swapped_out == 0 and s.metrics.num_evictions >= 1


def test_older_host_copies_make_room_and_everything_is_returned():
    now = [0.0]
    m = KVCacheManager(layout(), 50, 4, 96, model_kv_shape=(L, H, D))
    host = HostKVPool(30 * PAGE_BYTES, [PAGE_BYTES])
    s = Scheduler(m, max_num_batched_tokens=64, decode_buckets=(1, 2, 4, 8),
                  clock=lambda: now[0], host=host)
    anon = s.sessions.new_id()
    serve_turn(s, "o1", list(range(40)), anon, finish_after=3)
    now[0] = 5.0
    serve_turn(s, "n1", list(range(40)), "named", finish_after=3)
    now[0] = 10.0
    crowd_out(s, anon, n=90)   # both leave; the host holds one: the older copy goes
    assert s.metrics.num_swapped_out >= 2 and s.metrics.num_host_drops >= 1
    assert anon not in s.sessions                      # forgotten, as a recomputed one is
    named = s.sessions.get("named")
    assert named.is_swapped and host.used_bytes <= host.capacity_bytes
    # Close everything: every device page and host byte comes back, each copy released.
    s.close_session("named")
    assert host.used_bytes == 0 and host.num_held == 0
    assert m.num_free_pages == m.capacity and m.num_free_slots == m.max_seqs
    kinds = [t.kind for t in m.take_host_transfers()]
    assert kinds.count("out") == kinds.count("in") + kinds.count("drop")


def test_swapped_session_reservation_is_exact():
    """Admission of a swapped session takes exactly its old pages plus the turn's
    (Budget Reservation stays exact)."""
    m, s, host = make_host()
    serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
    a = s.sessions.get("a")
    held = m.pages_held(a.slot)
    crowd_out(s, "a")
    assert isinstance(a.host_kv, SwappedKV) and m.fits_ever(a.host_kv, 5)
    s.add_request("a2", [3] * 5, session_id="a")
    a.plan_prefill()
    need = m.pages_to_reserve(a.host_kv, [(5, True)])
    assert need > held
    free = m.num_free_pages
    s.schedule()
    assert a.is_cached and free - m.num_free_pages == need


@pytest.mark.parametrize("bad", [-1, 1.5, "1G", True])
def test_bad_capacity_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="capacity_bytes must be an int >= 0"):
        HostKVPool(bad, [PAGE_BYTES])


def test_measured_rates_replace_the_priors_then_average():
    host = HostKVPool(10, [1])
    host.observe_transfer(100, 1.0)
    assert host.host_bandwidth == 100
    host.observe_transfer(200, 1.0)
    assert host.host_bandwidth == pytest.approx(0.8 * 100 + 0.2 * 200)
    host.observe_prefill(0, 1.0)   # nothing prefilled: no measurement
    assert host.prefill_rate == HostKVPool(10, [1]).prefill_rate


def test_prefill_rate_is_timed_from_device_completion_not_from_dispatch():
    """The host runs a step ahead of the device: steps 1-3 (two prefill chunks with no
    tokens to fetch, then a decode step) are dispatched within 20 ms; the host learns they
    finished when it fetches step 3's tokens 2 s later. The rate is 2,000 tokens over those
    2 s (not over the 10 ms between two dispatches); a window of decode steps measures
    nothing; an idle host between windows does not count."""
    host = HostKVPool(10, [1])
    for step, (tokens, rows, at) in enumerate([(1000, 0, 0.0), (1000, 0, 0.01), (0, 4, 0.02)],
                                              1):
        host.step_dispatched(step, tokens, rows, at)
    host.steps_done(3, at=2.0)
    assert host.prefill_rate == pytest.approx(1000.0)
    host.step_dispatched(4, 0, 8, 2.1)
    host.steps_done(4, at=2.2)            # decode only: no measurement
    assert host.prefill_rate == pytest.approx(1000.0)
    host.step_dispatched(5, 3000, 2, 10.0)   # after 7.8 s of idle host
    host.step_dispatched(6, 0, 2, 10.1)
    host.steps_done(5, at=11.0)           # step 6 still under way: not counted yet
    assert host.prefill_rate == pytest.approx(0.8 * 1000 + 0.2 * 3000)
    assert [d[0] for d in host._undone] == [6]


def test_queued_session_swapped_out_is_restored_at_admission_or_released_on_abort():
    """A session whose next turn is queued may be evicted too (decode growth takes queued
    sessions last): swapped, its admission restores it; aborted instead, its host copy goes."""
    for abort in (False, True):
        m, s, host = make_host()
        serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
        a = s.sessions.get("a")
        lengths, computed = m.lengths[a.slot].copy(), a.num_computed_tokens
        s.add_request("a2", [3] * 5, session_id="a")
        assert a.status is SequenceStatus.WAITING and s.sessions.is_listed(a)
        assert s._evict_one() and a.is_swapped and host.used_bytes > 0
        if abort:
            s.abort("a2")
            assert host.used_bytes == 0 and "a" not in s.sessions
            kinds = [t.kind for t in m.take_host_transfers()]
            assert kinds[-2:] == ["out", "drop"]
        else:
            out = s.schedule()
            (piece,) = out.prefill_chunks
            assert piece.seq is a and piece.start == computed and not a.is_swapped
            np.testing.assert_array_equal(m.retained_lengths(a.slot), lengths)
            assert [t.kind for t in m.take_host_transfers()][-2:] == ["out", "in"]
        assert m.num_free_slots == m.max_seqs - (0 if abort else 1)


def test_eviction_ranking_counts_the_cheaper_of_swap_and_recompute():
    """The session table ranks by pages freed per expected cost: with a host tier that cost is
    the copy back's (in recompute tokens at the measured prefill rate) where swapping wins, so
    a long history that is cheap to swap back is no longer kept for its recompute cost."""
    for bandwidth, swaps in ((1e12, True), (1.0, False)):
        m, s, host = make_host(host_bandwidth=bandwidth, prefill_rate=1000.0)
        serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
        a = s.sessions.get("a")
        nbytes = host.bytes_of(m.pages_held(a.slot))
        cost = s.sessions.eviction_cost(a)
        if swaps:
            assert cost == pytest.approx(nbytes / bandwidth * 1000.0) and cost < a.num_tokens
        else:
            assert cost == a.num_tokens
        assert s.sessions.eviction_score(a) == pytest.approx(
            m.pages_held(a.slot) * (0 + s.sessions.idle_prior_seconds) / max(1.0, cost))


def test_a_swapped_session_does_not_take_the_pages_an_earlier_long_turn_waits_for():
    """A follow-up of a swapped session is short to prefill but takes its whole history's
    pages back. While a long first turn queued before it waits for a long-prefill slot, the
    restore (needing at least its pages) waits behind it instead of taking those pages; a
    turn needing fewer pages still goes ahead. (On the GPU, restores overtaking 32k first
    turns this way tripled their TTFT.)"""
    m = KVCacheManager(layout(), 80, 4, 96, model_kv_shape=(L, H, D))
    host = HostKVPool(10**6, [PAGE_BYTES])
    s = Scheduler(m, max_num_batched_tokens=64, decode_buckets=(1, 2, 4, 8), clock=lambda: 0.0,
                  host=host, long_prefill_token_threshold=16, max_long_partial_prefills=1)
    serve_turn(s, "a1", list(range(40)), "a", finish_after=3)
    a = s.sessions.get("a")
    crowd_out(s, "a", n=150)
    assert a.is_swapped
    s.add_request("first-1", list(range(48)))          # long: holds the one long slot
    run_step(s, finish_after=50)
    s.add_request("first-2", list(range(40)))          # long: waits for the slot
    s.add_request("a2", [3] * 5, session_id="a")       # short, restores 22 pages + the turn's
    s.add_request("tiny", list(range(4)))              # short and small
    restore = m.pages_to_reserve(a.host_kv, [(5, True)])
    assert restore >= m.pages_to_reserve(None, [(40, True)])
    assert m.num_free_pages >= restore                 # it would fit: only the rule holds it
    started = {}   # request -> the step its first piece ran in
    for step in range(200):
        if not s.has_unfinished():
            break
        out = run_step(s, finish_after=2)
        started.update({c.seq.request_id: step for c in out.prefill_chunks
                        if c.start == c.seq.turn_start})
    assert not s.has_unfinished()
    assert started["tiny"] < started["first-2"] <= started["a2"]
    assert s.metrics.num_swapped_in == 1
