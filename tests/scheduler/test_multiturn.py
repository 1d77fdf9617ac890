"""Multi-turn scheduling: follow-ups are not queued behind long first turns (the long-prefill
cap), the per-step token budget, the eviction ranking of idle sessions, the session table, and
the narrow interface between scheduler and KV-cache manager."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_jax.engine.config import EngineConfig, EngineConfigError
from tangram_jax.kv_layout import KVLayout
from tangram_jax.scheduler.kv_cache_manager import SCHEDULER_INTERFACE, KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import Sequence, SequenceStatus
from tangram_jax.scheduler.sessions import IDLE_PRIOR_SECONDS, SessionTable

L, H, D, PAGE, CHUNK = 2, 4, 8, 4, 8
BUDGETS = np.array([[0.25, 0.5], [0.125, 1.0]])


def layout():
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, group_size=2, page_size=PAGE,
                    chunk_size=CHUNK, head_perm=np.tile(np.arange(H), (L, 1)),
                    group_budgets=BUDGETS)


def make(num_pages=400, max_seqs=4, max_pages=96, manager_cls=KVCacheManager, **kw):
    m = manager_cls(layout(), num_pages, max_seqs, max_pages, model_kv_shape=(L, H, D))
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("decode_buckets", (1, 2, 4, 8))
    return m, Scheduler(m, **kw)


def run_step(s, finish_after=None):
    """One step with the device simulated; finishes decoding requests after `finish_after`
    tokens (a dict request id -> tokens, or an int for all)."""
    out = s.schedule()
    sampled = {c.seq.request_id: 5 for c in out.prefill_chunks if c.is_last}
    sampled.update({k.request_id: 5 for c in out.prefill_chunks if c.is_last
                    for k in c.seq.fork_children})   # parallel samples forked at the commit
    sampled.update({q.request_id: 6 for q in out.decode_seqs})
    s.commit(out, sampled)
    for q in out.decode_seqs:
        limit = finish_after.get(q.request_id, 1) if isinstance(finish_after, dict) \
            else finish_after
        if limit is not None and q.status is SequenceStatus.DECODE \
                and len(q.output_token_ids) >= limit:
            s.finish(q.request_id)
    return out


def serve_turn(s, request_id, tokens, session_id, finish_after=1):
    s.add_request(request_id, tokens, session_id=session_id)
    while s.has_unfinished():
        run_step(s, finish_after)


def follow_up_wait(**kw):
    """Steps from a follow-up's arrival to its first scheduled piece, while two 300-token first
    turns are queued and the first of them is mid-prefill."""
    m, s = make(**kw)
    serve_turn(s, "chat-1", list(range(20)), "chat", finish_after=2)
    s.add_request("long-1", list(range(300)))
    s.add_request("long-2", list(range(300)))
    run_step(s)
    run_step(s)
    long1 = s.get("long-1")
    assert long1.status is SequenceStatus.PREFILL and 0 < long1.num_computed_tokens < 300
    s.add_request("chat-2", [7] * 6, session_id="chat")
    for steps in range(1, 100):
        out = run_step(s, finish_after=3)
        assert out.num_scheduled_tokens <= s.max_num_batched_tokens
        if any(c.seq.request_id == "chat-2" for c in out.prefill_chunks):
            return steps, out
    raise AssertionError("the follow-up was never scheduled")


def test_follow_up_is_scheduled_in_the_first_step_while_a_long_first_turn_prefills():
    steps, out = follow_up_wait(long_prefill_token_threshold=32, max_long_partial_prefills=1)
    assert steps == 1
    pieces = {c.seq.request_id: c for c in out.prefill_chunks}
    # The follow-up whole, the long first turn capped at the threshold, the second long first
    # turn still waiting (one long turn at a time) although it arrived before the follow-up.
    assert pieces["chat-2"].num_tokens == 7 and pieces["chat-2"].is_last   # + last sampled
    assert pieces["long-1"].num_tokens == 32
    assert "long-2" not in pieces
    assert out.num_scheduled_tokens <= 64
    # Without a cap the long turn takes the rest of the step, after the follow-up.
    steps, out = follow_up_wait(long_prefill_token_threshold=None, max_long_partial_prefills=1)
    pieces = {c.seq.request_id: c for c in out.prefill_chunks}
    assert steps == 1 and pieces["chat-2"].num_tokens == 7
    assert pieces["long-1"].num_tokens == (64 - 7) // CHUNK * CHUNK and "long-2" not in pieces


def test_long_turns_wait_for_the_long_slot_and_then_run_in_arrival_order():
    m, s = make(long_prefill_token_threshold=16, max_long_partial_prefills=1)
    seqs = [s.add_request(name, list(range(40))) for name in ("a", "b", "c")]
    started = []
    for _ in range(40):
        out = run_step(s, finish_after=1)
        started += [c.seq.request_id for c in out.prefill_chunks
                    if c.start == c.seq.turn_start]
        longs = [c for c in out.prefill_chunks if c.seq.num_uncomputed_tokens > 16]
        assert len(longs) <= 1 and all(c.num_tokens <= 16 for c in longs)
        if not s.has_unfinished():
            break
    assert started == ["a", "b", "c"] and not s.has_unfinished()
    # Nobody was overtaken for lack of pages: waiting for the long slot is not a skip.
    assert all(q.num_skips == 0 for q in seqs)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_token_budget_cap_and_follow_up_guarantee_hold_under_random_load(data):
    parts = data.draw(st.integers(1, 2), label="max_long_partial_prefills")
    budget = data.draw(st.integers(8 + 2 + CHUNK * parts, 96), label="budget")
    threshold = data.draw(st.integers(CHUNK, budget), label="threshold")
    m, s = make(num_pages=2000, max_seqs=8, max_pages=200, max_num_batched_tokens=budget,
                long_prefill_token_threshold=threshold, max_long_partial_prefills=parts)
    # What a step always leaves for short turns: the budget less a full decode batch and a
    # chunk per long turn prefilling.
    guaranteed = budget - 8 - parts * CHUNK
    sessions_idle: list[str] = []
    counter = 0
    arrived: dict[str, int] = {}      # follow-up request -> step it arrived before
    for step in range(60):
        # At most one arrival a step: long first turns, or follow-ups of idle sessions that fit
        # what every step leaves (+1: the last sampled token, whose KV the turn writes).
        counter += 1
        if sessions_idle and data.draw(st.booleans()):
            sid = sessions_idle.pop(0)
            size = data.draw(st.integers(1, min(guaranteed, threshold, 12) - 1))
            rid = f"f{counter}"
            s.add_request(rid, [3] * size, session_id=sid)
            arrived[rid] = step
        elif len(s.sessions) < 7 and data.draw(st.booleans()):   # slots for every session
            length = data.draw(st.sampled_from([100, 150, 300]))
            s.add_request(f"r{counter}", list(range(length)), session_id=f"s{counter}")
        out = s.schedule()
        assert out.num_scheduled_tokens <= budget
        longs = [c for c in out.prefill_chunks if c.seq.num_uncomputed_tokens > threshold]
        assert len(longs) <= parts and all(c.num_tokens <= threshold for c in longs)
        for c in out.prefill_chunks:
            arrived.pop(c.seq.request_id, None)
        # The follow-up is served in the first step after it arrived (the pool and the slots
        # are ample here), however many long first turns wait or prefill.
        assert not [r for r, t in arrived.items() if t < step], arrived
        sampled = {c.seq.request_id: 5 for c in out.prefill_chunks if c.is_last}
        sampled.update({q.request_id: 6 for q in out.decode_seqs})
        s.commit(out, sampled)
        for q in out.decode_seqs:
            if q.status is SequenceStatus.DECODE and len(q.output_token_ids) >= 2:
                sid = q.session_id
                s.finish(q.request_id)
                sessions_idle.append(sid)


# ----- eviction ranking -------------------------------------------------------------------

def test_eviction_ranks_pages_freed_per_expected_recompute_token():
    now = [0.0]
    pages = {}
    table = SessionTable(pages.__getitem__, clock=lambda: now[0])

    def idle(name, slot, num_pages, num_tokens, at):
        seq = Sequence(f"{name}-r", list(range(num_tokens)), session_id=name)
        seq.slot = slot
        pages[slot] = num_pages
        table.add(seq)
        now[0] = at
        table.mark_idle(seq)
        return seq

    idle("old-big", 0, 40, 400, at=0.0)      # 40 * (9 + 1) / 400 = 1.0
    idle("old-cheap", 1, 3, 400, at=0.0)     # well compressed: 3 * 10 / 400 = 0.075
    idle("old-small", 2, 10, 20, at=4.0)     # cheap to recompute: 10 * (5 + 1) / 20 = 3.0
    idle("recent-big", 3, 40, 400, at=9.0)   # 40 * (0 + 1) / 400 = 0.1
    now[0] = 9.0
    assert IDLE_PRIOR_SECONDS == 1.0
    order = [q.session_id for q in table.eviction_order()]
    # Least recently used would evict old-big and old-cheap first; the ranking evicts the
    # session that is cheapest to bring back per page first and keeps the well-compressed one.
    assert order == ["old-small", "old-big", "recent-big", "old-cheap"]
    assert table.eviction_score(table.get("old-small")) == pytest.approx(10 * 6 / 20)
    assert table.evictable_pages == 93 and table.num_evictable == 4
    table.unlist(table.get("old-big"))
    assert table.evictable_pages == 53 and "old-big" in table


def test_scheduler_evicts_by_rank_not_by_recency():
    # Same idle time; "chatty" holds mostly generated tokens (kept whole: more pages per token)
    # while "prompt" holds a compressed 40-token prompt, and went idle first (LRU's victim).
    m, s = make(num_pages=70, clock=lambda: 0.0)
    serve_turn(s, "p1", list(range(40)), "prompt", finish_after=1)
    serve_turn(s, "c1", list(range(4)), "chatty", finish_after=30)
    prompt, chatty = s.sessions.get("prompt"), s.sessions.get("chatty")
    assert (m.pages_held(chatty.slot) / chatty.num_tokens
            > m.pages_held(prompt.slot) / prompt.num_tokens)
    need = m.pages_to_reserve(None, 60)
    assert m.num_free_pages < need <= m.num_free_pages + m.pages_held(chatty.slot)
    s.add_request("new", list(range(60)))
    run_step(s)
    assert prompt.is_cached and not chatty.is_cached
    assert s.metrics.num_evictions == 1 and s.metrics.evicted_recompute_tokens == chatty.num_tokens
    assert chatty.status is SequenceStatus.IDLE and "chatty" in s.sessions   # chose its id


def test_evicted_anonymous_session_is_forgotten_named_one_kept():
    m, s = make(num_pages=60, clock=lambda: 0.0)
    anon = s.sessions.new_id()
    assert s.sessions.is_anonymous(anon) and anon != s.sessions.new_id()
    serve_turn(s, "a1", list(range(40)), anon)
    serve_turn(s, "n1", list(range(40)), "named")
    s.add_request("big", list(range(120)))
    for _ in range(30):
        run_step(s, finish_after=1)
        if not s.has_unfinished():
            break
    assert s.metrics.num_evictions == 2
    assert anon not in s.sessions                  # the client resends its conversation
    assert "named" in s.sessions and not s.sessions.get("named").is_cached
    history = s.sessions.get("named").token_ids
    assert s.sessions.find_prefix(history + [9]) == ("named", len(history))


def test_session_table_prefix_lookup_and_errors():
    table = SessionTable(lambda slot: 0)
    seq = Sequence("r", [1, 2, 3], session_id="x")
    table.add(seq)
    assert table.find_prefix([1, 2, 3, 4]) == (None, 0)   # not idle yet
    table.mark_idle(seq)
    assert table.find_prefix([1, 2, 3, 4]) == ("x", 3)
    assert table.find_prefix([1, 2, 3]) == (None, 0)      # a proper prefix only
    assert table.find_prefix([1, 9, 3, 4]) == (None, 0)
    with pytest.raises(ValueError, match="exists already"):
        table.add(Sequence("r2", [1], session_id="x"))
    with pytest.raises(ValueError, match="no session id"):
        table.add(Sequence("r3", [1]))
    with pytest.raises(ValueError, match="idle_prior_seconds"):
        SessionTable(lambda slot: 0, idle_prior_seconds=0)
    table.remove("x")
    assert "x" not in table and len(table) == 0


# ----- the scheduler / manager boundary -----------------------------------------------------

class RecordingManager(KVCacheManager):
    """Records every attribute the scheduler layer reads of the manager."""

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "seen", set())
        super().__init__(*args, **kwargs)

    def __getattribute__(self, name):
        # The scheduler's modules, not the manager's own methods (its admission part lives in
        # `admission`, its host-tier part in `host_pool` beside the scheduler's).
        frame = sys._getframe(1)
        caller = frame.f_globals.get("__name__", "")
        if caller in ("tangram_jax.scheduler.scheduler", "tangram_jax.scheduler.admission",
                      "tangram_jax.scheduler.sessions", "tangram_jax.scheduler.host_pool") \
                and frame.f_locals.get("self") is not self:
            object.__getattribute__(self, "seen").add(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("host_bytes", [0, 10**6])
def test_scheduler_uses_only_the_narrow_manager_interface(host_bytes):
    from tangram_jax.scheduler.host_pool import HostKVPool
    m, s = make(num_pages=40, manager_cls=RecordingManager, long_prefill_token_threshold=16,
                host=HostKVPool(host_bytes, [1000]))
    serve_turn(s, "t1", list(range(24)), "chat", finish_after=2)
    for i in range(5):
        s.add_request(f"r{i}", list(range(20 + 9 * i)))
    s.add_request("t2", [1] * 5, session_id="chat")
    s.add_request("f0", list(range(30)), fork_ids=("f1", "f2"))   # parallel samples
    for _ in range(200):
        run_step(s, finish_after=6)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.metrics.num_evictions + s.metrics.num_preemptions > 0   # the pool ran short
    assert m.seen <= SCHEDULER_INTERFACE, m.seen - SCHEDULER_INTERFACE
    assert {"reserve", "grow_for_decode", "commit_prefill", "fork"} <= m.seen
    if host_bytes:   # the session went to host memory and comes back
        assert "swap_out" in m.seen and s.metrics.num_swapped_out
        if s.sessions.get("chat").is_swapped:
            serve_turn(s, "t3", [2] * 5, "chat")
        assert "swap_in" in m.seen and s.metrics.num_swapped_in
        assert m.seen <= SCHEDULER_INTERFACE, m.seen - SCHEDULER_INTERFACE


def test_long_prefill_fields_are_checked():
    with pytest.raises(EngineConfigError, match="long_prefill_token_threshold must lie in"):
        EngineConfig(chunk_size=64, long_prefill_token_threshold=32).check()
    with pytest.raises(EngineConfigError, match="long_prefill_token_threshold must lie in"):
        EngineConfig(chunk_size=16, max_num_batched_tokens=64,
                     long_prefill_token_threshold=128).check()
    with pytest.raises(EngineConfigError, match="max_long_partial_prefills must be an int >= 1"):
        EngineConfig(max_long_partial_prefills=0)
    m = KVCacheManager(layout(), 40, 2, 16, model_kv_shape=(L, H, D))
    with pytest.raises(ValueError, match=r"= \[8, 64\], got 4"):
        Scheduler(m, max_num_batched_tokens=64, decode_buckets=(2,),
                  long_prefill_token_threshold=4)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        Scheduler(m, max_num_batched_tokens=64, decode_buckets=(2,),
                  max_long_partial_prefills=0)


def _smallest_prompt_over_free_pages(m) -> int:
    """Tokens of the shortest new prompt whose reservation exceeds the free pages."""
    return next(n for n in range(4, 400, 4) if m.pages_to_reserve(None, n) > m.num_free_pages)


def test_admission_keeps_a_session_that_just_went_idle_while_others_run():
    # A closed-loop client sends its next turn the moment an answer arrives: a waiting first
    # turn must not evict that session while the device has other work; it waits for pages, or
    # for the session to age past the idle prior, or for the device to run dry.
    now = [0.0]
    m, s = make(num_pages=70, clock=lambda: now[0])
    serve_turn(s, "a1", list(range(40)), "a", finish_after=1)
    s.add_request("b1", list(range(4)), session_id="b")
    run_step(s, finish_after=None)                          # b decodes (no finish yet)
    a = s.sessions.get("a")
    # The smallest prompt that fits only with a's pages back.
    size = _smallest_prompt_over_free_pages(m)
    assert m.pages_to_reserve(None, size) <= m.num_free_pages + m.pages_held(a.slot)
    s.add_request("new", list(range(size)))
    for _ in range(3):
        run_step(s, finish_after=None)
    assert a.is_cached and s.metrics.num_evictions == 0     # young, and b runs
    assert s.get("new").status is SequenceStatus.WAITING
    now[0] = IDLE_PRIOR_SECONDS + 0.5                       # a has aged past the prior
    run_step(s, finish_after=None)
    assert not a.is_cached and s.metrics.num_evictions == 1
    assert s.get("new").status is not SequenceStatus.WAITING


@pytest.mark.parametrize("follow_up_queued", [False, True])
def test_admission_with_nothing_running(follow_up_queued):
    # Nothing runs and a first turn needs a resident session's pages: an idle session is
    # evicted however young (waiting would idle the device), but one whose next turn is queued
    # behind the first turn is kept: its follow-up goes first (a few pages).
    m, s = make(num_pages=70, clock=lambda: 0.0)
    serve_turn(s, "a1", list(range(40)), "a", finish_after=1)
    a = s.sessions.get("a")
    s.add_request("new", list(range(_smallest_prompt_over_free_pages(m))))
    if follow_up_queued:
        s.add_request("a2", [7, 8, 9], session_id="a")
    out = run_step(s)
    assert a.is_cached == follow_up_queued
    assert s.metrics.num_evictions == (0 if follow_up_queued else 1)
    if follow_up_queued:
        assert [c.seq.request_id for c in out.prefill_chunks] == ["a2"]
        assert s.get("new").status is SequenceStatus.WAITING
