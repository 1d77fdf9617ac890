"""Streaming outputs (never shrinking, cumulative / delta / final-only), stop_reason, abort,
the engine seed, and `AsyncEngine` on the embedded SmolLM2 (CPU)."""

from __future__ import annotations

import asyncio

import pytest

from tangram_jax.engine.async_engine import AsyncEngine, EngineBusy
from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.engine.outputs import RequestOutputKind
from tangram_jax.sampling import SamplingParams

pytestmark = pytest.mark.slow

SMALL = dict(mode="full", max_num_seqs=4, kv_cache_tokens=4096, max_model_len=512, chunk_size=32,
             page_size=16, max_num_batched_tokens=256)
PROMPT = "Write a short story about a robot who learns to paint."
FREE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(seed=1234, **SMALL))


def _run(engine, params, kind=RequestOutputKind.CUMULATIVE, prompt=PROMPT):
    rid = engine.add_request(prompt=prompt, sampling_params=params, output_kind=kind)
    return [o for o in engine.stream() if o.request_id == rid]


def _assert_never_shrinks(outs):
    texts = [o.outputs[0].text for o in outs]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)
    return texts


@pytest.fixture(scope="module")
def free_run(engine):
    """The greedy text without stop strings, and a stop string that spans a token boundary."""
    (last,) = _run(engine, FREE, RequestOutputKind.FINAL_ONLY)
    text, ids = last.outputs[0].text, last.outputs[0].token_ids
    assert last.finished and last.outputs[0].finish_reason == "length" and len(ids) == 40
    for k in range(4, len(ids) - 4):
        b = len(engine.tokenizer.decode(ids[:k]))
        stop = text[b - 2:b + 3]
        if text.startswith(engine.tokenizer.decode(ids[:k])) and len(stop) == 5 \
                and text.find(stop) == b - 2 and stop.strip():
            return text, ids, stop, b
    pytest.fail(f"no token boundary to split a stop string across in {text!r}")


def test_stream_never_shrinks_with_a_stop_string_split_across_tokens(engine, free_run):
    text, ids, stop, boundary = free_run
    outs = _run(engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    texts = _assert_never_shrinks(outs)
    final = outs[-1].outputs[0]
    assert final.text == text[:boundary - 2] and final.finish_reason == "stop"
    assert final.stop_reason == stop and outs[-1].finished
    # Nothing of the stop string ever reached the stream, though its first characters were
    # decoded a token before the rest.
    assert all(final.text.startswith(t) for t in texts)
    # Tokens are final as soon as they are sampled: they run ahead of the held-back text.
    assert outs[-1].outputs[0].token_ids == ids[:len(final.token_ids)]


def test_a_stop_prefix_that_never_completes_is_released(engine, free_run):
    text, _, stop, boundary = free_run
    never = stop[:3] + "\x00never"
    outs = _run(engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[never]))
    _assert_never_shrinks(outs)
    # While the prefix was pending the stream stopped before it; then it came out.
    assert any(o.outputs[0].text == text[:boundary - 2] for o in outs[:-1])
    assert outs[-1].outputs[0].text == text and outs[-1].outputs[0].stop_reason is None


def test_delta_and_final_only_kinds(engine, free_run):
    text, ids, stop, boundary = free_run
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    deltas = _run(engine, params, RequestOutputKind.DELTA)
    assert len(deltas) > 2 and not any(o.finished for o in deltas[:-1])
    assert "".join(o.outputs[0].text for o in deltas) == text[:boundary - 2]
    assert sum((o.outputs[0].token_ids for o in deltas), []) == ids[:sum(
        len(o.outputs[0].token_ids) for o in deltas)]
    assert deltas[-1].outputs[0].stop_reason == stop
    (only,) = _run(engine, params, RequestOutputKind.FINAL_ONLY)
    assert only.finished and only.outputs[0].text == text[:boundary - 2]


def test_stop_token_is_the_stop_reason_and_abort_is_reported(engine, free_run):
    _, ids, _, _ = free_run
    outs = _run(engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                       stop_token_ids=[ids[5]]))
    first = ids.index(ids[5])
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == ids[5]
    assert outs[-1].outputs[0].token_ids == ids[:first + 1]
    rid = engine.add_request(prompt=PROMPT, sampling_params=FREE)
    for _ in range(4):
        engine.step()
    aborted = engine.abort(rid)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].stop_reason is None and not engine.has_unfinished_requests()


def test_engine_seed_seeds_unseeded_requests(engine):
    """EngineConfig.seed seeds requests without their own seed, per request (vLLM's engine seed):
    the same request sampled again with that engine seed draws the same tokens (the seed is a
    pure function of engine seed and request id, so in another engine too)."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)

    def tokens(eng, request_id, params):
        eng.add_request(request_id, prompt=PROMPT, sampling_params=params)
        return [o for o in eng.stream() if o.request_id == request_id][-1].outputs[0].token_ids

    first = [tokens(engine, rid, sampled) for rid in ("seed-a", "seed-b")]
    assert first[0] != first[1]      # each request draws its own seed
    # Again, in the opposite order and batched together this time: the same tokens per request.
    engine.add_request("seed-b", prompt=PROMPT, sampling_params=sampled)
    engine.add_request("seed-a", prompt=PROMPT, sampling_params=sampled)
    outs = {o.request_id: o for o in engine.stream() if o.finished}
    assert [outs["seed-a"].outputs[0].token_ids, outs["seed-b"].outputs[0].token_ids] == first
    own = tokens(engine, "seed-c", seeded)
    # Another engine seed changes them; a request's own seed wins over the engine's.
    engine.config.seed = 4321
    try:
        assert tokens(engine, "seed-a", sampled) != first[0]
        assert tokens(engine, "seed-c", seeded) == own
    finally:
        engine.config.seed = 1234


def test_async_engine_streams_cancels_and_pushes_back(engine, free_run):
    text, _, _, _ = free_run
    async_engine = AsyncEngine(engine, max_live_requests=2)

    async def collect(**kw):
        return [o async for o in async_engine.generate(prompt=PROMPT, sampling_params=FREE, **kw)]

    async def main():
        # Two at once, DELTA by default: the deltas add up to the same text.
        a, b = await asyncio.gather(collect(), collect())
        assert "".join(o.outputs[0].text for o in a) == text == "".join(o.outputs[0].text for o in b)
        # A third request while two are live is refused at once.
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gens = [async_engine.generate(prompt=PROMPT, sampling_params=long) for _ in range(2)]
        firsts = [await g.__anext__() for g in gens]
        assert all(not f.finished for f in firsts)
        with pytest.raises(EngineBusy):
            await collect()
        # Leaving a stream aborts its request and frees its place.
        for g in gens:
            await g.aclose()
        for _ in range(200):
            if await async_engine.call(lambda e: not e.has_unfinished_requests()):
                break
            await asyncio.sleep(0.05)
        assert async_engine.num_live_requests == 0
        assert await async_engine.call(lambda e: e.has_unfinished_requests()) is False
        # Bad input is this request's error only.
        with pytest.raises(ValueError, match="empty"):
            [o async for o in async_engine.generate(prompt="", sampling_params=FREE)]
        # A chat's next turn continues its session: the history is not prefilled again.
        conv = [{"role": "user", "content": "Name a colour."}]
        params = SamplingParams(temperature=0, max_tokens=8)
        turn1 = [o async for o in async_engine.generate(messages=conv, sampling_params=params)]
        answer = "".join(o.outputs[0].text for o in turn1)
        conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
        turn2 = [o async for o in async_engine.generate(messages=conv, sampling_params=params)]
        assert turn1[-1].num_cached_tokens == 0 and turn2[-1].num_cached_tokens > 0
        assert turn2[-1].session_id == turn1[-1].session_id

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert not async_engine.is_alive


def test_vllm_sampling_fields_on_the_embedded_model(engine):
    """Penalties act on the device (every greedy token is the argmax of the model's raw
    distribution minus the penalties), min_tokens holds EOS back, n gives seed + i streams, and
    prompt_logprobs are the distributions single requests of the prompt's prefixes sample from."""
    import numpy as np
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=1.0, logprobs=-1)
    (out,) = _run(engine, params, RequestOutputKind.FINAL_ONLY)
    c = out.outputs[0]
    counts = np.zeros(c.full_logprobs.shape[1])
    for t, token in enumerate(c.token_ids):
        assert token == int(np.argmax(c.full_logprobs[t] - 1.0 * counts - 0.5 * (counts > 0)))
        counts[token] += 1
    # min_tokens: EOS is masked until 6 tokens exist, though the model wants to end at once.
    conv = [{"role": "user", "content": "Say only: yes"}]
    rid = engine.add_request(messages=conv, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, min_tokens=6))
    free = [o for o in engine.stream() if o.request_id == rid][-1].outputs[0]
    rid = engine.add_request(messages=conv, sampling_params=SamplingParams(
        temperature=0, max_tokens=40))
    plain = [o for o in engine.stream() if o.request_id == rid][-1].outputs[0]
    assert len(free.token_ids) >= 6 and not set(free.token_ids[:5]) & set(
        engine.tokenizer.eos_token_ids)
    assert free.finish_reason == plain.finish_reason == "stop"
    # n: completion i is the single request with seed + i.
    sampled = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=3, n=2)
    (both,) = _run(engine, sampled, RequestOutputKind.FINAL_ONLY)
    for i, comp in enumerate(both.outputs):
        (one,) = _run(engine, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True,
                                             seed=3 + i), RequestOutputKind.FINAL_ONLY)
        assert comp.token_ids == one.outputs[0].token_ids
    # prompt_logprobs against the first-token distribution of a prefix of the prompt.
    (withp,) = _run(engine, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                    RequestOutputKind.FINAL_ONLY)
    ids, plp = withp.prompt_token_ids, withp.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    j = len(ids) - 2
    rid = engine.add_request(prompt_token_ids=ids[:j], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, logprobs=-1))
    (prefix,) = [o for o in engine.stream() if o.request_id == rid and o.finished]
    np.testing.assert_allclose(plp[j][ids[j]].logprob,
                               prefix.outputs[0].full_logprobs[0][ids[j]], atol=1e-3)
