"""Precision tiers save memory: a pool of page ids per tier (`KVCacheManager.pools`), sized by
the high tier's share of the retained tokens (`TieredLayout.pool_pages`), so the K8V4 and the
K4V2 arrays have only the pages their tier needs. Checked here: the split rule and what
`num_pages` / `kv_cache_tokens` / `gpu_memory_utilization` mean with tiers; bytes per retained
token below K8V4's for the shipped embedded profiles (the real arrays' nbytes); reservation per
(layer, group, tier) exactly the tiered formula, each tier's pages from and back to its own
pool (finish, fork, abort, preemption); admission waiting on either tier; one clear error for a
request no tier pool could ever hold; the tiny engine serving the same tokens whatever the
split, forks included. (The randomized scheduler check with tiers is in
scheduler/test_state_machine.py.)"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax import LLM, kv_quant
from tangram_jax.compression.profile import BudgetProfile, shipped_profile_path
from tangram_jax.engine import memory
from tangram_jax.engine.config import EngineConfig, EngineConfigError, pool_pages
from tangram_jax.kv_layout import KVLayout, TieredLayout, pages_for
from tangram_jax.sampling import SamplingParams
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tangram_jax.scheduler.scheduler import RequestTooLargeError, Scheduler
from tangram_jax.scheduler.sequence import SequenceStatus

from test_kv_tiers_serving import _tiered_profile
from tiny_engine import tiny_engine_config

PS = 4


def _layout():
    base = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, group_size=2, page_size=PS,
                    chunk_size=8, head_perm=np.tile(np.arange(4), (2, 1)),
                    group_budgets=np.array([[0.2, 0.8], [0.5, 0.5]]))
    return TieredLayout(base, np.array([[0.5, 0.1], [1.0, 0.0]]))


def test_pool_split_follows_the_high_share_of_retained_tokens():
    tiered = _layout()
    # sum(r h) / sum(r) = (0.1 + 0.08 + 0.5 + 0) / 2
    assert tiered.pool_high_share == pytest.approx(0.34)
    assert tiered.pool_pages(100) == (34 + 1, 66 + 1)          # each with its null page
    all_high = TieredLayout(tiered.base, np.ones((2, 2)))
    no_high = TieredLayout(tiered.base, np.zeros((2, 2)))
    assert all_high.pool_pages(10) == (10, 2) and no_high.pool_pages(10) == (2, 10)
    with pytest.raises(ValueError, match="at least 2 usable pages"):
        tiered.pool_pages(1)


def test_num_pages_and_kv_cache_tokens_with_tiers():
    """num_pages: both tiers' pools together, null pages included, split by the share (at
    least 4, or one clear error); kv_cache_tokens: the untiered pool's usable pages, split."""
    tiered = _layout()
    mc = types.SimpleNamespace(num_layers=2, num_kv_heads=4)
    cfg = EngineConfig(mode="tangram", kv_precision="k8v4-k4v2", num_pages=102)
    assert pool_pages(cfg, mc, tiered) == tiered.pool_pages(100)
    with pytest.raises(EngineConfigError, match=r"num_pages=3 cannot hold a tiered pool.*>= 4"):
        EngineConfig(mode="tangram", kv_precision="k8v4-k4v2", num_pages=3)   # when made
    too_few = EngineConfig(mode="tangram", kv_precision="k8v4-k4v2", num_pages=4)
    too_few.num_pages = 3   # an assignment checks the field alone; the rest catch the pair
    with pytest.raises(EngineConfigError, match=r"num_pages=3 cannot hold a tiered pool.*>= 4"):
        pool_pages(too_few, mc, tiered)
    with pytest.raises(EngineConfigError, match=r"num_pages=3 cannot hold a tiered pool"):
        too_few.check()                  # before any model loads
    tokens = EngineConfig(mode="tangram", kv_precision="k8v4-k4v2", kv_cache_tokens=1000)
    untiered = pool_pages(EngineConfig(mode="tangram", kv_cache_tokens=1000), mc, tiered.base)
    high, low = pool_pages(tokens, mc, tiered)
    assert high - 1 + low - 1 == untiered - 1 == 1000 * 2 * 4 // (PS * 2)


@pytest.mark.parametrize("rho, group_size", [(0.5, 1), (0.25, 1), (0.5, 3), (0.25, 3)])
def test_tiered_pool_holds_a_retained_token_in_fewer_bytes_than_k8v4(rho, group_size):
    """The shipped embedded profiles (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bf16
    model): a pool of 4096 full-KV tokens' slots, as the engine sizes it, allocated for real;
    its bytes per head-token slot (the arrays' nbytes over the slots of both tiers, whose
    pages split as the retained tokens do) are below a K8V4 pool's, by the share's mix of
    K8V4 (120 B a slot: 64 + 8 key bytes, 32 + 2 x 8 value bytes with a scale and zero a
    plane) and K4V2 (64 B) pages."""
    profile = BudgetProfile.load(shipped_profile_path(rho, group_size, tiers="k8v4-k4v2"))
    base = profile.to_layout(16, 256)
    tiered = TieredLayout(base, profile.group_high_share())
    mc = types.SimpleNamespace(num_layers=base.num_layers, num_kv_heads=base.num_kv_heads)
    shape = (base.group_size, base.page_size, base.head_dim)
    slots_per_page = base.group_size * base.page_size
    per_slot = {}
    for precision, layout in (("k8v4", base), ("k8v4-k4v2", tiered)):
        cfg = EngineConfig(mode="tangram", kv_precision=precision, kv_cache_tokens=4096)
        counts = np.atleast_1d(pool_pages(cfg, mc, layout))
        formats = [kv_quant.page_format(f) for f in
                   (tiered.tiers if precision != "k8v4" else ("k8v4",))]
        k, v = kv_quant.allocate_pools(formats, counts, shape, jnp.bfloat16)
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves((k, v)))
        per_slot[precision] = nbytes / ((counts - 1).sum() * slots_per_page)
    share = tiered.pool_high_share
    assert 0 < share < 1
    assert per_slot["k8v4"] == pytest.approx(120, rel=1e-3)
    assert per_slot["k8v4-k4v2"] == pytest.approx(120 * share + 64 * (1 - share), rel=2e-3)
    assert per_slot["k8v4-k4v2"] < per_slot["k8v4"]


# ----- the manager and the scheduler --------------------------------------------------------

def _manager(num_pages=(40, 40), max_seqs=4):
    return KVCacheManager(_layout(), num_pages, max_seqs, 16, model_kv_shape=(2, 4, 16))


def _tier_pages(cells):
    """int [2]: pages per cell [layers, 4] of the high (even) and low (odd) tier groups."""
    return np.array([cells[..., 0::2].sum(), cells[..., 1::2].sum()])


def test_reservation_per_tier_group_is_the_tiered_formula_and_uses_each_tier_pool():
    m = _manager()
    layout = m.layout
    slot = m.allocate_slot()
    n = 37
    want = pages_for(layout.retained_counts(n), PS)
    np.testing.assert_array_equal(m.pages_to_reserve(None, n), _tier_pages(want))
    assert m.reserve(slot, n)
    np.testing.assert_array_equal(m.reserved_lengths[slot], layout.retained_counts(n))
    np.testing.assert_array_equal(m.table.num_pages[slot], want)
    np.testing.assert_array_equal(m.num_used_pages, _tier_pages(want))
    np.testing.assert_array_equal(m.pages_held(slot), _tier_pages(want))
    # A tier group's entries are ids of its own tier's pool: each pool's ids, once each.
    for tier, pool in enumerate(m.pools):
        ids = np.concatenate([m.block_tables[slot, l, g, :want[l, g]]
                              for l in range(2) for g in range(tier, 4, 2)])
        assert np.unique(ids).size == ids.size == pool.num_used
        assert pool.is_allocated(ids).all()
    m.commit_prefill(slot, n)
    assert m.grow_for_decode(np.array([slot])).all()
    assert m.num_used_pages[1] == _tier_pages(want)[1]          # decode takes high pages
    m.free(slot)
    assert [p.num_free for p in m.pools] == [39, 39]


def test_fork_shares_each_tier_and_copies_in_the_high_tier():
    m = _manager()
    parent, a, b = m.allocate_slot(), m.allocate_slot(), m.allocate_slot()
    n = 21
    assert m.reserve(parent, n, forks=2)
    m.commit_prefill(parent, n)
    held = m.pages_held(parent)
    copied = m.fork(parent, [a, b])
    src, dst = m.take_page_copies()
    assert copied == dst.size and m.pools[0].is_allocated(dst).all()
    assert m.pools[0].holders(src).max() == 1                    # copied pages: own holders
    low_ids = m.block_tables[parent, :, 1::2][m.block_tables[parent, :, 1::2] > 0]
    assert (m.pools[1].holders(low_ids) == 3).all()              # shared by the family
    np.testing.assert_array_equal(m.num_used_pages, held + [copied, 0])
    for slot in (parent, a, b):
        m.free(slot)
    assert [p.num_free for p in m.pools] == [39, 39]


def _scheduler(m):
    return Scheduler(m, max_num_batched_tokens=64, decode_buckets=(1, 2, 4))


def _run(s, steps, finish=()):
    for _ in range(steps):
        out = s.schedule()
        sampled = {c.seq.request_id: 1 for c in out.prefill_chunks if c.is_last}
        sampled.update({q.request_id: 2 for q in out.decode_seqs})
        s.commit(out, sampled)
        for rid in finish:
            if rid in sampled and s.get(rid).status.is_running:
                s.finish(rid)


@pytest.mark.parametrize("short_tier", [0, 1])
def test_admission_waits_when_either_tier_is_short(short_tier):
    """A pool with room in one tier but not the other admits nothing more until a finished
    request returns its pages to the short tier."""
    layout = _layout()
    n = 60
    need = _tier_pages(pages_for(layout.retained_counts(n) + layout.decode_tier_groups, PS))
    assert (need > 5).all()
    pools = need + 4 + 1                 # one request's pages (and some decode room) per tier
    pools[1 - short_tier] += 10 * need[1 - short_tier]           # the other tier: plenty
    m = _manager(tuple(int(x) for x in pools))
    s = _scheduler(m)
    s.add_request("a", list(range(n)))
    s.add_request("b", list(range(n)))
    _run(s, 2)                                        # a prefills, then decodes a token
    assert s.get("a").status.is_running and s.get("b") in s.waiting
    assert m.num_free_pages[short_tier] < m.pages_to_reserve(None, n)[short_tier]
    assert m.num_free_pages[1 - short_tier] >= m.pages_to_reserve(None, n)[1 - short_tier]
    s.finish("a")                                     # its pages come back: b is admitted
    _run(s, 1)
    assert s.get("b").status.is_running
    assert s.metrics.num_preemptions == 0 and s.metrics.num_rejected == 0


def _held_by_tier(m):
    """int [2]: pages the block tables hold in the high and the low tier groups' cells."""
    return _tier_pages(m.table.num_pages)


def test_preemption_and_abort_return_pages_to_their_tier():
    """Decode growth runs the high tier short (decode tokens go there): the newest request is
    preempted and its pages of both tiers go back to their pools; the preempted one replays
    (its generated tokens kept whole, in the high tier) and finishes; abort returns the rest."""
    layout = _layout()
    n = 40
    need = _tier_pages(pages_for(layout.retained_counts(n) + layout.decode_tier_groups, PS))
    m = _manager((int(2 * need[0] + 1), int(3 * need[1] + 1)))    # two requests, little room
    s = _scheduler(m)
    for rid in ("a", "b", "c"):
        s.add_request(rid, list(range(n)))
    for _ in range(12):
        _run(s, 1)
        np.testing.assert_array_equal(m.num_used_pages, _held_by_tier(m))
    assert s.metrics.num_preemptions > 0 and s.metrics.num_capped == 0
    preempted = [rid for rid in "bc" if s.get(rid).num_preemptions]
    assert preempted and s.get(preempted[0]).num_output_tokens
    s.finish("a")
    back = s.get(preempted[0])
    for _ in range(10):          # replayed (its generated tokens kept whole), then decoding
        _run(s, 1)
        np.testing.assert_array_equal(m.num_used_pages, _held_by_tier(m))
        if back.status is SequenceStatus.DECODE:
            break
    assert back.status is SequenceStatus.DECODE and s.metrics.num_capped == 0
    for rid in ("b", "c"):
        s.abort(rid)
    _run(s, 1)
    assert [p.num_used for p in m.pools] == [0, 0]


def test_request_too_large_for_one_tier_is_one_clear_error():
    layout = _layout()
    n = 60
    need = _tier_pages(pages_for(layout.retained_counts(n) + layout.decode_tier_groups, PS))
    m = _manager((int(need[0]) + 50, int(need[1])))   # the low tier one page short, ever
    s = _scheduler(m)
    high, low = m.pages_to_reserve(None, n)
    with pytest.raises(RequestTooLargeError,
                       match=rf"request 'big' \({n} tokens of history\) needs {high} k8v4 "
                             rf"\+ {low} k4v2 pages after compression plus decode room; the "
                             rf"pool has {need[0] + 49} k8v4 \+ {need[1] - 1} k4v2 pages"):
        s.add_request("big", list(range(n)))
    assert s.metrics.num_rejected == 1
    s.add_request("ok", list(range(n - 20)))


def test_a_tiered_manager_takes_a_pool_size_per_tier():
    with pytest.raises(ValueError, match=r"num_pages must be a \(high, low\) pair"):
        _manager(80)
    with pytest.raises(AttributeError, match="a pool per tier"):
        _manager().pool


# ----- the engine end to end (tiny model) ---------------------------------------------------

def _tiny_llm(folder, **overrides):
    shares = np.random.default_rng(1).uniform(0.2, 0.8, (2, 2))
    return LLM(config=tiny_engine_config(folder, "tangram", kv_precision="k8v4-k4v2",
                                         profile=_tiered_profile(folder, shares), **overrides))


def test_tiny_engine_tokens_do_not_depend_on_the_split(tiny_folder):
    """The same requests (forks of n = 2 among them) on pools of different sizes, so the low
    tier's page ids differ: the same greedy tokens, every page back in its tier, and
    `kv_pool` reports each tier's pages and the arrays' bytes."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=n).tolist() for n in (5, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    outs = []
    for num_pages in (160, 400):
        llm = _tiny_llm(tiny_folder, num_pages=num_pages)
        engine = llm.engine
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs.append([[c.token_ids for c in o.outputs] for o in got])
        assert all(p.num_used == 0 for p in engine.manager.pools)
        pool = engine.kv_pool()
        runner = engine.runner
        arrays = (runner.k_pages.high, runner.v_pages.high, runner.k_pages.low,
                  runner.v_pages.low)
        assert pool["num_pages"] == num_pages == sum(a.shape[0] for a in arrays[::2])
        assert pool["bytes"] == sum(a.nbytes for a in arrays)
        assert [t["num_pages"] for t in pool["tiers"].values()] == \
            [runner.k_pages.high.shape[0], runner.k_pages.low.shape[0]]
        assert list(pool["tiers"]) == ["k8v4", "k4v2"]
    assert outs[0] == outs[1]


def test_gpu_sizing_gives_tiers_more_retained_tokens_than_k8v4(tiny_folder, monkeypatch):
    """`gpu_memory_utilization` sizing (a made-up device: the CPU reports no allocator) of the
    same budget: the tiered pool's arrays fit the plan, and hold more head-token slots than
    K8V4's in no more bytes than the plan left for the pool."""
    card = 200 * 2**20
    monkeypatch.setattr(memory.DeviceMemory, "read", classmethod(
        lambda cls, d, f: memory.DeviceMemory(int(0.9 * card), 30 * 2**20, 0, 0.9)))
    pools = {}
    for precision in ("k8v4", "k8v4-k4v2"):
        kwargs = dict(num_pages=None, gpu_memory_utilization=0.5, compile_cache_dir="off",
                      warmup=False)
        llm = (_tiny_llm(tiny_folder, **kwargs) if precision != "k8v4" else
               LLM(config=tiny_engine_config(tiny_folder, "tangram", kv_precision="k8v4",
                                             **kwargs)))
        plan, pool = llm.engine.memory_plan, llm.engine.kv_pool()
        assert pool["sized_by"] == "gpu_memory_utilization"
        assert pool["bytes"] == plan.pool_bytes
        assert plan.pool_bytes + plan.in_use_bytes + plan.step_peak_bytes \
            + plan.headroom_bytes <= plan.budget_bytes
        pools[precision] = pool
        if precision != "k8v4":
            layout = llm.engine.layout
            high, low = plan.num_pages
            assert (high, low) == layout.pool_pages(high + low - 2)
            out = llm.generate([{"prompt_token_ids": list(range(1, 40))}],
                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
    assert pools["k8v4-k4v2"]["bytes_per_slot"] < pools["k8v4"]["bytes_per_slot"]
    assert pools["k8v4-k4v2"]["slots"] > pools["k8v4"]["slots"]


def _serve_until_a_tier_is_full(layout, usable, prompt, answer):
    """Sequences of one `prompt`-token turn answered in `answer` decode tokens, admitted one
    after the other and held, on a manager whose pools `layout.pool_pages(usable)` splits,
    until a reservation or a decode page fails. Returns (sequences whole, free pages per tier
    then, pages a whole sequence holds per tier)."""
    m = KVCacheManager(layout, layout.pool_pages(usable), 64, 80, model_kv_shape=(2, 4, 16))
    done = 0
    while True:
        slot = m.allocate_slot()
        if not m.reserve(slot, prompt):
            break
        m.commit_prefill(slot, prompt)
        if not all(m.grow_for_decode(np.array([slot])).all() for _ in range(answer)):
            break
        done += 1
    one = pages_for(layout.retained_counts(prompt) + answer * layout.decode_tier_groups, PS)
    return done, np.asarray(m.num_free_pages), _tier_pages(one)


def test_pool_split_for_short_turns_with_long_answers_fills_both_tiers():
    """Short turns (48 tokens, the last 8 protected) answered in 200 tokens: nearly everything
    a sequence holds is in the high tier (tail + answer), so pools split by the calibrated
    share alone run out of high pages while most low pages are free; split for that turn
    (`pool_turn`, the engine's `kv_tier_turn`) the low pool has no room left for another
    sequence when the high pool is full, and more sequences fit the same pages."""
    import dataclasses
    prompt, answer, usable = 48, 200, 1200
    calibrated = _layout().with_tail("window", 8)
    for_turn = dataclasses.replace(calibrated, pool_turn=(prompt, answer))
    assert for_turn.pool_high_share > 0.9 > 0.34 == pytest.approx(calibrated.pool_high_share)
    done_cal, free_cal, one = _serve_until_a_tier_is_full(calibrated, usable, prompt, answer)
    done_turn, free_turn, _ = _serve_until_a_tier_is_full(for_turn, usable, prompt, answer)
    # Calibrated split: the high pool is what ran out; the low one could hold many more.
    assert free_cal[0] < one[0] and free_cal[1] > 10 * one[1]
    # Split for the turn: neither pool could take another sequence's share.
    assert free_turn[0] < one[0] and free_turn[1] < 2 * one[1]
    assert done_turn >= 2 * done_cal
    # Long turns with short answers: the share tends to the calibrated one.
    long_turn = dataclasses.replace(calibrated, pool_turn=(4000, 0))
    assert long_turn.pool_high_share == pytest.approx(calibrated.pool_high_share, abs=0.03)


def test_engine_splits_tier_pools_for_kv_tier_turn():
    """`kv_tier_turn` reaches the layout the pools are split by; the default is one
    max_model_len sequence ending in a 256-token answer (at most an eighth of it); it is
    refused without tiers."""
    from tangram_jax.engine.config import tiered_layout
    mc = types.SimpleNamespace(num_layers=2, num_kv_heads=4)
    calibrated = _layout()
    profile = types.SimpleNamespace(tiers=types.SimpleNamespace(precision="k8v4-k4v2"),
                                    group_high_share=lambda: calibrated.high_share)
    base = calibrated.base.with_tail("window", 8)
    cfg = EngineConfig(mode="tangram", kv_precision="k8v4-k4v2", kv_tier_turn=(48, 200),
                       num_pages=402)
    layout = tiered_layout(cfg, profile, base, 4096)
    assert layout.pool_turn == (48, 200)
    assert pool_pages(cfg, mc, layout) == layout.pool_pages(400) != calibrated.pool_pages(400)
    default = tiered_layout(EngineConfig(mode="tangram", kv_precision="k8v4-k4v2"), profile,
                            base, 4096)
    assert default.pool_turn == (4096 - 256, 256)
    short = tiered_layout(EngineConfig(mode="tangram", kv_precision="k8v4-k4v2"), profile,
                          base, 400)
    assert short.pool_turn == (400 - 50, 50)
    with pytest.raises(EngineConfigError, match=r"kv_tier_turn=\(48, 200\) splits a tiered"):
        EngineConfig(mode="tangram", kv_precision="k8v4", kv_tier_turn=(48, 200)).check()
    with pytest.raises(EngineConfigError, match="kv_tier_turn must be"):
        EngineConfig(kv_tier_turn=(48,))
    # K4V2 pages (alone or as the low tier) pair adjacent slots: an odd page_size is refused.
    for precision, mode in (("k4v2", "full"), ("k8v4-k4v2", "tangram")):
        with pytest.raises(EngineConfigError, match=rf"page_size=15: kv_precision "
                                                    rf"'{precision}' stores K4V2 pages as slot"):
            EngineConfig(mode=mode, kv_precision=precision, page_size=15).check()
    EngineConfig(kv_precision="k8v4", page_size=15).check()


def test_server_metrics_report_the_fullest_tier(tiny_folder):
    """`/metrics` of a tiered engine: the KV pool gauge is the fullest tier's use (the one
    that stops admission), and a gauge per tier gives each tier's."""
    import asyncio
    from tangram_jax.server.metrics import ServerMetrics
    engine = _tiny_llm(tiny_folder, num_pages=160).engine
    high, low = engine.manager.pools
    taken = [high.allocate(high.capacity * 3 // 4), low.allocate(low.capacity // 4)]

    class Running:            # what ServerMetrics reads of an AsyncEngine
        num_live_requests, is_alive = 0, True

        async def call(self, fn):
            return fn(engine)

    text = asyncio.run(ServerMetrics(Running()).render())[0].decode()
    gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("tangram_kv_") and "pool" in line}
    high_use, low_use = (p.num_used / p.capacity for p in (high, low))
    assert high_use > 0.7 and low_use < 0.3
    assert gauges["tangram_kv_pool_pages_used_ratio"] == pytest.approx(high_use)
    assert gauges['tangram_kv_tier_pool_pages_used_ratio{tier="k8v4"}'] == pytest.approx(high_use)
    assert gauges['tangram_kv_tier_pool_pages_used_ratio{tier="k4v2"}'] == pytest.approx(low_use)
    for pool, ids in zip((high, low), taken):
        pool.release(ids)


def test_kv_cache_memory_bytes_buys_more_slots_in_smaller_formats(tiny_folder):
    """`kv_cache_memory_bytes` sizes the pool in its own page format: the arrays' bytes are at
    most the budget and within a page (per tier) of it, so K8V4 and the tiers hold more
    head-token slots than bf16 in the same bytes; too few bytes for one max_model_len
    sequence, or a second pool size beside it, is one clear error."""
    budget = 3 * 2**20
    pools = {}
    for precision in ("bf16", "k8v4", "k8v4-k4v2"):
        kwargs = dict(num_pages=None, kv_cache_memory_bytes=budget, compile_cache_dir="off",
                      warmup=False)
        llm = (_tiny_llm(tiny_folder, **kwargs) if precision == "k8v4-k4v2" else
               LLM(config=tiny_engine_config(tiny_folder, "tangram", kv_precision=precision,
                                             **kwargs)))
        engine, pool = llm.engine, llm.engine.kv_pool()
        assert pool["sized_by"] == "kv_cache_memory_bytes"
        assert budget - sum(engine.runner.tier_page_bytes) < pool["bytes"] <= budget, precision
        pools[precision] = pool
        if precision == "k8v4-k4v2":
            out = llm.generate([{"prompt_token_ids": list(range(1, 40))}],
                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
    assert pools["bf16"]["slots"] < pools["k8v4"]["slots"] < pools["k8v4-k4v2"]["slots"]
    with pytest.raises(EngineConfigError, match=r"kv_cache_memory_bytes=1000 holds .* "
                                                r"max_model_len=\d+ sequence needs"):
        LLM(config=tiny_engine_config(tiny_folder, "tangram", kv_precision="k8v4",
                                      num_pages=None, kv_cache_memory_bytes=1000, warmup=False))
    with pytest.raises(EngineConfigError, match="give one of the three"):
        EngineConfig(kv_cache_memory_bytes=budget, kv_cache_tokens=1000).check()
