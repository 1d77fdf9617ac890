"""Hypothesis fuzzing of the engine through its public API, on a tiny random-weight model.

Random interleavings of add / step / abort / end_session, with invalid requests mixed in, in
every mode. Properties: an invalid request raises TypeError/ValueError and leaves nothing
queued; every valid request ends (finished output, a known finish reason); a greedy request
that was not aborted produces the tokens it produces alone; at the end no page and no slot is
held. Plus a soak of thousands of steps whose Python heap stays flat.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams
from tiny_engine import tiny_engine_config

MODES = ("full", "tangram", "dynamic")
VOCAB = 259


@pytest.fixture(scope="module")
def engines(tiny_folder):
    return {mode: Engine(tiny_engine_config(tiny_folder, mode)) for mode in MODES}


def _drain(engine: Engine, limit: int = 2000) -> dict:
    finished = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("engine did not finish its requests")


def _assert_idle(engine: Engine) -> None:
    for sid in list(engine.sessions):
        if engine.has_session(sid):
            engine.end_session(sid)
    # Parked pages of finished requests are returned when nothing runs.
    assert not engine.has_unfinished_requests()
    assert engine.manager.pool.num_used == 0, engine.manager.usage()
    assert engine.manager.num_free_slots == engine.config.max_num_seqs


prompt_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
prompt_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                      max_size=30)
valid_params = st.builds(SamplingParams, temperature=st.just(0), max_tokens=st.integers(1, 12),
                         ignore_eos=st.booleans())
bad_request = st.sampled_from([
    dict(prompt=b"bytes"), dict(prompt=""), dict(prompt="a\ud800"), dict(prompt_token_ids=5),
    dict(prompt_token_ids=[1.0, 2.0]), dict(prompt_token_ids=[True]), dict(prompt_token_ids="ab"),
    dict(prompt_token_ids=[VOCAB]), dict(prompt_token_ids=[-1]), dict(prompt_token_ids=[]),
    dict(prompt="x", session_id=["s"]), dict(prompt="x", request_id=7),
    dict(prompt="x", sampling_params=SamplingParams(top_k=VOCAB + 1)),
    dict(prompt="x", sampling_params=SamplingParams(stop_token_ids=[VOCAB])),
    dict(prompt="x", sampling_params="greedy"), dict(prompt="x", prompt_token_ids=[1]),
    dict(messages=[{"role": "assistant", "content": "hi"}]),
    dict(messages=[{"role": "user", "content": "\udcff"}]),
    dict(prompt_token_ids=list(range(1, 250)) * 2),   # longer than max_model_len
])
action = st.one_of(
    st.tuples(st.just("add"), st.one_of(prompt_ids, prompt_text), valid_params,
              st.sampled_from([None, "s1", "s2"])),
    st.tuples(st.just("bad"), bad_request),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 10)),
    st.tuples(st.just("end_session"), st.sampled_from(["s1", "s2"])),
)


def _solo(engine: Engine, request: dict) -> list[int]:
    rid = engine.add_request(**request)
    return _drain(engine)[rid].outputs[0].token_ids


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(action, min_size=1, max_size=25))
def test_random_interleavings_keep_outputs_and_free_everything(engines, mode, actions):
    engine = engines[mode]
    _assert_idle(engine)
    added, aborted, outputs = {}, set(), {}
    for act in actions:
        kind = act[0]
        if kind == "add":
            _, prompt, params, session = act
            request = (dict(prompt=prompt) if isinstance(prompt, str)
                       else dict(prompt_token_ids=prompt))
            request["sampling_params"] = params
            if session is not None and engine.session_is_busy(session):
                with pytest.raises(ValueError, match="still serving"):
                    engine.add_request(session_id=session, **request)
                continue
            try:
                rid = engine.add_request(session_id=session, **request)
            except ValueError as e:   # a text prompt may tokenise past max_model_len
                assert "max_model_len" in str(e) or "pages" in str(e)
                continue
            added[rid] = (request, session)
        elif kind == "bad":
            live = set(engine._requests)
            with pytest.raises((TypeError, ValueError)):
                engine.add_request(**act[1])
            assert set(engine._requests) == live   # nothing queued
        elif kind == "step":
            for _ in range(act[1]):
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
        elif kind == "abort":
            live = sorted(engine._requests)
            if live:
                rid = live[act[1] % len(live)]
                out = engine.abort(rid)
                assert out.finished and out.outputs[0].finish_reason == "abort"
                aborted.add(rid)
        elif kind == "end_session":
            if engine.has_session(act[1]) and not engine.session_is_busy(act[1]):
                engine.end_session(act[1])
    outputs.update(_drain(engine))
    for rid, (request, session) in added.items():
        if rid in aborted:
            continue
        out = outputs[rid]
        assert out.outputs[0].finish_reason in ("stop", "length"), out
        assert out.error is None
        if session is None:   # a session turn depends on its history
            assert out.outputs[0].token_ids == _solo(engine, request), (mode, request)
    _assert_idle(engine)


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_request_ends_alone_with_an_error(engines, mode):
    """A request whose detokenisation raises inside a step ends with finish_reason "error";
    the request beside it gets exactly its solo tokens."""
    engine = engines[mode]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    good = dict(prompt_token_ids=[5, 6, 7, 8, 9], sampling_params=params)
    solo = _solo(engine, good)
    engine.add_request("poisoned", prompt_token_ids=[40, 41, 42], sampling_params=params)
    calls = []

    def failing_decode(ids):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected detokeniser failure")
        return engine.tokenizer.decode(ids)

    engine._requests["poisoned"].stop._decode = failing_decode
    rid = engine.add_request(**good)
    outs = _drain(engine)
    assert outs["poisoned"].outputs[0].finish_reason == "error"
    assert "injected detokeniser failure" in outs["poisoned"].error
    assert outs[rid].outputs[0].token_ids == solo and outs[rid].error is None
    _assert_idle(engine)


def test_an_unusable_sampling_row_fails_only_its_request(engines):
    """The isolation path for sampling: a request whose parameters cannot be turned into its
    row (validation would refuse them; here they are forced past it) errors alone."""
    engine = engines["full"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    good = dict(prompt_token_ids=[3, 4, 5], sampling_params=params)
    solo = _solo(engine, good)
    forced = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    object.__setattr__(forced, "top_k", 2**40)   # past the frozen dataclass's validation
    engine.add_request("bad-k", prompt_token_ids=[9, 9, 9], sampling_params=params)
    engine._requests["bad-k"].params = forced
    rid = engine.add_request(**good)
    outs = _drain(engine)
    assert outs["bad-k"].outputs[0].finish_reason == "error"
    assert "top_k" in outs["bad-k"].error or "Overflow" in outs["bad-k"].error
    assert outs[rid].outputs[0].token_ids == solo
    _assert_idle(engine)


def test_soak_thousands_of_steps_with_a_flat_heap(engines):
    """Requests keep arriving and finishing for 2300 steps; after a warm-up the Python heap
    does not grow over two later windows of 500 steps (no per-step growth: metrics,
    sessions, tables)."""
    engine = engines["tangram"]
    rng = np.random.default_rng(0)
    steps = 0

    def run(n_steps):
        nonlocal steps
        for _ in range(n_steps):
            while len(engine._requests) < 6:
                n = int(rng.integers(1, 30))
                session = f"soak-{int(rng.integers(0, 4))}"
                kw = {}
                if not engine.session_is_busy(session) and rng.random() < 0.5:
                    kw["session_id"] = session
                    if engine.has_session(session) and rng.random() < 0.3:
                        engine.end_session(session)
                try:
                    engine.add_request(prompt_token_ids=rng.integers(0, VOCAB, n).tolist(),
                                       sampling_params=SamplingParams(
                                           temperature=float(rng.choice([0, 0.8])),
                                           max_tokens=int(rng.integers(1, 24))), **kw)
                except ValueError:   # a session grown past max_model_len
                    engine.end_session(session)
            engine.step()
            steps += 1

    run(600)   # warm: every shape compiled, caches and windows filled
    gc.collect()
    tracemalloc.start()
    heap = []
    for n_steps in (700, 500, 500):
        run(n_steps)
        gc.collect()
        heap.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert steps >= 2300
    assert engine.scheduler.metrics.num_steps >= 2300
    assert engine.scheduler.metrics.step_host_seconds.size <= 4096
    # Allow noise (live requests' token lists) and a one-time cost in one window (a program
    # compiled for a shape met late), not growth with steps, which shows in both windows.
    assert min(heap[1] - heap[0], heap[2] - heap[1]) < 256 * 1024, heap
    for rid in list(engine._requests):
        engine.abort(rid)
    _assert_idle(engine)
