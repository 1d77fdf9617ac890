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
# Greedy (outputs comparable with the request alone), with the top_k and seed values vLLM
# accepts: no limit at and past the vocabulary, seed -1 for none.
valid_params = st.builds(SamplingParams, temperature=st.just(0), max_tokens=st.integers(1, 12),
                         ignore_eos=st.booleans(),
                         top_k=st.sampled_from([-1, 0, 1, 7, VOCAB, VOCAB + 1, 2**31 - 1, 2**40]),
                         seed=st.sampled_from([None, -1, 3]))
bad_request = st.sampled_from([
    dict(prompt=b"bytes"), dict(prompt=""), dict(prompt="a\ud800"), dict(prompt_token_ids=5),
    dict(prompt_token_ids=[1.0, 2.0]), dict(prompt_token_ids=[True]), dict(prompt_token_ids="ab"),
    dict(prompt_token_ids=[VOCAB]), dict(prompt_token_ids=[-1]), dict(prompt_token_ids=[]),
    dict(prompt="x", session_id=["s"]), dict(prompt="x", request_id=7),
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


# ----- careless inputs around the engine: damaged caches, ports, sampling ranges, fixed pools --

@pytest.fixture(scope="module")
def pristine_cache(tiny_folder, tmp_path_factory):
    """A model cache holding one entry of the tiny model, and that model's parameters."""
    from tangram_jax.models.registry import load_model
    cache = tmp_path_factory.mktemp("pristine-cache")
    loaded = load_model(str(tiny_folder), cache_dir=cache)
    return cache, _flat_params(loaded.model)


def _flat_params(model) -> dict:
    from flax import nnx
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


@settings(max_examples=10, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10**6), where=st.floats(0, 1), length=st.integers(1, 8192),
       damage=st.sampled_from(["flip", "zero", "truncate", "delete"]))
def test_any_damage_to_any_cache_file_is_rebuilt_with_one_warning(
        tiny_folder, pristine_cache, tmp_path_factory, which, where, length, damage):
    """Any file of a cache entry (manifest, tokenizer, every orbax file), damaged anywhere in
    any way: the load says so once, in one line, converts again, and serves the model's own
    parameters."""
    import logging
    import shutil

    from tangram_jax.models.registry import load_model
    cache = tmp_path_factory.mktemp("cache")
    shutil.copytree(pristine_cache[0], cache, dirs_exist_ok=True)
    (entry,) = cache.iterdir()
    files = sorted(p for p in entry.rglob("*") if p.is_file())
    target = files[which % len(files)]
    original = target.read_bytes()
    data = bytearray(original)
    at = int(where * max(len(data) - 1, 0))
    if damage == "delete":
        target.unlink()
    elif damage == "truncate":
        target.write_bytes(bytes(data[:at]))
    else:
        end = min(len(data), at + length)
        data[at:end] = (bytes(b ^ 0xFF for b in data[at:end]) if damage == "flip"
                        else bytes(end - at))
        target.write_bytes(bytes(data))
    changed = not target.exists() or target.read_bytes() != original   # before the rebuild
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        loaded = load_model(str(tiny_folder), cache_dir=cache)
    finally:
        logging.getLogger().removeHandler(handler)
    messages = [r.getMessage() for r in records]
    if changed:
        assert len(messages) == 1 and "discarding damaged model cache entry" in messages[0], \
            (target, damage, messages)
        assert "\n" not in messages[0]
    else:   # zeroes written over zeroes: nothing to find
        assert messages == []
    got = _flat_params(loaded.model)
    assert got.keys() == pristine_cache[1].keys()
    for k, v in pristine_cache[1].items():
        np.testing.assert_array_equal(got[k], v)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])   # capsys: read each time
@given(port=st.one_of(st.integers(-10**9, -1), st.integers(65536, 10**12),
                      st.sampled_from(["", "80.5", "0x50", "eighty", "1e3", " "])))
def test_out_of_range_ports_are_one_clear_error(port, capsys):
    from tangram_jax.cli import main
    from tangram_jax.commands import port as port_type
    try:
        code = main(["serve", "--port", str(port)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--port" in lines[0] and "0-65535" in lines[0] and str(port).strip() in lines[0]
    assert port_type("65535") == 65535 and port_type("0") == 0


@settings(max_examples=200, deadline=None)
@given(t=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)),
       k=st.integers(-10**12, 10**12))
def test_sampling_params_take_what_vllm_takes(t, k):
    """vLLM's rules: temperature finite in [0, 2] (0 < t < 0.01 raised to 0.01), top_k >= -1
    (k >= the vocabulary: no limit)."""
    import math
    ok_t = isinstance(t, int) or math.isfinite(t)
    ok_t = ok_t and 0 <= t <= 2
    if ok_t:
        assert SamplingParams(temperature=t).temperature == (0.01 if 0 < t < 0.01 else float(t))
    else:
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t)
    if k >= -1:
        assert SamplingParams(top_k=k).top_k == min(k, 2**31 - 1)
    else:
        with pytest.raises(ValueError, match=r"top_k must be 0 or -1 \(disable\), or at least 1"):
            SamplingParams(top_k=k)


@settings(max_examples=300, deadline=None)
@given(limit_mib=st.integers(64, 80 * 1024), in_use_frac=st.floats(0, 1.2),
       peak_frac=st.floats(0, 0.5), page_kib=st.integers(1, 4096), pages=st.integers(2, 10**7),
       min_pages=st.integers(2, 64))
def test_fixed_pool_check_refuses_exactly_what_cannot_fit(limit_mib, in_use_frac, peak_frac,
                                                         page_kib, pages, min_pages):
    """`memory.check_fixed_pool`: refused iff pool + in use + step + headroom exceeds the cap;
    the pool it then names as fitting passes the same check."""
    import re

    from tangram_jax.engine import memory
    limit = limit_mib * 2**20
    mem = memory.DeviceMemory(limit, int(in_use_frac * limit), 0, 0.9)
    peak = int(peak_frac * limit)
    pool = memory.TieredPool.single(page_kib * 1024, min_pages)
    need = pool.bytes_of(pages) + mem.bytes_in_use + peak + memory.default_headroom(limit)
    check = dict(step_peak_bytes=peak, tokens_of=lambda p: int(p) * 16)
    if need <= limit:
        memory.check_fixed_pool(mem, pool, pages, setting="num_pages=x", **check)
        return
    with pytest.raises(ValueError) as e:
        memory.check_fixed_pool(mem, pool, pages, setting="num_pages=x", **check)
    fits = re.search(r"at most kv_cache_memory_bytes=(\d+) fits \(num_pages=(\d+)", str(e.value))
    if fits is None:
        assert "not even" in str(e.value)
        return
    memory.check_fixed_pool(mem, pool, int(fits.group(2)), setting="num_pages=y", **check)
    assert int(fits.group(1)) == pool.bytes_of(int(fits.group(2)))


def test_a_fixed_pool_over_the_devices_cap_is_refused_on_the_device(tiny_folder):
    """GPU only, run with JAX_PLATFORMS=cuda (the tests default to the CPU, which reports no
    allocator cap; tests/engine/test_memory.py checks the same path with a made-up device): a
    pool of more tokens than the card holds is refused when the engine is built, and the pool
    the error names as fitting builds."""
    import re

    import jax

    from tangram_jax.engine import memory
    from tangram_jax.engine.config import EngineConfigError
    device = memory.DeviceMemory.read(jax.devices()[0], 0.9)
    if device is None:
        pytest.skip(f"{jax.default_backend()} reports no allocator cap: the check runs on a GPU "
                    "with JAX_PLATFORMS=cuda (the tests default to the CPU)")
    with pytest.raises(EngineConfigError) as e:
        Engine(tiny_engine_config(tiny_folder, "full", num_pages=None,
                                  kv_cache_memory_bytes=2 * device.bytes_limit))
    fits = int(re.search(r"at most kv_cache_memory_bytes=(\d+) fits", str(e.value)).group(1))
    engine = Engine(tiny_engine_config(tiny_folder, "full", num_pages=None,
                                       kv_cache_memory_bytes=fits))
    assert engine.kv_pool()["bytes"] <= fits
