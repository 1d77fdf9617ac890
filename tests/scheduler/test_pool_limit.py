"""Limiting the pages a pool hands out (`PagePool.limit`, `KVCacheManager.limit_pages`,
`Engine.limit_kv_cache`): a pool sweep serves several pool sizes over one build."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_jax.scheduler.page_pool import OutOfPagesError, PagePool


def test_a_limited_pool_hands_out_only_ids_below_the_limit_and_can_be_widened_again():
    pool = PagePool(10)
    pool.limit(5)
    assert pool.capacity == 4 and pool.num_free == 4 and pool.num_used == 0
    pages = pool.allocate(4)
    assert sorted(pages.tolist()) == [1, 2, 3, 4]
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    with pytest.raises(ValueError, match="allocated"):
        pool.limit(10)                    # pages still held
    pool.release(pages)
    assert pool.num_free == 4
    pool.limit(10)
    assert pool.capacity == 9 and sorted(pool.allocate(9).tolist()) == list(range(1, 10))
    for bad in (1, 11, 2.5, True):
        with pytest.raises(ValueError, match="num_pages"):
            PagePool(10).limit(bad)


def test_engine_serves_the_limited_pool_and_refuses_a_limit_while_busy(tiny_folder):
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import tiny_engine_config
    engine = Engine(tiny_engine_config(tiny_folder, "full", num_pages=None,
                                       kv_cache_memory_bytes=1 << 20))
    whole = engine.manager.capacity
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def served() -> list[int]:
        engine.add_request(prompt_token_ids=list(range(3, 40)), sampling_params=greedy)
        return [o for o in engine.stream() if o.finished][0].outputs[0].token_ids

    before = served()
    engine.limit_kv_cache(1 << 19)
    half = engine.manager.capacity
    assert 0.4 * whole <= half <= 0.5 * whole
    assert engine.runner.num_pages == whole + 1          # the arrays did not change
    assert served() == before                            # the same answer from fewer pages
    engine.add_request(prompt_token_ids=list(range(3, 40)), sampling_params=greedy,
                       session_id="s")
    [o for o in engine.stream() if o.finished]
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.limit_kv_cache(None)                       # a session holds pages
    engine.end_session("s")
    with pytest.raises(ValueError, match="more than the pool"):
        engine.limit_kv_cache(1 << 22)
    engine.limit_kv_cache(None)
    assert engine.manager.capacity == whole
    assert np.all(engine.manager.num_free_pages == whole)
