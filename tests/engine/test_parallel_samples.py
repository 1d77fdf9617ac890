"""Parallel samples (`SamplingParams.n`) share the prompt's pages: the reference-counted pool, the
KV-cache manager's fork (shared full pages, copies of the partly filled decode pages reserved
with the prompt), the scheduler's families (abort and preemption before and after the fork) and
the engine end to end on the tiny model in every mode (greedy children equal n=1, the pool holds
the prompt once, nothing leaks)."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.kv_layout import KVLayout, pages_for
from tangram_jax.sampling import SamplingParams
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.page_pool import PagePool
from tangram_jax.scheduler.scheduler import Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus
from tiny_engine import tiny_engine_config

LAYERS, HEADS, HEAD_DIM, PAGE, CHUNK = 2, 4, 8, 4, 8


def tangram_manager(num_pages=64, max_seqs=4, policy="reserve"):
    if policy == "reserve":
        layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, group_size=2,
                          page_size=PAGE, chunk_size=CHUNK,
                          head_perm=np.tile([1, 3, 0, 2], (LAYERS, 1)),
                          group_budgets=np.array([[0.25, 0.6], [0.4, 1.0]]))
    else:
        layout = KVLayout.monolithic(LAYERS, HEADS, HEAD_DIM, page_size=PAGE, chunk_size=CHUNK)
    return KVCacheManager(layout, num_pages, max_seqs, 16,
                          model_kv_shape=(LAYERS, HEADS, HEAD_DIM), policy=policy)


# ----- pool and manager --------------------------------------------------------------------
def test_a_shared_page_is_free_only_when_its_last_holder_lets_go():
    pool = PagePool(8)
    pages = pool.allocate(3)
    pool.share(pages[:2])
    assert pool.holders(pages).tolist() == [2, 2, 1]
    pool.release(pages)
    assert pool.num_free == 7 - 2 and pool.holders(pages).tolist() == [1, 1, 0]
    pool.release(pages[:2])
    assert pool.num_free == 7
    with pytest.raises(ValueError, match="double free"):
        pool.release(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.share(pages[:1])


def test_fork_shares_full_pages_and_copies_only_partly_filled_ones():
    m = tangram_manager()
    parent, *children = (m.allocate_slot() for _ in range(3))
    prompt = 29
    target = m.layout.retained_counts(prompt)
    partial = int((target % PAGE != 0).sum())
    assert 0 < partial < target.size          # some cells end on a page boundary
    prompt_pages = int(pages_for(target, PAGE).sum())
    assert m.pages_to_reserve(None, prompt, forks=2) == prompt_pages + 2 * partial
    assert m.reserve(parent, prompt, forks=2)
    assert m.pool.num_used == prompt_pages + 2 * partial   # the copies are set aside with it
    m.commit_prefill(parent, prompt)
    assert m.fork(parent, children) == 2 * partial
    src, dst = m.take_page_copies()
    assert m.take_page_copies()[0].size == 0
    assert src.size == dst.size == 2 * partial and np.unique(dst).size == dst.size
    assert m.pool.num_used == prompt_pages + 2 * partial   # the stash was exactly used
    own = m.table.pages_of(parent)
    for child in children:
        assert (m.lengths[child] == m.lengths[parent]).all()
        mine = m.table.pages_of(child)
        differ = mine != own
        assert differ.sum() == partial and set(own[differ]) <= set(src)
        assert (m.pool.holders(own[~differ]) == 3).all()   # parent and both children
    assert (m.pool.holders(own[np.isin(own, src)]) == 1).all()
    # Decode growth in a child takes pages of its own; freeing returns only unshared ones.
    assert m.grow_for_decode(np.array(children)).all()
    m.free(parent)
    assert m.pool.is_allocated(own[~np.isin(own, src)]).all()
    for child in children:
        m.free(child)
    assert m.pool.num_free == m.pool.capacity


def test_reclaim_forks_after_compression_and_returns_the_unused_stash():
    m = tangram_manager(policy="reclaim")
    parent, child = m.allocate_slot(), m.allocate_slot()
    assert m.reserve(parent, 24, forks=1)
    cells = LAYERS * m.layout.num_groups
    assert m.pool.num_used == cells * 6 + cells     # uncompressed prompt + a page per cell
    m.commit_prefill(parent, 24)
    actual = np.array([[13], [8]])                  # layer 1 ends on a page boundary
    m.reclaim(parent, actual)
    assert m.fork(parent, [child]) == 1
    assert (m.lengths[child] == actual).all()
    assert m.pool.num_used == 4 + 2 + 1             # pages of 13 and 8 tokens, one copy
    m.free(child)
    m.free(parent)
    assert m.pool.num_free == m.pool.capacity


def test_a_tiered_fork_copies_only_the_high_tier_decode_appends_to():
    """Precision tiers: decode tokens go to the high tier only, so a partly filled low-tier page
    is never written again and every fork shares it."""
    from tangram_jax.kv_layout import TieredLayout
    rng = np.random.default_rng(3)
    base = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, group_size=2, page_size=4,
                    chunk_size=16, head_perm=np.tile(np.arange(4), (3, 1)),
                    group_budgets=np.round(rng.uniform(0.1, 1.0, (3, 2)), 3))
    tiered = TieredLayout(base, np.round(rng.uniform(0.2, 0.8, (3, 2)), 3))
    m = KVCacheManager(tiered, (120, 80), 3, 40, model_kv_shape=(3, 4, 8))
    parent, child = m.allocate_slot(), m.allocate_slot()
    target = tiered.retained_counts(70)
    partial = target % 4 != 0
    high = np.broadcast_to(tiered.decode_tier_groups, target.shape)
    assert (partial & ~high).any() and (partial & high).any()
    assert m.reserve(parent, 70, forks=1)
    m.commit_prefill(parent, 70)
    assert m.fork(parent, [child]) == int((partial & high).sum())
    for _ in range(5):
        assert m.grow_for_decode(np.array([parent, child])).all()
    mine, its = m.table.pages_of(child), m.table.pages_of(parent)
    low_last = np.cumsum(m.table.num_pages[parent].ravel())[(~high).ravel()] - 1
    assert (mine[low_last] == its[low_last]).all()   # low-tier tails shared
    m.free(parent)
    m.free(child)
    assert all(p.num_free == p.capacity for p in m.pools)


# ----- scheduler families ------------------------------------------------------------------
def run_step(s, sampled_value=5):
    out = s.schedule()
    sampled = {}
    for chunk in out.prefill_chunks:
        if chunk.is_last:
            sampled[chunk.seq.request_id] = sampled_value
            for child in chunk.seq.fork_children:
                sampled[child.request_id] = sampled_value
    for seq in out.decode_seqs:
        sampled[seq.request_id] = sampled_value
    s.commit(out, sampled)
    return out


def test_a_family_is_admitted_whole_and_forks_when_its_prompt_is_committed():
    m = tangram_manager()
    s = Scheduler(m, max_num_batched_tokens=40, decode_buckets=(4,))
    head = s.add_request("0_r", list(range(29)), fork_ids=("1_r", "2_r"))
    kids = [s.get("1_r"), s.get("2_r")]
    assert all(k.status is SequenceStatus.WAITING and k not in s.waiting for k in kids)
    run_step(s)
    assert head.status is SequenceStatus.DECODE and m.num_free_slots == 1
    assert all(k.status is SequenceStatus.DECODE and k.token_ids == head.token_ids for k in kids)
    assert s.running == [head, *kids]
    out = run_step(s)
    assert out.decode_seqs == [head, *kids]
    for rid in ("0_r", "1_r", "2_r"):
        s.finish(rid)
    assert m.num_free_pages == m.capacity and m.num_free_slots == 4


def test_aborting_the_prefilling_sequence_hands_the_family_on():
    m = tangram_manager()
    s = Scheduler(m, max_num_batched_tokens=12, decode_buckets=(4,))   # 29 tokens: 3 steps
    s.add_request("0_r", list(range(29)), fork_ids=("1_r", "2_r"))
    run_step(s)                                     # admitted, first piece written
    s.abort("0_r")
    assert m.num_free_pages == m.capacity and m.num_free_slots == 4
    heir = s.get("1_r")
    assert heir.status is SequenceStatus.WAITING and s.waiting[0] is heir
    assert [c.request_id for c in heir.fork_children] == ["2_r"]
    s.abort("2_r")                                  # a waiting completion leaves its family
    assert heir.fork_children == []
    for _ in range(4):
        run_step(s)
    assert heir.status is SequenceStatus.DECODE
    s.finish("1_r")
    assert m.num_free_pages == m.capacity


def test_a_forked_completion_is_preempted_alone_and_keeps_its_siblings_pages():
    m = tangram_manager(num_pages=30)
    s = Scheduler(m, max_num_batched_tokens=40, decode_buckets=(4,))
    head = s.add_request("0_r", list(range(29)), fork_ids=("1_r", "2_r"))
    run_step(s)
    shared = set(m.table.pages_of(head.slot).tolist())
    preempted = []
    for _ in range(40):
        preempted += run_step(s).preempted
        if preempted:
            break
    assert preempted and preempted[0].request_id == "2_r"   # the newest of the batch
    assert shared <= set(np.flatnonzero(m.pool.holders(np.arange(30)) > 0).tolist())
    victim = preempted[0]
    assert victim.status is SequenceStatus.WAITING and not victim.is_cached
    # Its history replays with the prompt's own chunking: the prompt turn is recorded.
    assert victim.replay_plan()[0] == (0, 29, True)
    for rid in ("0_r", "1_r"):
        s.finish(rid)
    for _ in range(10):
        run_step(s)
        if s.get("2_r").status is SequenceStatus.DECODE:
            break
    assert s.get("2_r").status is SequenceStatus.DECODE
    s.finish("2_r")
    assert m.num_free_pages == m.capacity


# ----- engine, every mode ------------------------------------------------------------------
MODES = ("full", "tangram", "dynamic")
# 131 tokens: the last page of every cell is partly filled in every mode (so forks copy).
PROMPT = "the cat sat on the mat and then the cat ran off to see the dog, " * 2 + "yes"


@pytest.fixture(scope="module")
def engines(tiny_folder):
    return {mode: Engine(tiny_engine_config(tiny_folder, mode)) for mode in MODES}


def _run(engine, params, prompt=PROMPT):
    rid = engine.add_request(prompt=prompt, sampling_params=params)
    outs = [o for o in engine.stream() if o.request_id == rid]
    return outs[-1]


def _family_pages(engine, child_ids, prompt_len):
    """(pages the family should hold: the prompt's full pages once and every child's own, pages
    n separate requests would hold) from the manager's lengths, while all of them decode."""
    m, page = engine.manager, engine.layout.page_size
    seqs = [engine.scheduler.get(c) for c in child_ids]
    lengths = np.stack([m.lengths[s.slot].astype(np.int64) for s in seqs])
    # Lengths count one KV entry per committed decode token after the prompt's retained ones.
    decoded = np.array([s.num_tokens - prompt_len - 1 for s in seqs])[:, None, None]
    prompt = lengths - decoded
    assert (prompt == prompt[0]).all()           # every child forked the same prompt KV
    full = prompt[0] // page
    shared = int(full.sum()) + int((pages_for(lengths, page) - full).sum())
    return shared, int(pages_for(lengths, page).sum())


@pytest.mark.parametrize("mode", MODES)
def test_greedy_children_equal_one_request_and_hold_the_prompt_once(engines, mode):
    engine = engines[mode]
    free = engine.manager.num_free_pages
    # The family first: the pages its forks copy into were never written by a request of this
    # prompt (a stale copy of the right page could hide a missing copy).
    rid = engine.add_request(prompt=PROMPT, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, n=4, logprobs=3))
    children = [f"{i}_{rid}" for i in range(4)]
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    checked, final = 0, None
    for out in engine.stream():
        final = out if out.request_id == rid else final
        if all(engine.is_live(c) and engine.scheduler.get(c).status is SequenceStatus.DECODE
               for c in children):
            shared, separate = _family_pages(engine, children, prompt_len)
            assert engine.manager.pool.num_used == shared < separate
            checked += 1
    assert checked >= 3 and final.finished
    single = _run(engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         logprobs=3)).outputs[0]
    assert [c.token_ids for c in final.outputs] == [single.token_ids] * 4
    assert [c.text for c in final.outputs] == [single.text] * 4
    # The model's distribution at every step too (the tiny model's greedy tokens barely depend
    # on its context; its log-probs do, so a child reading a stale tail page would show here).
    want = [[(t, v.logprob) for t, v in sorted(e.items())] for e in single.logprobs]
    for c in final.outputs:
        got = [[(t, v.logprob) for t, v in sorted(e.items())] for e in c.logprobs]
        assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in want]
        np.testing.assert_allclose([v for row in got for _, v in row],
                                   [v for row in want for _, v in row], atol=1e-5)
    assert engine.manager.num_free_pages == free


@pytest.mark.parametrize("mode", MODES)
def test_aborting_one_child_leaves_the_others_and_frees_everything(engines, mode):
    engine = engines[mode]
    free = engine.manager.num_free_pages
    greedy = _run(engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    rid = engine.add_request(prompt=PROMPT, sampling_params=SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, n=3))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.get(f"1_{rid}").status is SequenceStatus.DECODE
    aborted = engine.abort(f"1_{rid}")
    assert aborted.outputs[0].finish_reason == "abort"
    outs = [o for o in engine.stream() if o.request_id == rid]
    final = outs[-1]
    assert final.finished and engine.manager.num_free_pages == free
    assert final.outputs[1].finish_reason == "abort"
    for i in (0, 2):
        assert final.outputs[i].token_ids == greedy.outputs[0].token_ids


def test_aborting_the_prefilling_child_before_the_fork_still_serves_the_rest(engines):
    engine = engines["tangram"]
    free = engine.manager.num_free_pages
    greedy = _run(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    rid = engine.add_request(prompt=PROMPT, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, n=3))
    engine.step()                                   # admitted: its first prefill piece runs
    assert engine.scheduler.get(f"0_{rid}").status is SequenceStatus.PREFILL
    engine.abort(f"0_{rid}")
    final = [o for o in engine.stream() if o.request_id == rid][-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert [final.outputs[i].token_ids for i in (1, 2)] == [greedy.outputs[0].token_ids] * 2
    assert engine.manager.num_free_pages == free



def test_more_samples_than_sequence_slots_run_as_several_families(engines):
    engine = engines["full"]                        # max_num_seqs 4
    free = engine.manager.num_free_pages
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3, n=6)
    final = _run(engine, params)
    assert [c.index for c in final.outputs] == list(range(6))
    for i in (0, 4, 5):                             # the second family's first, and one after
        single = _run(engine, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                             seed=3 + i))
        assert final.outputs[i].token_ids == single.outputs[0].token_ids
    assert engine.manager.num_free_pages == free


def test_a_family_on_a_short_pool_is_preempted_and_still_equals_one_request(engines):
    """A pool that holds the family's prompt once but not every child's growth: the newest
    child is preempted (its own pages dropped, the shared ones kept by its siblings), replays
    its history alone later, and every completion still equals a single request's."""
    folder = engines["tangram"].config.model
    engine = Engine(tiny_engine_config(folder, "tangram", num_pages=84))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    single = _run(engine, params).outputs[0]
    final = _run(engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                        logprobs=1, n=4))
    assert engine.scheduler.metrics.num_preemptions > 0
    for c in final.outputs:
        assert c.token_ids == single.token_ids
        np.testing.assert_allclose([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)],
                                   [e[t].logprob for e, t in zip(single.logprobs,
                                                                 single.token_ids)],
                                   atol=1e-4)
    assert engine.manager.num_free_pages == engine.manager.capacity
