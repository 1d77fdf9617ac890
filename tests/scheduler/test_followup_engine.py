"""The engine, end to end on the tiny random-weight model: session follow-ups arrive while long
first turns prefill. A follow-up's first token comes within two steps (it is admitted in the
first step after it arrives; tokens are reported a step late), whether long turns are capped
(a chunk a step, two at once) or not (the default: one long turn at a time takes the rest of
each step). Greedy tokens are the same either way: scheduling changes when a token comes,
never which. (Before the scheduler put short turns first, these follow-ups waited 7-9 steps.)

Run with ``-s`` to print the figures (follow-up time to first token in engine steps)."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams
from tiny_engine import SMALL, tiny_engine_config

LONG, FIRST, FOLLOW = 200, 20, 8   # tokens: long first turns, resident sessions' turns


def serve(engine: Engine) -> tuple[dict[str, int], dict[str, int], dict[str, list[int]]]:
    """The scenario; returns each follow-up's and each long turn's steps from the follow-ups'
    arrival to its first token, and every request's greedy tokens."""
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens: dict[str, list[int]] = {}

    def drain():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids

    for sid in ("a", "b", "c"):   # resident sessions: a short first turn each, then idle
        engine.add_request(f"{sid}-1", prompt_token_ids=rng.integers(0, 256, FIRST).tolist(),
                           session_id=sid, sampling_params=greedy)
    drain()
    for i in range(3):            # three long first turns arrive
        engine.add_request(f"long-{i}", prompt_token_ids=rng.integers(0, 256, LONG).tolist(),
                           sampling_params=greedy)
    engine.step()
    engine.step()                 # the first long turn is mid-prefill now
    arrived = {}
    for sid in ("a", "b", "c"):
        rid = engine.add_request(f"{sid}-2", prompt_token_ids=rng.integers(0, 256, FOLLOW).tolist(),
                                 session_id=sid, sampling_params=greedy)
        arrived[rid] = 0
    ttft: dict[str, int] = {}
    long_ttft: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            first = out.outputs[0].token_ids
            if out.request_id in arrived and first and out.request_id not in ttft:
                ttft[out.request_id] = steps
            if out.request_id.startswith("long") and first and out.request_id not in long_ttft:
                long_ttft[out.request_id] = steps
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    for sid in ("a", "b", "c"):
        engine.end_session(sid)
    assert engine.manager.pool.num_used == 0
    return ttft, long_ttft, tokens


def test_follow_ups_do_not_wait_for_long_first_turns(tiny_folder, mode="tangram"):
    # Slots for every session and long turn (no eviction: the follow-ups find their caches).
    roomy = dict(num_pages=800, max_model_len=512, max_num_seqs=8, decode_buckets=(8,))
    default = Engine(tiny_engine_config(tiny_folder, mode, **roomy))
    assert default.scheduler.long_prefill_token_threshold == SMALL["max_num_batched_tokens"]
    assert default.scheduler.max_long_partial_prefills == 1
    capped = Engine(tiny_engine_config(tiny_folder, mode, long_prefill_token_threshold=16,
                                       max_long_partial_prefills=2, **roomy))
    ttft, long_ttft, tokens = serve(default)
    ttft_capped, long_ttft_capped, tokens_capped = serve(capped)
    print(f"\n{mode}: follow-up TTFT in steps {sorted(ttft.values())} (capped "
          f"{sorted(ttft_capped.values())}); long turns' {long_ttft} (capped {long_ttft_capped})")
    assert max(ttft.values()) <= 2 and max(ttft_capped.values()) <= 2
    # Uncapped, the first long turn is not slowed by the follow-ups or the cap.
    assert long_ttft["long-0"] <= long_ttft_capped["long-0"]
    assert tokens == tokens_capped
