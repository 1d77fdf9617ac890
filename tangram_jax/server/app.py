"""The OpenAI-compatible HTTP API over one `AsyncEngine` (FastAPI; run by uvicorn).

    POST /v1/completions        text completion, streamed as server-sent events with stream=true
    POST /v1/chat/completions   chat (the model's own chat template), streamed likewise
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text format

One engine thread serves every connection (`AsyncEngine`). When it already holds
`max_live_requests` requests a new one is answered 429 at once (back-pressure instead of an
unbounded queue); a client that disconnects, streaming or not, has its request aborted, which
frees its KV pages. The API is stateless like OpenAI's: a chat request whose messages extend an
idle conversation's history continues that conversation's compressed KV (`Engine.find_session`),
so only the new turn is prefilled; `usage.prompt_tokens_details.cached_tokens` says how many
prompt tokens were not.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tangram_jax.engine.async_engine import AsyncEngine, EngineBusy, EngineDead
from tangram_jax.engine.outputs import RequestOutput
from tangram_jax.models.tokenizer import ChatTemplateError
from tangram_jax.server.metrics import ServerMetrics
from tangram_jax.server.protocol import ChatCompletionRequest, CompletionRequest

class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.status}},
                            status_code=self.status, headers=self.headers)


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` under `served_model_name` (default: the model's
    name as the engine loaded it)."""
    model_name = served_model_name or async_engine.engine.model_name
    defaults = async_engine.engine.default_sampling_params   # the model's generation config
    metrics = ServerMetrics(async_engine)
    app = FastAPI(title="tangram-jax", description=__doc__)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = model_name

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return APIError(400, f"{where}: {first.get('msg', 'invalid request')}",
                        param=where or None).response()

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return PlainTextResponse("engine not running", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tangram-jax", "root": async_engine.engine.model_name,
            "max_model_len": async_engine.engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = await metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts, params = _accept(body, model_name, body.prompts, body.max_tokens, defaults)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [_generate(async_engine, metrics, f"{request_id}-{i}", sampling_params=params, **p)
                   for i, p in enumerate(prompts)]
        if body.stream:
            first = await _start_all(streams)
            return _sse(_completion_chunks(request_id, model_name, streams, first, params.n,
                                           _include_usage(body)))
        finals = await _until_disconnect(request, _collect_all(streams))
        choices = []
        for i, collected in enumerate(finals):
            for j, choice in sorted(collected.choices.items()):
                body_ = {"index": i * params.n + j, "text": choice.text,
                         "logprobs": choice.completion_logprobs(),
                         "finish_reason": choice.finish_reason,
                         "stop_reason": choice.stop_reason}
                if params.prompt_logprobs is not None:
                    body_["prompt_logprobs"] = _prompt_logprobs(collected.prompt_logprobs)
                choices.append(body_)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "usage": _usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages, params = _accept(body, model_name, body.engine_messages,
                                   body.requested_max_tokens, defaults)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = _generate(async_engine, metrics, request_id, sampling_params=params,
                           messages=messages, fill_context=body.requested_max_tokens is None)
        if body.stream:
            first = await _start_all([stream])
            return _sse(_chat_chunks(request_id, model_name, stream, first[0], params.logprobs,
                                     _include_usage(body)))
        (collected,) = await _until_disconnect(request, _collect_all([stream]))
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": j, "message": {"role": "assistant", "content": c.text},
                             "logprobs": c.chat_logprobs(params.logprobs),
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            for j, c in sorted(collected.choices.items())],
                "usage": _usage([collected])}

    return app


# ----- requests into the engine --------------------------------------------------------------
async def _generate(async_engine: AsyncEngine, metrics: ServerMetrics, request_id: str,
                    **request) -> AsyncIterator[RequestOutput]:
    """The engine's DELTA outputs for one request, with API errors and metrics."""
    gen = async_engine.generate(request_id=request_id, **request)
    out = None
    refused = False
    generated = 0   # tokens of every completion (DELTA outputs: each counted once)
    try:
        try:
            out = await gen.__anext__()
        except EngineBusy as e:
            refused = True
            metrics.rejected.inc()
            raise APIError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except (ValueError, TypeError, ChatTemplateError) as e:
            refused = True
            raise APIError(400, str(e)) from None
        generated += sum(len(c.token_ids) for c in out.outputs)
        yield out
        while not out.finished:
            out = await gen.__anext__()
            generated += sum(len(c.token_ids) for c in out.outputs)
            yield out
    except EngineDead as e:
        refused = refused or out is None
        raise APIError(503, str(e), "service_unavailable") from None
    finally:
        await gen.aclose()
        if not refused:   # ended, or aborted (also a client gone before the first token)
            metrics.observe(out, generated)


async def _start_all(streams) -> list[RequestOutput]:
    """Each stream's first output, so admission errors become an HTTP status before the
    response starts (after the first SSE byte, only an in-stream error is possible)."""
    firsts = []
    try:
        for s in streams:
            firsts.append(await s.__anext__())
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return firsts


class _Choice:
    """One completion of a request as its DELTA outputs arrive: text, token count, log-probs."""

    def __init__(self):
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[tuple[int, dict]] | None = None   # (token id, its entry) per token
        self.finish_reason = None
        self.stop_reason = None

    def add(self, c) -> None:
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(zip(c.token_ids, c.logprobs))
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    def completion_logprobs(self, entries=None, offset: int = 0) -> dict | None:
        """/v1/completions' `logprobs` (OpenAI's legacy shape) of `entries` (default: all)."""
        entries = self.logprobs if entries is None else entries
        return None if entries is None else _completion_logprobs(entries, offset)

    def chat_logprobs(self, top: int | None, entries=None) -> dict | None:
        """/v1/chat/completions' `logprobs` of `entries` (default: all)."""
        entries = self.logprobs if entries is None else entries
        return None if entries is None or top is None else _chat_logprobs(entries, top)


class _Collected:
    """Everything one engine request (one prompt) produced: its choices by index, last output."""

    def __init__(self):
        self.choices: dict[int, _Choice] = {}
        self.last: RequestOutput | None = None
        self.prompt_logprobs = None   # DELTA outputs carry them once, in the first

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            self.choices.setdefault(c.index, _Choice()).add(c)


async def _collect_all(streams) -> list[_Collected]:
    """What each stream produced, the streams run concurrently."""
    async def collect(stream):
        collected = _Collected()
        async for out in stream:
            collected.add(out)
        return collected

    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, work):
    """Await `work`, cancelling it (which aborts its requests) if the client goes away.

    The body has been read, so the next ASGI message on this connection is its disconnect
    (vLLM's `listen_for_disconnect` does the same)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")
    finally:
        for t in (task, watcher):
            t.cancel()


# ----- response bodies -----------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.type, 'code': e.status}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _merge(streams, firsts):
    """(index, output) from several streams as they come, each stream's first output first."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)
             if not firsts[i].finished]
    live = len(tasks)
    try:
        for i, first in enumerate(firsts):
            yield i, first
        while live:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                live -= 1
            yield i, item
    finally:
        # A client that went away cancels this generator: stop the pumps, then close the
        # streams, which aborts their requests.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _completion_chunks(request_id, model_name, streams, firsts, n, include_usage):
    created = int(time.time())
    collected = [_Collected() for _ in streams]
    async for i, out in _merge(streams, firsts):
        for c in out.outputs:
            choice = collected[i].choices.setdefault(c.index, _Choice())
            offset = len(choice.text)
            choice.add(c)
            if not (c.text or c.token_ids or c.finish_reason):
                continue
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model_name,
                   "choices": [{"index": i * n + c.index, "text": c.text,
                                "logprobs": None if c.logprobs is None else
                                _completion_logprobs(list(zip(c.token_ids, c.logprobs)), offset),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason}]}
        collected[i].last = out
    if include_usage:
        yield {"id": request_id, "object": "text_completion", "created": created,
               "model": model_name, "choices": [], "usage": _usage(collected)}


async def _chat_chunks(request_id, model_name, stream, first, top_logprobs, include_usage):
    created = int(time.time())

    def chunk(index, delta, logprobs=None, finish_reason=None):
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}

    collected = _Collected()
    async for _, out in _merge([stream], [first]):
        for c in out.outputs:
            if c.index not in collected.choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            collected.choices.setdefault(c.index, _Choice()).add(c)
            if c.text or c.token_ids:
                lp = None if c.logprobs is None or top_logprobs is None else \
                    _chat_logprobs(list(zip(c.token_ids, c.logprobs)), top_logprobs)
                yield chunk(c.index, {"content": c.text}, lp)
            if c.finish_reason is not None:
                yield chunk(c.index, {}, None, c.finish_reason)
        collected.last = out
    if include_usage and collected.last is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
               "model": model_name, "choices": [], "usage": _usage([collected])}


# vLLM's floor for log-probabilities in JSON (-inf is not JSON).
_LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(float(value), _LOGPROB_FLOOR)


def _completion_logprobs(entries, offset: int = 0) -> dict:
    """OpenAI's legacy completion logprobs of [(token id, {id: Logprob})]: tokens,
    token_logprobs, top_logprobs (every alternative the engine reported, by text) and each
    token's text offset (from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in entries:
        chosen = entry[token]
        text = chosen.decoded_token or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(_logprob(chosen.logprob))
        out["top_logprobs"].append({(lp.decoded_token or ""): _logprob(lp.logprob)
                                    for lp in sorted(entry.values(), key=lambda x: x.rank)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(entries, top: int) -> dict:
    """OpenAI's chat logprobs of [(token id, {id: Logprob})]: per token its text, logprob,
    UTF-8 bytes and the `top` most likely alternatives."""
    def item(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token, entry in entries:
        best = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda x: x.rank)
        content.append({**item(entry[token]), "top_logprobs": [item(lp) for lp in best[:top]]})
    return {"content": content}


def _prompt_logprobs(entries):
    """vLLM's `prompt_logprobs` of a choice (`RequestOutput.prompt_logprobs`): per prompt token
    None or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in entries]


def _usage(collected: list[_Collected]) -> dict:
    finals = [c.last for c in collected if c.last is not None]
    prompt = sum(o.num_cached_tokens + len(o.prompt_token_ids) for o in finals)
    completion = sum(ch.num_tokens for c in collected for ch in c.choices.values())
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _accept(body, served: str, engine_input, max_tokens: int | None, defaults):
    """(engine input, SamplingParams) of a request body, or the APIError that refuses it: 404
    for another model, 400 for an unsupported field or a bad value. `defaults`: the model's
    generation defaults, for the sampler fields the body leaves out."""
    if body.model is not None and body.model != served:
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                            f"`{served}`", "NotFoundError", param="model")
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"not supported by this server yet: {', '.join(unsupported)}")
    try:
        return engine_input(), body.sampling_params(max_tokens, defaults)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
