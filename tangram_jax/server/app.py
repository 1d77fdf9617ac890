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
        prompts, params = _accept(body, model_name, body.prompts, body.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [_generate(async_engine, metrics, f"{request_id}-{i}", sampling_params=params, **p)
                   for i, p in enumerate(prompts)]
        if body.stream:
            first = await _start_all(streams)
            return _sse(_completion_chunks(request_id, model_name, streams, first,
                                           _include_usage(body)))
        finals = await _until_disconnect(request, _collect_all(streams))
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": i, "text": text, "logprobs": None,
                             "finish_reason": _finish(last), "stop_reason": _stop_reason(last)}
                            for i, (text, last) in enumerate(finals)],
                "usage": _usage([last for _, last in finals])}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages, params = _accept(body, model_name, body.engine_messages,
                                   body.requested_max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = _generate(async_engine, metrics, request_id, sampling_params=params,
                           messages=messages, fill_context=body.requested_max_tokens is None)
        if body.stream:
            first = await _start_all([stream])
            return _sse(_chat_chunks(request_id, model_name, stream, first[0],
                                     _include_usage(body)))
        ((text, last),) = await _until_disconnect(request, _collect_all([stream]))
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": _finish(last),
                             "stop_reason": _stop_reason(last)}],
                "usage": _usage([last])}

    return app


# ----- requests into the engine --------------------------------------------------------------
async def _generate(async_engine: AsyncEngine, metrics: ServerMetrics, request_id: str,
                    **request) -> AsyncIterator[RequestOutput]:
    """The engine's DELTA outputs for one request, with API errors and metrics."""
    gen = async_engine.generate(request_id=request_id, **request)
    out = None
    refused = False
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
        yield out
        while not out.finished:
            out = await gen.__anext__()
            yield out
    except EngineDead as e:
        refused = refused or out is None
        raise APIError(503, str(e), "service_unavailable") from None
    finally:
        await gen.aclose()
        if not refused:   # ended, or aborted (also a client gone before the first token)
            metrics.observe(out)


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


async def _collect_all(streams) -> list[tuple[str, RequestOutput]]:
    """(full text, last output) of each stream, run concurrently."""
    async def collect(stream):
        text = []
        async for out in stream:
            text.append(out.outputs[0].text)
        return "".join(text), out

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


async def _completion_chunks(request_id, model_name, streams, firsts, include_usage):
    created = int(time.time())
    finals = {}
    async for i, out in _merge(streams, firsts):
        if out.finished:
            finals[i] = out
        c = out.outputs[0]
        if c.text or out.finished:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model_name,
                   "choices": [{"index": i, "text": c.text, "logprobs": None,
                                "finish_reason": _finish(out), "stop_reason": _stop_reason(out)}]}
    if include_usage:
        yield {"id": request_id, "object": "text_completion", "created": created,
               "model": model_name, "choices": [], "usage": _usage(list(finals.values()))}


async def _chat_chunks(request_id, model_name, stream, first, include_usage):
    created = int(time.time())

    def chunk(delta, out=None):
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": _finish(out) if out is not None else None}]}

    yield chunk({"role": "assistant", "content": ""})
    last = None
    async for _, out in _merge([stream], [first]):
        last = out
        text = out.outputs[0].text
        if text:
            yield chunk({"content": text})
        if out.finished:
            yield chunk({}, out)
    if include_usage and last is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
               "model": model_name, "choices": [], "usage": _usage([last])}


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(o.num_cached_tokens + len(o.prompt_token_ids) for o in finals)
    completion = sum(len(o.metrics.token_times) for o in finals)
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


def _stop_reason(out: RequestOutput):
    return out.outputs[0].stop_reason if out.finished else None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _accept(body, served: str, engine_input, max_tokens: int | None):
    """(engine input, SamplingParams) of a request body, or the APIError that refuses it: 404
    for another model, 400 for an unsupported field or a bad value."""
    if body.model is not None and body.model != served:
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                            f"`{served}`", "NotFoundError", param="model")
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"not supported by this server yet: {', '.join(unsupported)}")
    try:
        return engine_input(), body.sampling_params(max_tokens)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
