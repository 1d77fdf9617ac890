"""`LLM`: the offline API in the shape vLLM users know, over one `Engine`.

    from tangram_jax import LLM, SamplingParams
    llm = LLM(mode="tangram", ratio=0.5)               # embedded SmolLM2 + its shipped profile
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    conv = [{"role": "user", "content": "Hi!"}]
    reply = llm.chat([conv])[0]
    conv += [{"role": "assistant", "content": reply.outputs[0].text},
             {"role": "user", "content": "And then?"}]
    llm.chat([conv])                                     # prefills only the new turn

Multi-turn: `chat` finds the idle session whose token history is a prefix of the conversation's
tokens and continues it, so a conversation's compressed history stays in the pool between turns.
A conversation whose history differs (edited, or re-tokenised differently) starts a new session;
idle sessions are evicted least-recently-used when the pool runs short.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.inputs import check_messages
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.engine.outputs import RequestOutput
from tangram_jax.sampling import SamplingParams


class LLM:
    """An engine plus the batch loop. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | None = None, *, profile=None, mode: str = "tangram",
                 config: EngineConfig | None = None, **kwargs):
        if config is not None:
            if model is not None or profile is not None or mode != "tangram" or kwargs:
                raise TypeError("pass either config= or EngineConfig fields, not both")
        else:
            config = EngineConfig(model=model, profile=profile, mode=mode, **kwargs)
        self.engine = Engine(config)
        self._ids = itertools.count()
        self._chat_sessions: set[str] = set()   # sessions `chat` opened and has not ended

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt. Outputs in prompt order.

        prompts: one prompt or a list of them; a prompt is text (str), token ids (a list of ints
        or a 1-D integer array), or a dict with "prompt" or "prompt_token_ids" (vLLM's).
        Every prompt is checked before any is queued: an invalid one (empty, too long, wrong
        type) raises naming its index and nothing is left queued.
        """
        items = _prompt_list(prompts)
        params = self._params_for(len(items), sampling_params)
        requests = []
        for i, (item, p) in enumerate(zip(items, params)):
            if isinstance(item, dict):
                unknown = set(item) - {"prompt", "prompt_token_ids"}
                if unknown or len(item) != 1:
                    raise ValueError(f"prompts[{i}]: a prompt dict holds exactly one of 'prompt' "
                                     f"or 'prompt_token_ids', got keys {sorted(item)}")
                request = dict(item)
            elif isinstance(item, str):
                request = dict(prompt=item)
            else:
                request = dict(prompt_token_ids=item)
            requests.append(_checked(i, "prompts", lambda: self.engine.check_request(
                sampling_params=p, **request)))
        return self._run(requests, use_tqdm)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer the last user message of each conversation (a list of {"role", "content"}).

        Each conversation continues the engine session whose history it extends, if any (two
        copies of one conversation in a batch: the second starts its own session). Every
        conversation is checked before any is queued.
        """
        if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, Sequence):
            raise TypeError(f"conversations must be a conversation (a list of {{'role', "
                            f"'content'}} dicts) or a list of them, got "
                            f"{type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = self._params_for(len(conversations), sampling_params)
        requests, claimed = [], set()
        for i, (conv, p) in enumerate(zip(conversations, params)):
            def check(conv=conv, p=p):
                ids = self.engine.tokenizer.apply_chat_template(
                    check_messages(conv), add_generation_prompt=True)
                if p is not None and p.n > 1:   # several branches: none is the session
                    return self.engine.check_request(prompt_token_ids=ids, sampling_params=p)
                session_id, new_ids = self.engine.find_session(ids)
                if session_id is None or session_id in claimed:
                    session_id, new_ids = self._new_session_id(claimed), ids
                claimed.add(session_id)
                return self.engine.check_request(prompt_token_ids=new_ids, sampling_params=p,
                                                 session_id=session_id)
            requests.append(_checked(i, "conversations", check))
        self._chat_sessions.update(r.session_id for r in requests if r.session_id is not None)
        outputs = self._run(requests, use_tqdm)
        self._forget_evicted_sessions()
        return outputs

    def end_session(self, session_id: str) -> None:
        """Free a conversation's pages now (otherwise they stay until evicted)."""
        self.engine.end_session(session_id)
        self._chat_sessions.discard(session_id)

    def _forget_evicted_sessions(self) -> None:
        """End the sessions `chat` opened whose cache was evicted: continuing one re-prefills
        the whole history, as a new session would, so keeping its history only costs memory
        (a long-running chat loop would otherwise hold every conversation ever seen)."""
        for sid in list(self._chat_sessions):
            if not self.engine.has_session(sid):
                self._chat_sessions.discard(sid)
            elif not self.engine.session_is_cached(sid) and not self.engine.session_is_busy(sid):
                self.engine.end_session(sid)
                self._chat_sessions.discard(sid)

    def _new_session_id(self, claimed: set[str]) -> str:
        while True:
            sid = f"session-{next(self._ids)}"
            if sid not in claimed and not self.engine.has_session(sid):
                return sid

    @staticmethod
    def _params_for(n, sampling_params):
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Sequence):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        """Queue checked requests and step until all of them finished. If stepping is
        interrupted (Ctrl-C, an engine failure), the batch's requests are aborted so the
        engine stays usable, and the exception goes on."""
        order = [self.engine.enqueue(r) for r in requests]
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while len(results) < len(order) and self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id not in results:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in order:
                if rid not in results and self.engine.is_live(rid):
                    self.engine.abort(rid)
            raise
        return [results[rid] for rid in order]


def _checked(index: int, what: str, check):
    """Run one item's check; its error names the item's index."""
    try:
        return check()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}[{index}]: {e}") from None


def _is_token_id(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list of single prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts must be text, token ids or a list of them, got bytes (decode "
                        "them to str first)")
    if isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be text, token ids or a list of them, got "
                        f"{type(prompts).__name__}")
    if len(prompts) and _is_token_id(prompts[0]):
        return [prompts]   # one prompt of token ids (each id is checked by the engine)
    return list(prompts)
