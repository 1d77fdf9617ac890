"""Request intake of the `Engine`: a request checked, turned into token ids and queued.

`RequestIntake` is the part of `Engine` that takes requests in: `check_request` validates one
against the model and the engine's state (TypeError / ValueError naming the argument, before
anything is queued), `enqueue` hands it to the scheduler and tracks it as a
`requests.LiveRequest` (its seed, stop checks, metrics), and a request of n > 1 completions is
queued as n child requests sharing the prompt's prefill (`_enqueue_parent`). `add_request` is
both in one call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence as SequenceABC

from tangram_jax.engine import inputs
from tangram_jax.engine.outputs import RequestMetrics, RequestOutputKind
from tangram_jax.engine.requests import LiveRequest, ParentRequest, PreparedRequest
from tangram_jax.sampling import SamplingParams, StopChecker, resolve_seed
from tangram_jax.scheduler.sequence import Sequence


class RequestIntake:
    """How `Engine` takes requests in (a mixin: it reads the engine's model config, tokenizer,
    sessions and scheduler, and fills its tables of live requests)."""

    def add_request(self, request_id: str | None = None, prompt: str | None = None, *,
                    prompt_token_ids: SequenceABC[int] | None = None,
                    messages: SequenceABC[dict] | None = None,
                    sampling_params: SamplingParams | None = None,
                    session_id: str | None = None,
                    forced_token_ids: SequenceABC[int] | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> str:
        """Queue a request; returns its id (given, or a fresh one no live request uses). Give
        exactly one of `prompt` (text), `prompt_token_ids` or `messages` (chat, templated here).
        With `session_id`, the request is the next turn of that session: its tokens are
        appended to the session's history.

        forced_token_ids: an evaluation hook (teacher forcing): the request's output tokens ARE
        these (generation stops after the last one; EOS, stop strings and `max_tokens` do not
        end it earlier), while `SamplingParams.logprobs` reports the model's own distribution
        at each position. The forcing happens on the device, in the sampler.

        output_kind: what `step` reports for it (see `RequestOutputKind`).

        sampling_params None: `default_sampling_params`, the model's generation config
        (`EngineConfig.generation_config`), else vLLM's defaults.

        Raises TypeError / ValueError naming the argument before anything is queued."""
        return self.enqueue(self.check_request(
            request_id, prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            sampling_params=sampling_params, session_id=session_id,
            forced_token_ids=forced_token_ids), output_kind=output_kind)

    def check_request(self, request_id: str | None = None, prompt: str | None = None, *,
                      prompt_token_ids: SequenceABC[int] | None = None,
                      messages: SequenceABC[dict] | None = None,
                      sampling_params: SamplingParams | None = None,
                      session_id: str | None = None,
                      forced_token_ids: SequenceABC[int] | None = None) -> PreparedRequest:
        """Validate a request against the model and the engine's state without queuing it
        (`enqueue` queues it); a batch checks every item first, so nothing is half-queued."""
        if request_id is not None:
            inputs.check_id("request_id", request_id)
        if session_id is not None:
            inputs.check_id("session_id", session_id)
        vocab = self.model_config.vocab_size
        sampling_params = inputs.check_sampling_params(sampling_params, vocab,
                                                       self.default_sampling_params)
        if request_id is not None and request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already live")
        if sampling_params.n > 1 and (session_id is not None or forced_token_ids is not None):
            raise ValueError(f"sampling_params.n={sampling_params.n}: a request of several "
                             f"completions cannot continue a session or force its tokens "
                             f"(session_id / forced_token_ids must be None)")
        given = [name for name, x in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if x is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, prompt_token_ids or messages, got "
                             f"{', '.join(given) or 'none'}")
        where = f"request {request_id!r}: " if request_id is not None else ""
        try:
            if prompt is not None:
                ids = self.tokenizer.encode(inputs.check_prompt(prompt))
                if not ids:
                    raise ValueError("prompt encodes to no tokens")
            elif messages is not None:
                ids = self.tokenizer.apply_chat_template(inputs.check_messages(messages),
                                                         add_generation_prompt=True)
            else:
                ids = inputs.check_token_ids("prompt_token_ids", prompt_token_ids, vocab)
            forced = (None if forced_token_ids is None else
                      inputs.check_token_ids("forced_token_ids", forced_token_ids, vocab))
        except (TypeError, ValueError) as e:
            raise type(e)(where + str(e)) from None
        seq = self.sessions.get(session_id)
        history = seq.num_tokens if seq is not None else 0
        total = history + len(ids)
        if total >= self.max_model_len:
            raise ValueError(f"{where}prompt of {total} tokens (session history included) leaves "
                             f"no room to generate within max_model_len {self.max_model_len}")
        if forced is not None and total + len(forced) - 1 >= self.max_model_len:
            raise ValueError(f"{where}prompt of {total} tokens plus {len(forced)} forced tokens "
                             f"exceeds max_model_len {self.max_model_len}")
        self.scheduler.check_request(request_id or self._fresh_id(), len(ids), session_id,
                                     forks=self._family_size(sampling_params.n) - 1)
        return PreparedRequest(request_id, prompt, ids, sampling_params, session_id, forced)

    def enqueue(self, prepared: PreparedRequest,
                output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> str:
        """Queue a request `check_request` accepted; returns its id. `output_kind`: what `step`
        reports for it (see `RequestOutputKind`)."""
        if not isinstance(output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        request_id = prepared.request_id
        if request_id is None:
            request_id = self._fresh_id()
            self._next_id += 1
        if prepared.params.n > 1:
            return self._enqueue_parent(request_id, prepared, output_kind)
        session_id, ids, params = prepared.session_id, prepared.prompt_token_ids, prepared.params
        # Tokens of the session this request continues (cached unless it was evicted).
        session = self.sessions.get(session_id)
        history = session.num_tokens if session is not None else 0
        now = time.perf_counter()
        seq = self.scheduler.add_request(request_id, ids, params, session_id=session_id,
                                         arrival_time=now)
        self._track(request_id, seq, prepared, params, output_kind, now, history)
        return request_id

    def _track(self, request_id: str, seq: Sequence, prepared: PreparedRequest,
               params: SamplingParams, output_kind: RequestOutputKind, now: float,
               history: int = 0) -> None:
        """The engine's `LiveRequest` for a sequence the scheduler queued."""
        stop_params = params
        if prepared.forced_token_ids is not None:   # the forced tokens decide where it ends
            stop_params = dataclasses.replace(params, max_tokens=len(prepared.forced_token_ids),
                                              ignore_eos=True, stop=None, stop_token_ids=(),
                                              min_tokens=0)
        ids = prepared.prompt_token_ids
        self._requests[request_id] = LiveRequest(
            seq=seq, params=params, seed=self._request_seed(request_id, params),
            stop=StopChecker(self.tokenizer.decode, stop_params, self.tokenizer.eos_token_ids, ids),
            prompt=prepared.prompt, prompt_token_ids=ids, metrics=RequestMetrics(arrival_time=now),
            forced=prepared.forced_token_ids, output_kind=output_kind,
            num_cached_tokens=history)

    def _enqueue_parent(self, request_id: str, prepared: PreparedRequest,
                        output_kind: RequestOutputKind) -> str:
        """Queue the n completions of `prepared` as child requests ``"{i}_{request_id}"``
        (vLLM's naming); child i's seed is ``seed + i`` when the request has one.

        The children share the prompt's pages (the scheduler's parallel samples): the first
        prefills the prompt once, the others fork its KV when its prefill ends (`_dispatch`
        samples every child's first token from the prompt's last logits). A family is admitted
        whole, a sequence slot each, so more than `max_num_seqs` children are served as
        several families of at most that many (each prefills the prompt once)."""
        params = prepared.params
        child_ids = [f"{i}_{request_id}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self._requests or c in self._parents]
        if taken:
            raise ValueError(f"request id {request_id!r}: its completions' ids {taken[:3]} "
                             f"are already live")
        parent = ParentRequest(request_id, child_ids, output_kind)
        child_params = [dataclasses.replace(params, n=1, seed=None if params.seed is None
                                            else params.seed + i) for i in range(params.n)]
        now = time.perf_counter()
        size = self._family_size(params.n)
        for first in range(0, params.n, size):
            family = child_ids[first:first + size]
            self.scheduler.add_request(family[0], prepared.prompt_token_ids,
                                       child_params[first], arrival_time=now,
                                       fork_ids=family[1:])
        for i, (child_id, child) in enumerate(zip(child_ids, child_params)):
            self._track(child_id, self.scheduler.get(child_id),
                        prepared._replace(request_id=child_id, params=child), child,
                        output_kind, now)
            self._child_of[child_id] = (parent, i)
        self._parents[request_id] = parent
        return request_id

    def _family_size(self, n: int) -> int:
        """Completions of one request that share a prefill (see `_enqueue_parent`)."""
        return min(n, self.config.max_num_seqs)

    def _request_seed(self, request_id: str, params: SamplingParams) -> int:
        """The request's own seed, else one derived from `EngineConfig.seed` and the request id
        (vLLM's engine `seed`: the same request sampled again, in this engine or another with the
        same seed, draws the same tokens whatever else is batched with it)."""
        if params.seed is not None:
            return resolve_seed(params)
        digest = hashlib.sha256(f"{int(self.config.seed)}:{request_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def _fresh_id(self) -> str:
        """An id no live request has (a caller may have chosen "request-N" itself)."""
        while f"request-{self._next_id}" in self._requests or \
                f"request-{self._next_id}" in self._parents:
            self._next_id += 1
        return f"request-{self._next_id}"
