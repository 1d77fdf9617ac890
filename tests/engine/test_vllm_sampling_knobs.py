"""vLLM's sampling knobs end to end on the tiny engine (tests/tiny_engine.py), in every mode:
penalties and min_tokens on the device (checked against the model's own distribution, which
`logprobs=-1` reports raw), n completions, include_stop_str_in_output, prompt_logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.llm import LLM
from tangram_jax.engine.outputs import RequestOutputKind
from tangram_jax.sampling import SamplingParams
from tiny_engine import tiny_engine_config

MODES = ("full", "tangram", "dynamic")
PROMPT = "the cat sat on the mat and then the cat"


@pytest.fixture(scope="module")
def engines(tiny_folder):
    return {mode: Engine(tiny_engine_config(tiny_folder, mode)) for mode in MODES}


def _final(engine, params, kind=RequestOutputKind.CUMULATIVE, prompt=PROMPT):
    rid = engine.add_request(prompt=prompt, sampling_params=params, output_kind=kind)
    outs = [o for o in engine.stream() if o.request_id == rid]
    assert outs[-1].finished and not engine.has_unfinished_requests()
    return outs


@pytest.mark.parametrize("mode", MODES)
def test_greedy_penalties_follow_the_model_distribution(engines, mode):
    """Every greedy token is the argmax of the raw log-softmax (what `logprobs=-1` reports)
    after presence and frequency penalties over the tokens generated before it: the in-flight
    token of asynchronous scheduling included."""
    engine = engines[mode]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.6,
                            frequency_penalty=0.9, logprobs=-1)
    (out,) = _final(engine, params, RequestOutputKind.FINAL_ONLY)
    c = out.outputs[0]
    full, tokens = c.full_logprobs, c.token_ids
    counts = np.zeros(full.shape[1])
    for t, token in enumerate(tokens):
        want = full[t] - 0.9 * counts - 0.6 * (counts > 0)
        assert token == int(np.argmax(want)), (mode, t)
        counts[token] += 1
    plain = _final(engine, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert plain[-1].outputs[0].token_ids != tokens     # the penalties changed something
    # A token repeated without penalties is what they push away.
    assert len(set(tokens)) > len(set(plain[-1].outputs[0].token_ids))


def _follows_penalties(c, frequency, presence):
    """Every greedy token of completion `c` is the argmax of its raw distribution after the
    penalties over the completion's own earlier tokens."""
    counts = np.zeros(c.full_logprobs.shape[1])
    for t, token in enumerate(c.token_ids):
        want = c.full_logprobs[t] - frequency * counts - presence * (counts > 0)
        if token != int(np.argmax(want)):
            return False
        counts[token] += 1
    return True


def test_penalties_count_each_request_s_own_tokens_in_a_reused_slot(engines):
    """The tokens a penalty counts live in the slot's row on the device. A request forced to
    repeat the very token the next one wants most leaves 16 counts of it in the slot the next
    one takes; the next one (and each completion of n > 1, in slots earlier requests sampled
    in) counts only its own completion's tokens: the same answer as on a fresh slot."""
    engine = engines["tangram"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=0.6,
                            frequency_penalty=0.9, logprobs=-1)
    (fresh,) = _final(engine, params, RequestOutputKind.FINAL_ONLY)
    wanted = fresh.outputs[0].token_ids[0]
    engine.add_request(prompt=PROMPT, sampling_params=params, forced_token_ids=[wanted] * 16)
    list(engine.stream())
    (again,) = _final(engine, params, RequestOutputKind.FINAL_ONLY)
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert _follows_penalties(again.outputs[0], 0.9, 0.6)
    (family,) = _final(engine, SamplingParams(n=2, temperature=0, max_tokens=16,
                                              ignore_eos=True, frequency_penalty=1.3,
                                              logprobs=-1), RequestOutputKind.FINAL_ONLY)
    assert all(_follows_penalties(c, 1.3, 0.0) for c in family.outputs)


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_masks_stop_tokens_on_the_device(engines, mode):
    engine = engines[mode]
    free = _final(engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = free[-1].outputs[0].token_ids[0]
    # Without min_tokens the greedy first token is a stop token: the request ends at once.
    (short,) = _final(engine, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]),
                      RequestOutputKind.FINAL_ONLY)
    assert short.outputs[0].token_ids == [first] and short.outputs[0].stop_reason == first
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=4,
                            logprobs=-1)
    (out,) = _final(engine, params, RequestOutputKind.FINAL_ONLY)
    c = out.outputs[0]
    assert len(c.token_ids) >= 4 and first not in c.token_ids[:3]
    for t in range(3):   # argmax of the distribution with the stop token taken out
        row = c.full_logprobs[t].copy()
        row[[first, *engine.tokenizer.eos_token_ids]] = -np.inf
        assert c.token_ids[t] == int(np.argmax(row))


@pytest.mark.parametrize("mode", MODES)
def test_n_completions_equal_single_requests_with_seed_plus_index(engines, mode):
    engine = engines[mode]
    params = SamplingParams(temperature=2.0, max_tokens=10, ignore_eos=True, seed=11, n=3)
    outs = _final(engine, params)
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in final.outputs)
    for i, c in enumerate(final.outputs):
        single = _final(engine, SamplingParams(temperature=2.0, max_tokens=10, ignore_eos=True,
                                               seed=11 + i))
        assert c.token_ids == single[-1].outputs[0].token_ids and c.text == single[-1].outputs[0].text
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1   # different streams
    # Only the last output is finished; every output reports all three (cumulative kind).
    assert [o.finished for o in outs].count(True) == 1
    assert all(len(o.outputs) == 3 for o in outs)
    # Deltas concatenate to the same completions, each tagged with its index.
    deltas = _final(engine, params, RequestOutputKind.DELTA)
    joined = {0: [], 1: [], 2: []}
    for o in deltas:
        assert len(o.outputs) == 1
        joined[o.outputs[0].index] += o.outputs[0].token_ids
    assert [joined[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    (only,) = _final(engine, params, RequestOutputKind.FINAL_ONLY)
    assert [c.token_ids for c in only.outputs] == [c.token_ids for c in final.outputs]


def test_n_abort_ends_every_completion_and_frees_the_pages(engines):
    engine = engines["tangram"]
    free_before = engine.manager.num_free_pages
    rid = engine.add_request(prompt=PROMPT, sampling_params=SamplingParams(
        max_tokens=50, ignore_eos=True, n=2))
    assert engine.is_live(rid)
    for _ in range(3):
        engine.step()
    out = engine.abort(rid)
    assert out.finished and out.request_id == rid
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert not engine.is_live(rid) and not engine.has_unfinished_requests()
    for _ in range(2):
        engine.step()
    assert engine.manager.num_free_pages == free_before
    with pytest.raises(ValueError, match="session"):
        engine.add_request(prompt="x", session_id="s", sampling_params=SamplingParams(n=2))


def test_include_stop_str_in_output_end_to_end(engines):
    engine = engines["full"]
    free = _final(engine, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = free[-1].outputs[0].text
    # A stop string first met past the start (the tiny model repeats itself a lot).
    i = next(i for i in range(1, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[i:i + 3]
    cut = _final(engine, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                        stop=[stop]))[-1].outputs[0]
    kept = _final(engine, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                         stop=[stop], include_stop_str_in_output=True))
    texts = [o.outputs[0].text for o in kept]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))   # never shrinks
    assert cut.text == text[:i] and kept[-1].outputs[0].text == text[:i + 3]
    assert kept[-1].outputs[0].stop_reason == stop


LONG_PROMPT = "the quick brown fox jumps over the lazy dog; " * 3


def _prompt_logprobs(engine, prompt, k=3):
    (out,) = _final(engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                           prompt_logprobs=k), RequestOutputKind.FINAL_ONLY,
                    prompt=prompt)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_are_the_model_distribution_at_each_prompt_position(engines, mode):
    engine = engines[mode]
    out = _prompt_logprobs(engine, LONG_PROMPT)
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert len(plp) == len(ids) > engine.layout.chunk_size and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert ids[j] in entry and len(entry) in (3, 4)
        top = sorted((v for t, v in entry.items() if v.rank <= 3), key=lambda v: v.rank)
        assert [v.rank for v in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        chosen = entry[ids[j]]
        assert chosen.logprob <= 0 and (chosen.rank > 3 or entry[ids[j]] in top)
    # The distribution that predicts token j is the one a request of the first j tokens
    # samples its first token from (checked where no compression has happened yet: inside
    # the first chunk, the same in every mode; in full mode everywhere).
    positions = [1, 5, engine.layout.chunk_size - 1] + ([engine.layout.chunk_size + 3, len(ids) - 1] if mode == "full"
                              else [])
    for j in positions:
        rid = engine.add_request(prompt_token_ids=ids[:j], sampling_params=SamplingParams(
            temperature=0, max_tokens=1, ignore_eos=True, logprobs=-1))
        (done,) = [o for o in engine.stream() if o.request_id == rid and o.finished]
        np.testing.assert_allclose(plp[j][ids[j]].logprob,
                                   done.outputs[0].full_logprobs[0][ids[j]], atol=2e-4)
    assert out.outputs[0].finish_reason == "length"


def test_llm_generate_and_chat_with_n(tiny_folder):
    llm = LLM(config=tiny_engine_config(tiny_folder, "tangram"))
    params = SamplingParams(temperature=2.0, max_tokens=5, ignore_eos=True, seed=1, n=3)
    (out,) = llm.generate("hello there", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    conv = [{"role": "user", "content": "hi"}]
    (reply,) = llm.chat([conv], params, use_tqdm=False)
    assert len(reply.outputs) == 3 and reply.session_id is None
    assert not llm.engine.has_unfinished_requests()
