"""Sampling parameters, the batched sampler and the stop checker."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.sampling import (SamplingParams, StopChecker, batch_sampling_arrays, find_stop,
                                  resolve_seed, sample_tokens, step_keys)


# ---- SamplingParams validation ----

@pytest.mark.parametrize("kwargs, field", [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -2}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_k": "3"}, "top_k"),
    ({"stop": [1]}, "stop"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_types_name_the_field(kwargs, field):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=0, temperature=0)
    assert p.stop == ("###",) and p.greedy and p.top_k == 0
    assert SamplingParams().stop == () and not SamplingParams().greedy
    assert resolve_seed(SamplingParams(seed=7)) == 7
    t, k, tp = batch_sampling_arrays([SamplingParams(temperature=0.5, top_k=3, top_p=0.9), p])
    np.testing.assert_array_equal(k, [3, 0])
    assert t.dtype == np.float32 and tp.dtype == np.float32


# ---- sample_tokens ----

def _keys(seeds, step=0):
    seeds = np.asarray(seeds, np.uint32)
    return step_keys(jnp.asarray(seeds), jnp.full(seeds.shape, step, jnp.int32))


def test_greedy_rows_take_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 50))
    out = sample_tokens(logits, jnp.zeros(4), jnp.full(4, -1, jnp.int32), jnp.ones(4), _keys([1, 2, 3, 4]))
    np.testing.assert_array_equal(out, np.argmax(np.asarray(logits), -1))
    # Greedy rows stay argmax in a batch where other rows sample.
    temps = jnp.array([0.0, 2.0, 0.0, 2.0])
    mixed = sample_tokens(logits, temps, jnp.full(4, -1, jnp.int32), jnp.ones(4), _keys([1, 2, 3, 4]))
    np.testing.assert_array_equal(np.asarray(mixed)[[0, 2]], np.argmax(np.asarray(logits), -1)[[0, 2]])


def test_top_k_1_is_greedy_and_top_k_limits_support():
    logits = jax.random.normal(jax.random.PRNGKey(1), (1, 30))
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    seen = set()
    for step in range(200):
        out = sample_tokens(logits, jnp.array([5.0]), jnp.array([3], jnp.int32), jnp.ones(1),
                            _keys([11], step))
        seen.add(int(out[0]))
        out1 = sample_tokens(logits, jnp.array([5.0]), jnp.array([1], jnp.int32), jnp.ones(1),
                             _keys([11], step))
        assert int(out1[0]) == int(np.argmax(np.asarray(logits[0])))
    assert seen == top3  # high temperature: all three get drawn, nothing else ever does


def test_top_p_keeps_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1}; 0.8 still {0, 1}; 0.81 adds 2.
    probs = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)
    logits = jnp.asarray(np.log(probs))
    for top_p, allowed in [(0.7, {0, 1}), (0.5, {0}), (0.81, {0, 1, 2})]:
        seen = {int(sample_tokens(logits, jnp.ones(1), jnp.array([-1], jnp.int32),
                                  jnp.array([top_p]), _keys([3], s))[0]) for s in range(300)}
        assert seen == allowed, (top_p, seen)


def test_sampling_frequencies_match_softmax():
    probs = np.array([0.6, 0.25, 0.1, 0.05], np.float32)
    n = 4000
    logits = jnp.tile(jnp.log(jnp.asarray(probs))[None], (n, 1))
    out = sample_tokens(logits, jnp.ones(n), jnp.full(n, -1, jnp.int32), jnp.ones(n),
                        _keys(np.arange(n)))
    freq = np.bincount(np.asarray(out), minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_seeded_row_is_independent_of_batch_mates():
    logits = jax.random.normal(jax.random.PRNGKey(2), (3, 100))
    temps, tk, tp = jnp.ones(3), jnp.full(3, -1, jnp.int32), jnp.ones(3)
    a = sample_tokens(logits, temps, tk, tp, _keys([42, 1, 2]))
    other = logits.at[1:].set(jax.random.normal(jax.random.PRNGKey(9), (2, 100)))
    b = sample_tokens(other, temps, tk, tp, _keys([42, 77, 78]))
    alone = sample_tokens(logits[:1], temps[:1], tk[:1], tp[:1], _keys([42]))
    assert int(a[0]) == int(b[0]) == int(alone[0])


# ---- find_stop / StopChecker ----

def test_find_stop():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("abcabc", ["bc"], start=4) == 4  # earlier match ignored: already checked
    assert find_stop("abcabc", ["bc"], start=2) == 1  # match ending after start is found


# A byte-level toy tokenizer: token i is the byte i (ids >= 256 are special, decode to "").
def _decode(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _ids(text):
    return list(text.encode("utf-8"))


def _run(text, params, extra=(), eos=(256,)):
    chk = StopChecker(_decode, params, eos_token_ids=eos)
    pieces = []
    for t in _ids(text) + list(extra):
        pieces.append(chk.append(t))
        if chk.finished:
            break
    return chk, pieces


def test_multibyte_characters_never_split():
    text = "héllo 世界 🙂!"
    chk, pieces = _run(text, SamplingParams(max_tokens=100), extra=[256])
    assert "".join(pieces) == text and chk.text == text
    assert all("\ufffd" not in p for p in pieces)
    assert chk.finish_reason == "stop" and chk.token_ids[-1] == 256


def test_stop_string_cuts_text_and_is_held_back():
    chk, pieces = _run("abc STOP def", SamplingParams(max_tokens=100, stop=["STOP"]))
    assert chk.finished and chk.finish_reason == "stop"
    assert chk.text == "abc " and "".join(pieces) == "abc "
    # Nothing that could start the stop string was emitted before it was decided.
    assert all("S" not in p for p in pieces)
    assert len(chk.token_ids) == len(_ids("abc STOP"))


def test_partial_stop_prefix_is_released_when_it_diverges():
    chk, pieces = _run("abc STAR", SamplingParams(max_tokens=8, stop=["STOP"]))
    assert chk.finish_reason == "length" and "".join(pieces) == "abc STAR"


def test_stop_token_ids_eos_and_ignore_eos():
    chk, _ = _run("ab", SamplingParams(max_tokens=10, stop_token_ids=[ord("b")]))
    assert chk.finish_reason == "stop" and chk.text == "a"
    chk, pieces = _run("ab", SamplingParams(max_tokens=3, ignore_eos=True), extra=[256, ord("c")])
    assert chk.finish_reason == "length" and chk.token_ids == [97, 98, 256]
    with pytest.raises(RuntimeError):
        chk.append(1)


def test_max_tokens_length_finish():
    chk, pieces = _run("abcdef", SamplingParams(max_tokens=4))
    assert chk.finish_reason == "length" and chk.text == "abcd" and len(chk.token_ids) == 4


def test_a_steps_sampling_rows_travel_as_one_array_and_come_back_bit_for_bit():
    """`pack_rows` puts a step's eleven per-row sampling arrays into one int32 array (one copy
    to the device); `unpack_rows`, inside a jitted step, gives back each array with its dtype
    and every bit (NaN payloads, -0.0, seeds above 2**31, the min_tokens flags)."""
    import jax
    import numpy as np

    from tangram_jax.sampling import LogitsAdjust, pack_rows, unpack_rows

    temperature = np.array([0.0, 0.7, -0.0], np.float32)
    top_k, top_p = np.array([-1, 50, 1], np.int32), np.array([1.0, 0.9, 1e-7], np.float32)
    seeds, steps = np.array([0, 2**32 - 1, 2**31], np.uint32), np.array([0, 7, 2**30], np.int32)
    forced = np.array([-1, 3, 49151], np.int32)
    adjust = LogitsAdjust(np.array([0, 0.5, np.nan], np.float32), np.zeros(3, np.float32),
                          np.array([1, 1.3, 2], np.float32), np.array([0, 0.05, 1], np.float32),
                          np.array([False, True, False]))
    packed = pack_rows(temperature, top_k, top_p, seeds, steps, forced, adjust)
    assert packed.dtype == np.int32 and packed.shape == (11, 3)
    back = jax.jit(unpack_rows)(packed)
    want = (temperature, top_k, top_p, seeds, steps, forced, *adjust)
    got = (*back[:6], *back[6])
    for w, g in zip(want, got):
        g = np.asarray(g)
        assert g.dtype == w.dtype
        assert g.tobytes() == w.tobytes()


def test_the_host_decided_sampler_chooses_what_the_device_decided_one_does():
    """`sample_tokens` with adjusts / samples decided by the caller (no conditional: the
    engine's steps) chooses the tokens its device-decided form does, for a batch that samples
    and one that only adjusts greedy rows, and neutral rows pass the penalties unchanged."""
    from tangram_jax.sampling import LogitsAdjust, neutral_adjust, penalty_row
    vocab, n = 64, 6
    logits = jax.random.normal(jax.random.PRNGKey(3), (n, vocab)) * 3
    rows = jnp.stack([jnp.asarray(penalty_row(vocab, [1, 2, 3], [5, 5, 7], [0]))] * n)
    tk, tp = jnp.array([-1, 5, -1, 3, -1, -1], jnp.int32), jnp.array([1, 0.9, 1, 1, 0.5, 1])
    keys = _keys(np.arange(n))
    neutral = LogitsAdjust(*map(jnp.asarray, neutral_adjust(n)))
    penalised = neutral._replace(repetition=jnp.array([1, 1.3, 1, 2, 1, 1], jnp.float32),
                                 presence=jnp.array([0, 0, 0.5, 0, 0, 0], jnp.float32))
    for temps, adjust in ((jnp.array([0, 0.7, 1, 0, 1.5, 0.3]), neutral),
                          (jnp.array([0, 0.7, 1, 0, 1.5, 0.3]), penalised),
                          (jnp.zeros(n), penalised)):
        on_device = sample_tokens(logits, temps, tk, tp, keys, adjust, rows)
        on_host = sample_tokens(logits, temps, tk, tp, keys, adjust, rows, adjusts=True,
                                samples=True)
        np.testing.assert_array_equal(on_host, on_device)
    skipped = sample_tokens(logits, jnp.zeros(n), tk, tp, keys, neutral, rows, adjusts=False,
                            samples=False)
    np.testing.assert_array_equal(skipped, np.argmax(np.asarray(logits), -1))
