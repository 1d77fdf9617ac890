"""The scheduler under one-step-late token resolution (what `Engine.step` does): lengths are
committed with placeholder tokens, token values are filled in a step later, and a request can
be found finished after the scheduler already preempted it or scheduled it again."""

import numpy as np

from tangram_jax.kv_layout import KVLayout
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

L, H, D, PAGE, CHUNK = 2, 4, 8, 4, 8
PLACEHOLDER = -1


def make(num_pages, budgets):
    lay = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, group_size=2, page_size=PAGE,
                   chunk_size=CHUNK, head_perm=np.tile(np.arange(H), (L, 1)),
                   group_budgets=budgets)
    m = KVCacheManager(lay, num_pages, 4, 16, model_kv_shape=(L, H, D))
    return m, Scheduler(m, max_num_batched_tokens=64, decode_buckets=(1, 2, 4))


def step_with_placeholders(s):
    """Schedule and commit with placeholders; returns (out, [(seq, index of its placeholder)])."""
    out = s.schedule()
    sampled = [c.seq for c in out.prefill_chunks if c.is_last] + list(out.decode_seqs)
    s.commit(out, {q.request_id: PLACEHOLDER for q in sampled})
    return out, [(q, q.num_tokens - 1) for q in sampled]


def test_request_preempted_before_its_last_token_is_known_can_finish():
    # Two sequences fill the pool; the next page boundary preempts the newest while its last
    # sampled token is still a placeholder. That token then turns out to end the request.
    m, s = make(num_pages=18, budgets=np.ones((L, 2)))
    s.add_request("first", list(range(8)))
    second = s.add_request("second", list(range(8)), session_id="chat")
    pending = []
    for _ in range(12):
        out, dispatched = step_with_placeholders(s)
        if out.preempted:
            break
        for seq, index in pending:   # the previous step's tokens arrive after this dispatch
            seq.token_ids[index] = 7
        pending = dispatched
    assert [p.request_id for p in out.preempted] == ["second"]
    assert second.status is SequenceStatus.WAITING and second.token_ids[-1] == PLACEHOLDER
    for seq, index in pending:
        seq.token_ids[index] = 2 if seq is second else 7   # second's turns out to be its stop
    s.finish("second")
    assert second.status is SequenceStatus.IDLE and not second.is_cached
    assert second not in s.waiting and not s.sessions.is_listed(second)
    s.finish("first")
    assert m.pool.num_free == m.pool.capacity
    # The session's next turn re-prefills its whole history, replaying it as first written:
    # the first turn's prompt as one piece, then the rest (its sampled token, whose KV was
    # never written, goes with the new turn).
    s.add_request("second-2", [3, 4, 5], session_id="chat")
    total = second.num_tokens
    pieces = []
    while not pieces or not pieces[-1].is_last:
        out, _ = step_with_placeholders(s)
        (chunk,) = out.prefill_chunks
        pieces.append(chunk)
    assert pieces[0].start == 0 and pieces[0].end == 8      # the first turn's prompt
    assert [(a.end, b.start) for a, b in zip(pieces, pieces[1:])] == \
        [(a.end, a.end) for a in pieces[:-1]]               # contiguous
    assert pieces[-1].end == total and pieces[-1].start <= total - 3   # the new turn


def test_a_waiting_turn_that_produced_nothing_cannot_be_finished():
    m, s = make(num_pages=64, budgets=np.full((L, 2), 0.5))
    s.add_request("a", list(range(8)))
    try:
        s.finish("a")
    except ValueError as err:
        assert "waiting" in str(err)
    else:
        raise AssertionError("finish() of a request that never ran must fail")
