"""`AsyncEngine`: one `Engine` stepped by a background thread, many asyncio consumers.

    engine = AsyncEngine(Engine(EngineConfig()))
    async for out in engine.generate(prompt="Hello", sampling_params=SamplingParams()):
        print(out.outputs[0].text, end="")          # DELTA outputs: only the new text
    engine.shutdown()

The `Engine` is not thread-safe, so it is touched only by its own thread: callers send commands
(add, abort, run a function) through a queue that the thread drains before every step, and the
thread hands each output back to the caller's event loop with `call_soon_threadsafe`. When no
request is live the thread sleeps on the queue. This is the "one engine loop feeding many
connections" of the OpenAI server (`tangram_jax.server`), and works in any asyncio program.

Back-pressure: at most `max_live_requests` requests are admitted at once (running plus queued);
one more raises `EngineBusy` at once instead of queueing without bound. A consumer that stops
iterating (a client that disconnected, a cancelled task) aborts its request, which frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.engine.outputs import RequestOutput, RequestOutputKind
from tangram_jax.sampling import SamplingParams


class EngineBusy(RuntimeError):
    """The engine already holds `max_live_requests` requests; retry later."""


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can be served."""


class _Stream:
    """Where one request's outputs go: an asyncio queue of the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """An `Engine` owned by a background thread, with async generators over its requests."""

    def __init__(self, engine: Engine, max_live_requests: int | None = None):
        if max_live_requests is None:
            max_live_requests = 4 * engine.config.max_num_seqs
        if isinstance(max_live_requests, bool) or not isinstance(max_live_requests, int) \
                or max_live_requests < 1:
            raise ValueError(f"max_live_requests must be a positive int, got {max_live_requests!r}")
        self.engine = engine
        self.max_live_requests = max_live_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}    # engine thread only
        self._live = 0                             # admitted, not yet ended (under _lock)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tangram-engine", daemon=True)
        self._thread.start()

    # ----- caller side (any thread / event loop) -------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_live_requests(self) -> int:
        return self._live

    async def generate(self, prompt: str | None = None,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None,
                       messages: Sequence[dict] | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       fill_context: bool = False,
                       ) -> AsyncIterator[RequestOutput]:
        """Serve one request; yields its outputs until the finished one.

        Give one of `prompt`, `prompt_token_ids` or `messages`. A chat (`messages`) continues
        the idle session whose history its tokens extend (`Engine.find_session`: only the new
        turn is prefilled, `num_cached_tokens` says how many were not), else starts a session
        that a later turn can continue. Bad input raises here (ValueError / TypeError from
        `Engine.add_request`); `EngineBusy` when the engine is full. Leaving the loop early
        aborts the request. `fill_context`: max_tokens is whatever room `max_model_len` leaves
        after the prompt (session history included), as OpenAI's chat API does without
        max_tokens.
        """
        if not self.is_alive:
            raise EngineDead(f"the engine is not running ({self.error!r})" if self.error
                             else "the engine is not running")
        with self._lock:
            if self._live >= self.max_live_requests:
                raise EngineBusy(f"the engine holds {self._live} requests "
                                 f"(max_live_requests {self.max_live_requests}); retry later")
            self._live += 1
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        added = loop.create_future()
        self._commands.put(("add", request_id, stream, added, dict(
            prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            sampling_params=sampling_params, output_kind=output_kind,
            fill_context=fill_context)))
        try:
            await added
        except BaseException:
            # Cancelled while queued: the abort follows the add through the same queue, so it
            # finds the request; after a refused add it finds nothing and does nothing.
            self._commands.put(("abort", request_id))
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", fn, done, loop))
        return await done

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (live requests end with an `EngineDead` error)."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    # ----- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                # Sleep on the queue while idle; otherwise take what is there and step.
                block = not engine.has_unfinished_requests()
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    command = None
                while command is not None:
                    self._handle(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self._stop.is_set():
                    break
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._deliver(out)
        except BaseException as e:   # a failed step: every live request learns why
            self.error = e
        finally:
            self._stop.set()
            reason = EngineDead(f"the engine stopped ({self.error!r})" if self.error
                                else "the engine was shut down")
            for stream in self._streams.values():
                stream.put(reason)
            self._streams.clear()
            with self._lock:
                self._live = 0
            self._fail_pending(reason)

    def _fail_pending(self, reason: BaseException) -> None:
        """Answer commands that arrive after the loop ended."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, _, stream, added, _ = command
                stream.loop.call_soon_threadsafe(_set_exception, added, reason)
            elif command[0] == "call":
                _, _, done, loop = command
                loop.call_soon_threadsafe(_set_exception, done, reason)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, stream, added, request = command
            try:
                self._add(request_id, request)
            except Exception as e:   # bad input: this request only
                with self._lock:
                    self._live -= 1
                stream.loop.call_soon_threadsafe(_set_exception, added, e)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_set_result, added, request_id)
        elif kind == "abort":
            request_id = command[1]
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                with self._lock:
                    self._live -= 1
                try:
                    self.engine.abort(request_id)
                except KeyError:
                    pass   # finished in the same step the consumer left
        elif kind == "call":
            _, fn, done, loop = command
            try:
                result = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, done, e)
            else:
                loop.call_soon_threadsafe(_set_result, done, result)

    def _add(self, request_id: str, request: dict) -> None:
        engine = self.engine
        messages = request.pop("messages")
        total = None
        if messages is not None:
            ids = engine.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
            params = request["sampling_params"]
            if params is not None and params.n > 1:
                # Several completions branch from the history: none of them is the session.
                request.update(prompt_token_ids=ids)
            else:
                session_id, new_ids = engine.find_session(ids)
                if session_id is None:   # anonymous: forgotten when evicted (SessionTable)
                    session_id = engine.new_session_id()
                request.update(prompt_token_ids=new_ids, session_id=session_id)
            total = len(ids)
        if request.pop("fill_context"):
            if total is None:
                total = len(request["prompt_token_ids"]) if request["prompt"] is None \
                    else len(engine.tokenizer.encode(request["prompt"]))
            params = request["sampling_params"] or engine.default_sampling_params
            # Room left; add_request refuses a prompt that leaves none.
            request["sampling_params"] = dataclasses.replace(
                params, max_tokens=max(1, engine.max_model_len - total))
        engine.add_request(request_id, **request)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            with self._lock:
                self._live -= 1
        stream.put(out)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
