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

from tqdm.auto import tqdm

from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.engine.outputs import RequestOutput
from tangram_jax.sampling import SamplingParams


class LLM:
    """An engine plus the batch loop. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | None = None, *, profile=None, mode: str = "tangram", **kwargs):
        self.engine = Engine(EngineConfig(model=model, profile=profile, mode=mode, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids). Outputs in prompt order.

        A prompt that is invalid (empty, too long) raises before anything is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_for(len(prompts), sampling_params)
        requests = [dict(prompt=p) if isinstance(p, str) else dict(prompt_token_ids=list(p))
                    for p in prompts]
        return self._run(requests, params, use_tqdm)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer the last user message of each conversation (a list of {"role", "content"}).

        Each conversation continues the engine session whose history it extends, if any.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = self._params_for(len(conversations), sampling_params)
        requests = []
        for conv in conversations:
            ids = self.engine.tokenizer.apply_chat_template(list(conv), add_generation_prompt=True)
            session_id, new_ids = self.engine.find_session(ids)
            if session_id is None:
                session_id = f"session-{next(self._ids)}"
            requests.append(dict(prompt_token_ids=new_ids, session_id=session_id))
        return self._run(requests, params, use_tqdm)

    def end_session(self, session_id: str) -> None:
        """Free a conversation's pages now (otherwise they stay until evicted)."""
        self.engine.end_session(session_id)

    def _params_for(self, n, sampling_params):
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def _run(self, requests: list[dict], params: list[SamplingParams], use_tqdm: bool):
        order = []
        for req, p in zip(requests, params):
            order.append(self.engine.add_request(request_id=f"req-{next(self._ids)}",
                                                 sampling_params=p, **req))
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id not in results:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in order]
