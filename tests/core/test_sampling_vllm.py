"""vLLM's sampling knobs beyond temperature / top-k / top-p: n, the three penalties, min_p,
min_tokens, include_stop_str_in_output, prompt_logprobs. Each device rule against a pure-numpy
reference of vLLM's definition; validation names the field."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.sampling import (SamplingParams, StopChecker, adjust_logits,
                                  logits_adjust_arrays, penalty_row, sample_tokens, step_keys)


def _rows(vocab, params, prompts, outputs, stops):
    """The rows' penalty rows as the engine writes them (`requests._penalty_rows`): the prompt
    counted only with a repetition penalty, the output only with a penalty."""
    return jnp.asarray(np.stack([
        penalty_row(vocab, prompt if p.repetition_penalty != 1 else (),
                    out if p.counts_tokens else (), stop)
        for p, prompt, out, stop in zip(params, prompts, outputs, stops)]))


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=129), "n"), (dict(n=1.5), "n"), (dict(n=True), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**kwargs)


def test_vllms_ranges_temperature_top_k_seed(caplog):
    """What vLLM's SamplingParams accepts (vllm/sampling_params.py: `_MAX_TEMP`, `_verify_args`)
    is accepted with its meaning; what it refuses is refused with the same kind of message."""
    with caplog.at_level(logging.WARNING, logger="tangram_jax.sampling"):
        tiny = SamplingParams(temperature=1e-40)
    assert tiny.temperature == 0.01 and not tiny.greedy
    assert "temperature 1e-40 is less than 0.01" in caplog.text and "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=2.0).temperature == 2.0
    for t in (2.0000001, 3.0, 100.0):
        with pytest.raises(ValueError, match=rf"temperature must be in \[0, 2\], got {t}"):
            SamplingParams(temperature=t)
    with pytest.raises(ValueError, match="temperature must be non-negative, got -0.5"):
        SamplingParams(temperature=-0.5)
    # top_k: any k >= 1 is a limit, one at least the vocabulary none (stored within int32).
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    assert SamplingParams(top_k=2**40).top_k == 2**31 - 1
    with pytest.raises(ValueError, match=r"top_k must be 0 or -1 \(disable\), or at least 1, "
                                         r"got -2"):
        SamplingParams(top_k=-2)
    assert SamplingParams(seed=-1).seed is None


def test_top_k_beyond_the_vocabulary_is_no_limit():
    """The device sampler draws from the whole vocabulary for k >= V, as for k = 0."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8)), jnp.float32)
    keys = step_keys(jnp.asarray([5], jnp.uint32), jnp.asarray([0], jnp.int32))
    draw = lambda k: int(sample_tokens(logits, jnp.asarray([2.0], jnp.float32),  # noqa: E731
                                       jnp.asarray([k], jnp.int32),
                                       jnp.asarray([1.0], jnp.float32), keys)[0])
    assert draw(2**31 - 1) == draw(8) == draw(0)


def test_defaults_change_nothing_and_numpy_scalars_normalise():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
            p.min_tokens, p.include_stop_str_in_output, p.prompt_logprobs) == \
        (1, 0.0, 0.0, 1.0, 0.0, 0, False, None)
    assert not p.adjusts_logits
    q = SamplingParams(n=np.int64(3), min_p=np.float32(0.25), repetition_penalty=np.float64(1.5))
    assert type(q.n) is int and type(q.min_p) is float and q.adjusts_logits
    assert SamplingParams(min_tokens=3).adjusts_logits


# ---- penalties and min_tokens: the device against numpy ----

def _reference_adjust(logits, prompt, output, presence, frequency, repetition, stop_ids, suppress):
    """vLLM's `apply_penalties` and MinTokensLogitsProcessor, one row at a time in numpy."""
    out = logits.astype(np.float64).copy()
    vocab = out.shape[-1]
    for b in range(out.shape[0]):
        counts = np.bincount(np.asarray(output[b], np.int64), minlength=vocab)[:vocab]
        seen = counts > 0
        seen[np.asarray(prompt[b], np.int64)] = True
        row = out[b]
        penalised = np.where(row > 0, row / repetition[b], row * repetition[b])
        row = np.where(seen, penalised, row)
        row = row - frequency[b] * counts - presence[b] * (counts > 0)
        if suppress[b]:
            row[list(stop_ids[b])] = -np.inf
        out[b] = row
    return out


def test_penalties_and_min_tokens_match_numpy_reference():
    rng = np.random.default_rng(0)
    batch, vocab = 5, 40
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3),
              SamplingParams(presence_penalty=-1.0, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=2.0, min_tokens=4, max_tokens=20),
              SamplingParams(),                                   # unchanged row
              SamplingParams(repetition_penalty=2.0, min_tokens=2)]
    prompts = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in params]
    outputs = [rng.integers(0, vocab, rng.integers(0, 12)).tolist() for _ in params]
    outputs[2] = [5, 5, 5]                      # under min_tokens (3 < 4): stops masked
    outputs[4] = [7, 8, 9]                      # past min_tokens: nothing masked
    stops = [[0], [1, 2], [3, 39], [4], [6]]
    adjust = logits_adjust_arrays(params, [len(o) for o in outputs], rows=batch)
    got = np.asarray(adjust_logits(jnp.asarray(logits), jax.tree.map(jnp.asarray, adjust),
                                   _rows(vocab, params, prompts, outputs, stops)))
    want = _reference_adjust(
        logits, [p if q.repetition_penalty != 1 else [] for p, q in zip(prompts, params)], outputs,
        [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
        [p.repetition_penalty for p in params], stops,
        [p.min_tokens > len(o) for p, o in zip(params, outputs)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert np.isneginf(got[2, [3, 39]]).all() and np.isfinite(got[4]).all()
    np.testing.assert_array_equal(got[3], logits[3])


def test_penalty_rows_follow_sampled_tokens_and_a_pending_one_on_the_device():
    """A slot's penalty row: every sampled token is counted on the device
    (`record_tokens`); a row written from the host ids (`write_penalty_row`) replaces it,
    counting once the slot's last token when the host has not fetched it yet (`pending`)."""
    from tangram_jax.sampling import SlotState, record_tokens, write_penalty_row
    state = SlotState(jnp.zeros(3, jnp.int32), jnp.zeros((3, 10), jnp.int32))
    state = record_tokens(state, jnp.array([0, 1, 2]), jnp.array([3, 8, 8]))
    state = record_tokens(state, jnp.array([0, 1, 2]), jnp.array([3, 8, 1]))
    np.testing.assert_array_equal(np.asarray(state.tokens), [3, 8, 1])
    assert np.asarray(state.penalties)[0, 3] == 2 and np.asarray(state.penalties)[2, 8] == 1
    # Slot 1's host ids: output [5] and the in-flight 8; slot 2's: nothing pending.
    state = write_penalty_row(state, np.int32(1), penalty_row(10, [2], [5], [9]), np.int32(1))
    state = write_penalty_row(state, np.int32(2), penalty_row(10, [], [4], []), np.int32(0))
    rows = np.asarray(state.penalties)
    assert rows[1, 5] == 1 and rows[1, 8] == 1 and rows[1].sum() == 2 + (1 << 30) + (1 << 29)
    assert rows[2].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    logits = jnp.zeros((2, 10)) + jnp.arange(10.0)
    params = [SamplingParams(frequency_penalty=1.5, min_tokens=3, max_tokens=9)] * 2
    got = np.asarray(adjust_logits(logits, jax.tree.map(jnp.asarray, logits_adjust_arrays(
        params, [2, 3], rows=2)), state.penalties[1:]))
    np.testing.assert_allclose(got[0, [5, 8]], [5 - 1.5, 8 - 1.5])
    assert np.isneginf(got[0, 9]) and got[0, 2] == 2.0     # stop masked; prompt not counted
    np.testing.assert_allclose(got[1, 4], 4 - 1.5)


def test_greedy_row_takes_the_penalised_argmax():
    logits = jnp.array([[5.0, 4.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=2.0)]
    adjust = logits_adjust_arrays(params, [1], rows=1)
    keys = step_keys(jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))
    token = sample_tokens(logits, jnp.zeros(1), jnp.full(1, -1, jnp.int32), jnp.ones(1), keys,
                          jax.tree.map(jnp.asarray, adjust), _rows(4, params, [[]], [[0]], [[]]))
    assert int(token[0]) == 1
    plain = sample_tokens(logits, jnp.zeros(1), jnp.full(1, -1, jnp.int32), jnp.ones(1), keys)
    assert int(plain[0]) == 0


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    probs = np.array([0.45, 0.3, 0.15, 0.06, 0.04])
    logits = jnp.asarray(np.log(probs))[None].repeat(400, 0)
    min_p = 0.3                         # floor 0.135: tokens 0, 1, 2 survive
    params = [SamplingParams(min_p=min_p)] * 400
    adjust = jax.tree.map(jnp.asarray, logits_adjust_arrays(params, [0] * 400, rows=400))
    keys = step_keys(jnp.arange(400, dtype=jnp.uint32), jnp.zeros(400, jnp.int32))
    tokens = np.asarray(sample_tokens(logits, jnp.ones(400), jnp.full(400, -1, jnp.int32),
                                      jnp.ones(400), keys, adjust, jnp.zeros((400, 5), jnp.int32)))
    keep = probs >= min_p * probs.max()
    assert set(tokens.tolist()) == set(np.flatnonzero(keep).tolist())
    # The survivors are drawn in proportion to their renormalised probabilities.
    freq = np.bincount(tokens, minlength=5)[:3] / 400
    np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.08)


# ---- stop handling ----

def _decode(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _feed(text, params, extra=()):
    chk = StopChecker(_decode, params, eos_token_ids=[256])
    pieces = []
    for t in list(text.encode()) + list(extra):
        if chk.finished:
            break
        pieces.append(chk.append(t))
    return chk, pieces


def test_include_stop_str_in_output_keeps_the_stop_string():
    chk, pieces = _feed("abc STOP def", SamplingParams(max_tokens=100, stop=["STOP"],
                                                        include_stop_str_in_output=True))
    assert chk.text == "abc STOP" and "".join(pieces) == "abc STOP"
    assert chk.stop_reason == "STOP" and chk.finish_reason == "stop"
    # Nothing held back: every prefix of the text streams as it comes.
    assert pieces[:5] == list("abc S")


def test_stop_token_text_is_kept_only_with_include_stop_str():
    params = SamplingParams(max_tokens=10, stop_token_ids=[ord("!")])
    assert _feed("hi!x", params)[0].text == "hi"
    chk, _ = _feed("hi!x", SamplingParams(max_tokens=10, stop_token_ids=[ord("!")],
                                          include_stop_str_in_output=True))
    assert chk.text == "hi!" and chk.stop_reason == ord("!")


def test_min_tokens_delays_eos_stop_tokens_and_stop_strings():
    params = SamplingParams(max_tokens=20, min_tokens=5, stop=["b"], stop_token_ids=[ord("z")])
    chk, _ = _feed("abzdbe", params, extra=[256])
    # "b" (token 2) and "z" (token 3) came before min_tokens; the second "b" (token 5) stops.
    assert chk.finished and chk.text == "abzd" and chk.stop_reason == "b"
    # An EOS as 4th token does not end it (only forcing can put one there); the 5th does.
    chk, _ = _feed("abc", SamplingParams(max_tokens=20, min_tokens=5), extra=[256, 256, 256])
    assert chk.finished and len(chk.token_ids) == 5 and chk.finish_reason == "stop"
    assert chk.stop_token_ids == {256}
