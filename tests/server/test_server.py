"""`tangram-jax serve` driven by the `openai` client over loopback (127.0.0.1, a port the OS
picks), on the embedded SmolLM2 (CPU). The server runs in a thread of the test process and is
stopped by the fixture; every request loop is bounded."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tangram_jax.engine.async_engine import AsyncEngine
from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams
from tangram_jax.server import build_app

pytestmark = pytest.mark.slow

SMALL = dict(max_num_seqs=4, kv_cache_tokens=4096, max_model_len=512, chunk_size=32,
             page_size=16, max_num_batched_tokens=256)
PROMPT = "The capital of France is"
MAX_LIVE = 3


@pytest.fixture(scope="module")
def server():
    engine = Engine(EngineConfig(mode="tangram", ratio=0.5, **SMALL))
    async_engine = AsyncEngine(engine, max_live_requests=MAX_LIVE)
    app = build_app(async_engine, served_model_name="smollm2")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=srv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    yield base, async_engine
    srv.should_exit = True
    thread.join(30)
    async_engine.shutdown()
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _wait_idle(async_engine, seconds=60):
    deadline = time.monotonic() + seconds
    while async_engine.num_live_requests or async_engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.05)


def test_models_health_completions_and_streaming(server, client):
    base, async_engine = server
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(base + "/health").status_code == 200
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(async_engine.engine.tokenizer.encode(PROMPT))
    # Streamed: the same text in pieces, then a usage chunk.
    stream = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    # Several prompts in one request: one choice each, in order.
    many = client.completions.create(model="smollm2", prompt=[PROMPT, "One, two,"], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == choice.text[:len(
        many.choices[0].text)]


def test_chat_streams_and_continues_the_session(server, client):
    _, async_engine = server
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=12,
                                           temperature=0)
    answer = first.choices[0].message.content
    assert answer and first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=12,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason
    # The next turn: the whole history is sent (stateless API), but only the new turn is
    # prefilled: the conversation's compressed KV is continued.
    conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=12,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    full = len(async_engine.engine.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in conv]))
    assert 0 < cached < second.usage.prompt_tokens == full
    # A stop string ends the answer without it.
    stopped = client.chat.completions.create(model="smollm2", messages=conv[:1], max_tokens=12,
                                             temperature=0, stop=[answer[3:6]])
    assert stopped.choices[0].message.content == answer[:answer.index(answer[3:6])]
    assert stopped.choices[0].finish_reason == "stop"


def test_bad_requests_are_400_and_unknown_models_404(server, client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, top_p=2.0)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, echo=True)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4,
                                  presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4,
                                  extra_body={"min_p": 1.5})
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="smollm2", prompt="", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="smollm2", max_tokens=4, messages=[
            {"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)


def test_logprobs_in_openai_shapes_streamed_or_not(server, client):
    args = dict(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    out = client.completions.create(**args)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Greedy: the chosen token is the most likely one; three alternatives, log-probs <= 0.
        assert len(top) == 3 and top[token] == value == max(top.values()) and value <= 0
    chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-5)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset

    conv = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
               and t.top_logprobs[0].logprob == t.logprob and t.bytes == list(t.token.encode())
               for t in content)
    chunks = list(client.chat.completions.create(model="smollm2", messages=conv, max_tokens=5,
                                                 temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]
    plain = client.chat.completions.create(model="smollm2", messages=conv, max_tokens=5,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    # vLLM's prompt_logprobs extension: one entry per prompt token, the first None.
    raw = httpx.post(server[0] + "/v1/completions", json=dict(
        model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=1),
        timeout=60).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == raw["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in plp[1:])


def test_n_and_penalties_pass_through(server, client):
    args = dict(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    both = client.completions.create(n=2, **args)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.completion_tokens == 16
    for i in range(2):   # completion i is the request with seed + i
        one = client.completions.create(**dict(args, seed=5 + i))
        assert both.choices[i].text == one.choices[0].text
    streamed = {0: "", 1: ""}
    for c in client.completions.create(n=2, stream=True, **args):
        streamed[c.choices[0].index] += c.choices[0].text
    assert [streamed[0], streamed[1]] == [c.text for c in both.choices]
    # Two prompts, n=2: choices prompt-major (OpenAI's order).
    many = client.completions.create(n=2, **dict(args, prompt=[PROMPT, "One, two,"]))
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == both.choices[0].text
    chat = client.chat.completions.create(model="smollm2", n=2, max_tokens=6, seed=3,
                                          messages=[{"role": "user", "content": "Hi!"}])
    assert [c.index for c in chat.choices] == [0, 1]
    # Penalties reach the sampler: greedy text changes and repeats fewer tokens.
    greedy = dict(model="smollm2", prompt="List: apple, apple, apple,", max_tokens=24,
                  temperature=0, logprobs=0)
    plain = client.completions.create(**greedy).choices[0].logprobs.tokens
    penalised = client.completions.create(frequency_penalty=1.5, presence_penalty=0.5,
                                          **greedy).choices[0].logprobs.tokens
    assert penalised != plain and len(set(penalised)) > len(set(plain))
    repeated = client.completions.create(extra_body={"repetition_penalty": 1.8, "min_p": 0.1,
                                                     "min_tokens": 20}, **greedy)
    assert repeated.usage.completion_tokens >= 20
    assert repeated.choices[0].logprobs.tokens != plain


def test_disconnect_aborts_and_full_engine_pushes_back(server, client):
    base, async_engine = server
    _wait_idle(async_engine)
    long = dict(model="smollm2", prompt=PROMPT, max_tokens=400, temperature=0)
    # Fill the engine with streams, read a little of each, check a further request gets 429.
    streams = [client.completions.create(stream=True, extra_body={"ignore_eos": True}, **long)
               for _ in range(MAX_LIVE)]
    for s in streams:
        next(iter(s))
    assert async_engine.num_live_requests == MAX_LIVE
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4)
    # Clients that go away: their requests are aborted long before 400 tokens.
    for s in streams:
        s.close()
    _wait_idle(async_engine)
    # A non-streaming client that times out is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=dict(long, ignore_eos=True), timeout=3)
    _wait_idle(async_engine)
    metrics = httpx.get(base + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith('tangram_request_finished_total{finish_reason="abort"}')]
    assert aborted and float(aborted[0].split()[-1]) >= MAX_LIVE + 1
    assert "tangram_request_rejected_total 1.0" in metrics
    assert "tangram_kv_bytes_held" in metrics and "tangram_time_to_first_token_seconds_bucket" in metrics
