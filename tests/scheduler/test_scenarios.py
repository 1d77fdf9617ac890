"""Hand-built scenarios: reservation sizes, multi-turn, eviction, preemption, fairness, baselines,
and bad input."""

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tangram_jax.kv_layout import KVLayout, pages_for, retained_counts
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager, LayoutMismatchError
from tangram_jax.scheduler.scheduler import RequestTooLargeError, Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

L, H, D, PAGE, CHUNK = 2, 4, 8, 4, 8
BUDGETS = np.array([[0.25, 0.5], [0.125, 1.0]])


def layout(budgets=BUDGETS):
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, group_size=2, page_size=PAGE,
                    chunk_size=CHUNK, head_perm=np.tile(np.arange(H), (L, 1)),
                    group_budgets=budgets)


def make(num_pages=64, max_seqs=4, max_pages=16, policy="reserve", lay=None, **kw):
    lay = lay or layout()
    m = KVCacheManager(lay, num_pages, max_seqs, max_pages, model_kv_shape=(L, H, D), policy=policy)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("decode_buckets", (1, 2, 4, 8))
    return m, Scheduler(m, **kw)


def run_step(s, finish_after=None, reclaim=None):
    out = s.schedule()
    sampled = {c.seq.request_id: 5 for c in out.prefill_chunks if c.is_last}
    sampled.update({q.request_id: 6 for q in out.decode_seqs})
    s.commit(out, sampled, reclaim_lengths=reclaim)
    for q in out.decode_seqs:
        if finish_after is not None and q.status is SequenceStatus.DECODE \
                and len(q.output_token_ids) >= finish_after:
            s.finish(q.request_id)
    return out


def drain(s, finish_after=2, limit=500):
    for _ in range(limit):
        if not s.has_unfinished():
            return
        run_step(s, finish_after)
    raise AssertionError("scheduler did not drain")


def test_reservation_is_exactly_the_retained_pages_and_prefill_fills_it():
    m, s = make()
    seq = s.add_request("a", list(range(37)))
    out = s.schedule()
    want = layout().retained_counts(37)          # chunks 8,8,8,8,5
    np.testing.assert_array_equal(want, [[10, 19], [5, 37]])
    np.testing.assert_array_equal(m.table.num_pages[seq.slot], pages_for(want, PAGE))
    assert m.pool.num_used == int(pages_for(want, PAGE).sum())
    s.commit(out, {"a": 1})
    np.testing.assert_array_equal(m.lengths[seq.slot], want)
    assert seq.status is SequenceStatus.DECODE and seq.token_ids[-1] == 1


def test_prefill_pieces_align_to_compression_chunks_under_token_budget():
    m, s = make(max_num_batched_tokens=4 + 2 * CHUNK + 3)   # 23 tokens a step
    s.add_request("a", list(range(50)))
    pieces = []
    while s.get("a").status is not SequenceStatus.DECODE:
        out = run_step(s)
        pieces += [(c.start, c.end) for c in out.prefill_chunks]
    # Full chunks while the rest exceeds the budget; the final piece may end off-boundary.
    assert pieces == [(0, 16), (16, 32), (32, 50)]
    np.testing.assert_array_equal(m.lengths[s.get("a").slot], layout().retained_counts(50))


def test_multi_turn_keeps_pages_and_reserves_only_the_increment():
    m, s = make()
    seq = s.add_request("t1", list(range(20)), session_id="chat")
    drain(s, finish_after=3)
    assert seq.status is SequenceStatus.IDLE and seq.is_cached
    # 20 prompt + 3 sampled; the last sampled token is not in the cache yet.
    assert seq.num_tokens == 23 and seq.num_computed_tokens == 22
    before = m.lengths[seq.slot].copy()
    pages_before = m.table.pages_of(seq.slot).copy()
    np.testing.assert_array_equal(before, layout().retained_counts(20) + 2)
    s.add_request("t2", [9] * 10, session_id="chat")
    out = s.schedule()
    (chunk,) = out.prefill_chunks
    assert (chunk.start, chunk.end) == (22, 33)            # last sampled token + new prompt
    target = before + layout().retained_counts(11)
    np.testing.assert_array_equal(m.reserved_lengths[seq.slot], target)
    np.testing.assert_array_equal(m.table.num_pages[seq.slot], pages_for(target, PAGE))
    # Earlier pages stay where they were: no copies, no moves.
    kept = m.table.pages_of(seq.slot)
    assert set(pages_before.tolist()) <= set(kept.tolist())
    s.commit(out, {"t2": 4})
    np.testing.assert_array_equal(m.lengths[seq.slot], target)
    with pytest.raises(ValueError, match="still serving"):
        s.add_request("t3", [1], session_id="chat")


def test_eviction_of_idle_sessions_and_transparent_reprefill():
    m, s = make(num_pages=40)
    for name in ("old", "new"):
        s.add_request(name, list(range(24)), session_id=name)
        drain(s, finish_after=1)
    old, new = s.sessions.get("old"), s.sessions.get("new")
    assert old.is_cached and new.is_cached
    held_old, held_new = m.pages_held(old.slot), m.pages_held(new.slot)
    # Needs more than is free, less than free + one session: only "old" is evicted (equal
    # histories and pages; it has been idle longer).
    s.add_request("big", list(range(40)))
    assert m.num_free_pages < m.pages_to_reserve(None, 40) <= m.num_free_pages + held_old
    run_step(s)
    assert not old.is_cached and new.is_cached and s.metrics.num_evictions == 1
    assert old.status is SequenceStatus.IDLE and m.pages_held(new.slot) == held_new
    drain(s, finish_after=1)
    # The evicted session's next turn re-prefills its whole history from position 0, as it was
    # first written: turn 1 with its own chunking, then the new turn from where the cache ended
    # (the turn-1 token no decode step wrote, and the new prompt).
    history = old.num_tokens
    s.add_request("old2", [3] * 5, session_id="old")
    out = s.schedule()
    (chunk,) = out.prefill_chunks
    end = old.turns[-1][0]    # the cache held turn 1 and the generated tokens a decode wrote
    assert 24 <= end < history
    assert old.segments == [(0, 24, True)] + ([(24, end, False)] if end > 24 else []) + \
        [(end, history + 5, True)]
    assert chunk.seq is old and (chunk.start, chunk.end) == (0, 24)
    np.testing.assert_array_equal(m.reserved_lengths[old.slot],
                                  layout().retained_counts(24) + (end - 24)
                                  + layout().retained_counts(history + 5 - end))
    s.commit(out, {})
    (chunk,) = s.schedule().prefill_chunks
    assert (chunk.start, chunk.end, chunk.is_last) == (24, old.segments[1][1], end == 24)


def test_decode_growth_failure_preempts_the_newest_and_it_recomputes():
    ones = np.ones((L, 2))
    # 2 sequences x 4 cells x 2 pages fill 16 of 17 pages; the next page boundary needs 8 more.
    m, s = make(num_pages=18, lay=layout(ones))
    s.add_request("first", list(range(8)))
    s.add_request("second", list(range(8)))
    run_step(s)
    assert m.num_free_pages == 17 - 16
    preempted = []
    for _ in range(10):
        out = run_step(s)
        preempted += [p.request_id for p in out.preempted]
        if preempted:
            break
    assert preempted == ["second"]
    second = s.get("second")
    assert second.status is SequenceStatus.WAITING and not second.is_cached
    assert second.num_preemptions == 1 and s.waiting[0] is second
    generated = list(second.output_token_ids)
    run_step(s, finish_after=3)
    drain(s, finish_after=3)
    # Recompute kept the generated tokens as history: output continues from where it was.
    assert second.status is SequenceStatus.FINISHED
    assert second.output_token_ids[:len(generated)] == generated
    assert m.pool.num_free == m.pool.capacity


def test_huge_request_does_not_block_small_ones_but_is_not_starved():
    m, s = make(num_pages=40, fairness_skips=3, max_seqs=4)
    s.add_request("resident", list(range(40)))       # holds most of the pool for a while
    run_step(s)
    s.add_request("huge", list(range(60)))
    for i in range(6):
        s.add_request(f"small{i}", list(range(4)))
    huge = s.get("huge")
    order = []
    for _ in range(400):
        if not s.has_unfinished():
            break
        out = s.schedule()
        sampled = {c.seq.request_id: 5 for c in out.prefill_chunks if c.is_last}
        sampled.update({q.request_id: 6 for q in out.decode_seqs})
        s.commit(out, sampled)
        order += [c.seq.request_id for c in out.prefill_chunks if c.start == c.seq.turn_start]
        for q in out.decode_seqs:
            # The resident runs long; small ones finish at once.
            limit = 12 if q.request_id == "resident" else 1
            if q.status is SequenceStatus.DECODE and len(q.output_token_ids) >= limit:
                s.finish(q.request_id)
    assert not s.has_unfinished()
    # Small requests overtook the huge one, but at most `fairness_skips` times.
    assert order.index("huge") > 0
    overtakers = order[:order.index("huge")]
    assert 1 <= len([r for r in overtakers if r.startswith("small")]) <= 3
    assert huge.status is SequenceStatus.FINISHED and huge.num_skips == 3


def test_request_larger_than_pool_rejected_and_others_still_served():
    m, s = make(num_pages=30)
    s.add_request("ok1", list(range(10)))
    with pytest.raises(RequestTooLargeError, match="pool has 29 pages"):
        s.add_request("too-big", list(range(200)))
    with pytest.raises(RequestTooLargeError):           # one group beyond the table width
        make(num_pages=1000, max_pages=4)[1].add_request("wide", list(range(40)))
    s.add_request("ok2", list(range(12)))
    drain(s)
    assert s.metrics.num_rejected == 1 and m.pool.num_free == m.pool.capacity
    assert "too-big" not in s._requests


def test_layout_not_matching_model_is_refused():
    with pytest.raises(LayoutMismatchError, match="layers: layout 2 vs model 3"):
        KVCacheManager(layout(), 32, 2, 8, model_kv_shape=(3, H, D))
    with pytest.raises(LayoutMismatchError, match="kv_heads: layout 4 vs model 8"):
        KVCacheManager(layout(), 32, 2, 8, model_kv_shape=(L, 8, D))
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        KVCacheManager(layout(), 32, 2, 8, model_kv_shape=(L, H, 64))
    with pytest.raises(ValueError, match="policy"):
        KVCacheManager(layout(), 32, 2, 8, model_kv_shape=(L, H, D), policy="magic")
    with pytest.raises(ValueError, match="uncompressed"):
        KVCacheManager(layout(), 32, 2, 8, model_kv_shape=(L, H, D), policy="reclaim")


def test_bad_requests_and_configs_are_refused_clearly():
    m, s = make()
    s.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already live"):
        s.add_request("a", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request("b", [])
    with pytest.raises(TypeError, match="ints"):
        s.add_request("c", ["x"])
    with pytest.raises(KeyError):
        s.abort("nope")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(m, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="decode bucket"):
        Scheduler(m, decode_buckets=(1, 2))
    with pytest.raises(ValueError, match="strictly increasing"):
        Scheduler(m, decode_buckets=(4, 2, 8))


def test_full_kv_and_adjacent_are_configurations_of_the_same_manager():
    full = KVLayout.monolithic(L, H, D, page_size=PAGE, chunk_size=CHUNK)
    mf, sf = make(lay=full)
    mt, st_ = make()
    for s in (sf, st_):
        s.add_request("x", list(range(30)))
        run_step(s)
    np.testing.assert_array_equal(mf.reserved_lengths[0], [[30], [30]])
    assert mf.pool.num_used == 2 * pages_for(30, PAGE)
    assert mt.pool.num_used < mf.pool.num_used * 2   # tangram: two groups, mostly compressed
    # Adjacent grouping: heads in index order, each group's budget the max of its members.
    head_budgets = np.array([[0.1, 0.9, 0.2, 0.3], [0.1, 0.2, 0.8, 1.0]])
    adjacent = layout(head_budgets.reshape(L, 2, 2).max(-1))
    clustered_perm = np.argsort(head_budgets, axis=1)
    clustered = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, group_size=2,
                         page_size=PAGE, chunk_size=CHUNK, head_perm=clustered_perm,
                         group_budgets=np.take_along_axis(head_budgets, clustered_perm, 1)
                         .reshape(L, 2, 2).max(-1), name="tangram")
    used = []
    for lay in (adjacent, clustered):
        m, s = make(lay=lay, max_pages=32)
        s.add_request("x", list(range(64)))
        run_step(s)
        used.append(m.pool.num_used)
    assert used[1] < used[0]


def test_reclaim_policy_returns_pages_above_actual_counts():
    full = KVLayout.monolithic(L, H, D, page_size=PAGE, chunk_size=CHUNK, name="dynamic")
    m, s = make(lay=full, policy="reclaim")
    seq = s.add_request("d", list(range(40)))
    out = s.schedule()
    assert m.pool.num_used == 2 * pages_for(40, PAGE)          # uncompressed reservation
    actual = np.array([[9], [17]])
    s.commit(out, {"d": 1}, {"d": actual})
    np.testing.assert_array_equal(m.lengths[seq.slot], actual)
    assert m.pool.num_used == int(pages_for(actual, PAGE).sum())
    assert m.pages_reclaimed == 2 * 10 - 3 - 5 and m.reclaim_seconds > 0
    with pytest.raises(ValueError, match="written lengths"):
        m.reclaim(seq.slot, np.array([[10], [17]]))
    tm, _ = make()
    with pytest.raises(ValueError, match="never reclaims"):
        tm.reclaim(0, np.zeros((L, 2)))


def test_decode_batch_is_padded_to_a_bucket_with_the_null_slot():
    m, s = make(decode_buckets=(1, 2, 4, 8))
    for i in range(3):
        s.add_request(f"q{i}", list(range(5)))
    run_step(s)
    out = s.schedule()
    assert len(out.decode_seqs) == 3 and out.decode_bucket == 4
    assert out.decode_slots[3] == m.null_slot
    assert (m.decode_write_lengths(out.decode_slots)[3] == 0).all()
    assert (m.block_tables[m.null_slot] == 0).all()


def test_sequence_that_outgrows_the_block_table_is_capped_and_freed():
    m, s = make(max_pages=3, lay=layout(np.ones((L, 2))))   # 12 tokens per group at most
    s.add_request("long", list(range(10)))
    s.add_request("short", list(range(3)))
    capped = []
    for _ in range(20):
        out = run_step(s)
        capped += out.capped
        for q in out.decode_seqs:
            if q.request_id == "short" and q.status is SequenceStatus.DECODE:
                s.finish("short")
        if not s.has_unfinished():
            break
    assert [c.request_id for c in capped] == ["long"]
    assert capped[0].status is SequenceStatus.CAPPED and m.pool.num_free == m.pool.capacity


def test_abort_frees_everything_in_any_state():
    m, s = make()
    s.add_request("w", list(range(100 // 4)), session_id="sw")
    s.add_request("p", list(range(30)))
    out = s.schedule()
    s.abort("w")
    s.commit(out, {"p": 1})
    s.abort("p")
    assert m.pool.num_free == m.pool.capacity and not s.has_unfinished()
    assert "sw" not in s.sessions


def test_abort_between_schedule_and_commit_keeps_rows_aligned():
    m, s = make()
    for name in ("a", "b", "c"):
        s.add_request(name, list(range(6)))
    run_step(s)
    out = s.schedule()
    assert [q.request_id for q in out.decode_seqs] == ["a", "b", "c"]
    s.abort("b")
    s.commit(out, {"a": 10, "c": 12})
    assert s.get("a").token_ids[-1] == 10 and s.get("c").token_ids[-1] == 12
    np.testing.assert_array_equal(m.lengths[s.get("c").slot],
                                  layout().retained_counts(6) + 1)
    with pytest.raises(ValueError, match="no sampled token given for request 'c'"):
        s.commit(s.schedule(), {"a": 1})


@pytest.mark.parametrize("budgets", [BUDGETS, np.array([[0.07, 0.33], [0.5, 0.999]])])
def test_layout_retained_counts_lookup_equals_the_keep_rule(budgets):
    lay = layout(budgets)
    for n in list(range(0, 5 * CHUNK + 1)) + [97 * CHUNK + 3]:
        got = lay.retained_counts(n)
        np.testing.assert_array_equal(got, retained_counts(budgets, n, CHUNK))
        assert got.dtype == np.int64
    with pytest.raises(ValueError, match=">= 0"):
        lay.retained_counts(-1)


def test_cached_decode_batch_follows_every_change_and_commit_takes_placeholders():
    """The decode batch is cached between steps: after admissions, prefill->decode, finish,
    abort and preemption it must equal the running decoding sequences (admission order), and
    `commit` must accept the engine's placeholder token -1 (resolved one step late)."""
    # Budget 1, 4 cells: a sequence of 8 tokens holds 8 pages; two fill 16 of 17, so decode
    # growth preempts (as in the preemption test above) and requests take turns.
    m, s = make(num_pages=18, lay=layout(np.ones((L, 2))))
    for name in ("a", "b", "c"):
        s.add_request(name, list(range(8)))

    def check(out):
        want = [q for q in s.running if q.status is SequenceStatus.DECODE]
        assert out.decode_seqs == want
        assert out.decode_slots[:len(want)].tolist() == [q.slot for q in want]
        # Growth counted this step's token; the device gets the length before it.
        np.testing.assert_array_equal(m.decode_write_lengths(out.decode_slots)[:len(want)],
                                      m.lengths[[q.slot for q in want]] - 1)

    seen_preemption = False
    for step in range(400):
        out = s.schedule()
        check(out)
        seen_preemption |= bool(out.preempted)
        if step == 3:
            s.add_request("d", list(range(5)))
        if step == 5 and out.decode_seqs:
            s.abort(out.decode_seqs[0].request_id)
        sampled = {c.seq.request_id: -1 for c in out.prefill_chunks if c.is_last}
        sampled.update({q.request_id: -1 for q in out.decode_seqs})
        s.commit(out, sampled)
        for q in out.decode_seqs:
            if q.status is SequenceStatus.DECODE:
                assert q.token_ids[-1] == -1
                if len(q.output_token_ids) >= 6:
                    s.finish(q.request_id)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished() and seen_preemption
    assert m.pool.num_free == m.pool.capacity


def test_preempted_sequence_that_could_never_be_recomputed_is_capped_not_requeued():
    # Budget 1, 4 cells of at most 16 pages (64 tokens). "b" reaches 65 tokens of history in
    # step 4, when its own growth overflows the table and "a"'s growth finds the pool empty:
    # preempting "b" would requeue a history whose reservation can never fit the table.
    m, s = make(num_pages=73, max_pages=16, lay=layout(np.ones((L, 2))),
                max_num_batched_tokens=128)
    a = s.add_request("a", list(range(6)))
    b = s.add_request("b", list(range(62)))
    outs = [run_step(s) for _ in range(4)]
    assert [q.request_id for q in outs[-1].capped] == ["b"] and not outs[-1].preempted
    assert b.status is SequenceStatus.CAPPED and b not in s.waiting
    assert outs[-1].decode_seqs == [a] and s.metrics.num_capped == 1
    drain(s, finish_after=4)
    assert m.pool.num_free == m.pool.capacity


def test_finished_pages_return_when_admission_wants_them_or_nothing_runs():
    m, s = make(num_pages=64)
    s.add_request("a", list(range(12)))
    s.add_request("b", list(range(12)))
    run_step(s)   # both prefill
    run_step(s)   # both decode
    free_before = m.num_free_pages
    s.finish("a")
    # "b" still decodes: the finished request's pages are not returned inside this step...
    assert m.num_free_pages == free_before and s._parked
    run_step(s)   # a decode-only step (nothing waits) leaves them parked
    assert s._parked
    s.add_request("c", list(range(5)))
    out = run_step(s)   # ...the step that admits returns them first
    assert not s._parked and [c.seq.request_id for c in out.prefill_chunks] == ["c"]
    assert m.pool.num_used == m.pages_held(s.get("b").slot) + m.pages_held(s.get("c").slot)
    s.finish("b")
    s.finish("c")   # nothing runs any more: everything is back
    assert m.pool.num_free == m.pool.capacity and m.num_free_slots == m.max_seqs


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_grow_for_decode_matches_a_per_sequence_oracle(data):
    # The manager grows the whole batch with masked whole-array passes; the oracle walks the
    # sequences in the order given, cell by cell: a sequence gets a page for every group whose
    # next token crosses a page boundary, all or nothing, unless a group is at the block-table
    # width; once the pool has run out, no later sequence gets anything (the failing ones are
    # the trailing ones, who get preempted).
    max_pages = data.draw(st.integers(2, 6))
    m, _ = make(num_pages=200, max_seqs=4, max_pages=max_pages)
    slots = []
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(1, 40))
        slot = m.allocate_slot()
        if not m.reserve(slot, n):
            m.free(slot)
            continue
        m.commit_prefill(slot, n)
        for _ in range(data.draw(st.integers(0, 20))):   # some decode steps already taken
            if not m.grow_for_decode(np.array([slot])).all():
                break
        slots.append(slot)
    if not slots:
        return
    order = np.array(data.draw(st.permutations(slots)), dtype=np.intp)
    hog = m.pool.allocate(m.pool.num_free - data.draw(st.integers(0, 12)))   # a short pool
    free = m.pool.num_free
    lengths, held = m.lengths.copy(), m.table.num_pages.copy()
    want_ok, asked = [], 0
    for slot in order:
        need = lengths[slot] >= held[slot] * PAGE
        if (need & (held[slot] >= max_pages)).any():
            want_ok.append(False)
            continue
        asked += int(need.sum())
        want_ok.append(asked <= free)
    free -= sum(int((lengths[s] >= held[s] * PAGE).sum()) for s, o in zip(order, want_ok) if o)
    ok = m.grow_for_decode(order)
    assert ok.tolist() == want_ok
    event(f'{sum(want_ok)} of {len(want_ok)} granted')
    assert m.pool.num_free == free
    for slot, granted in zip(order, ok):
        grew = (lengths[slot] >= held[slot] * PAGE) & granted
        assert (m.table.num_pages[slot] == held[slot] + grew).all()
        assert (m.lengths[slot] == lengths[slot] + granted).all()
        assert (m.table.num_pages[slot] == pages_for(m.reserved_lengths[slot], PAGE)).all()
    assert (m.lengths == m.reserved_lengths).all()
    m.pool.release(hog)
    for slot in slots:
        m.free(slot)
    assert m.pool.num_free == m.pool.capacity


# ----- the protected tail of a turn (kv_layout's retention rule) -----------------------------

@pytest.mark.parametrize("rule,window", [("window", 5), ("window", 11), ("final_chunk", 0),
                                         ("none", 0)])
def test_retained_counts_equal_the_sum_of_the_chunks_prefill_writes(rule, window):
    budgets = np.array([[0.25, 0.5], [0.1, 1.0]])
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, group_size=1, page_size=PAGE,
                   chunk_size=CHUNK, head_perm=np.tile(np.arange(2), (2, 1)),
                   group_budgets=budgets, tail_rule=rule, tail_window=window)
    for n in range(0, 5 * CHUNK + 3):
        tail = lay.protected_tail(n)
        assert tail == {"window": min(n, window), "none": 0,
                        "final_chunk": n - CHUNK * ((n - 1) // CHUNK) if n else 0}[rule]
        # What the engine's prefill writes, chunk by chunk from the turn's start.
        written = np.zeros(budgets.shape, np.int64)
        protected_total = 0
        for start in range(0, n, CHUNK):
            length = min(CHUNK, n - start)
            p = lay.chunk_protected(n, start, length)
            protected_total += p
            keep = lay.chunk_keep_counts(length, p)
            np.testing.assert_array_equal(
                keep, np.minimum(np.ceil(budgets * (length - p) - 1e-6), length - p)
                .clip(min=min(length - p, 1)) + p)
            np.testing.assert_array_equal(
                lay.piece_retained_counts(n, start, start + length), keep)
            written += keep
        assert protected_total == tail
        np.testing.assert_array_equal(lay.retained_counts(n), written)
        np.testing.assert_array_equal(lay.retained_counts(n),
                                      retained_counts(budgets, n, CHUNK, tail=tail))
        # A piece of several chunks keeps their sum.
        if n > 2 * CHUNK:
            np.testing.assert_array_equal(lay.piece_retained_counts(n, CHUNK, n),
                                          written - lay.chunk_keep_counts(CHUNK,
                                                                          lay.chunk_protected(
                                                                              n, 0, CHUNK)))


def test_manager_commits_pieces_of_a_protected_turn_up_to_its_reservation():
    lay = layout().with_tail("window", 6)
    m = KVCacheManager(lay, 64, 2, 16, model_kv_shape=(lay.num_layers, lay.num_kv_heads,
                                                        lay.head_dim))
    slot = m.allocate_slot()
    n = 3 * CHUNK + 3
    assert m.reserve(slot, n)
    for start in range(0, n, 2 * CHUNK):
        m.commit_prefill(slot, min(2 * CHUNK, n - start), start=start, turn_len=n)
    np.testing.assert_array_equal(m.lengths[slot], m.reserved_lengths[slot])
    np.testing.assert_array_equal(m.lengths[slot], lay.retained_counts(n))
    assert (lay.retained_counts(n) > layout().retained_counts(n)).any()
