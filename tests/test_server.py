"""`tangram-jax serve` driven by the `openai` client over loopback (127.0.0.1, a port the OS
picks), on the embedded SmolLM2 (CPU). The server runs in a thread of the test process and is
stopped by the fixture; every request loop is bounded."""

from __future__ import annotations

import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tangram_jax.engine.async_engine import AsyncEngine  # noqa: E402
from tangram_jax.engine.config import EngineConfig  # noqa: E402
from tangram_jax.engine.llm_engine import Engine  # noqa: E402
from tangram_jax.sampling import SamplingParams  # noqa: E402
from tangram_jax.server import build_app  # noqa: E402

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
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="smollm2", prompt="", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="smollm2", max_tokens=4, messages=[
            {"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)


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
