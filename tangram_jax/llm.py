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
A conversation whose history differs (edited, or re-tokenised differently) starts a new session.
Sessions live in the engine's one session table (`Engine.sessions`): when the pool runs short it
evicts the idle sessions least likely to be continued soon per token of recompute, and forgets
the evicted ones `chat` opened (the next turn resends the conversation anyway).

Data parallelism (`data_parallel_size=N`): N engine replicas, one per device, each with the
weights, its own KV pool and its own session table. A batch's prompts go to the replica with the
fewest tokens assigned so far (prompt plus max_tokens); a conversation stays on the replica that
holds its session. Each replica steps in its own thread (JAX releases the GIL while a step runs),
and outputs come back in the caller's order. Request ids are the LLM's own (`request-K`), so a
seeded or derived sample does not depend on which replica served it.

Several hosts (JAX's distributed runtime up: `jax.distributed.initialize`, or the config's
`distributed_coordinator` / `num_processes` / `process_id`): every process runs the same script
(SPMD) with the same config and builds its `data_parallel_size` replicas on its own devices
(`jax.local_devices()`). The replicas of all processes form one list, global replica
`process * data_parallel_size + local index`; every process plans each batch the same way over
that list (the same token splitter), runs the requests of its own replicas, and the outputs are
gathered back (`engine.distributed.exchange`), so every process returns the whole batch in input
order. A conversation stays on the process and replica that holds its session: `chat` first
gathers every process's session look-ups. A failure on one process is raised on all of them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from tangram_jax.engine import distributed, memory
from tangram_jax.engine.config import EngineConfig, EngineConfigError
from tangram_jax.engine.inputs import check_messages
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.engine.outputs import RequestOutput
from tangram_jax.engine.tensor_parallel import devices_for
from tangram_jax.sampling import SamplingParams, is_int


class LLM:
    """An engine plus the batch loop. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | None = None, *, profile=None, mode: str = "tangram",
                 config: EngineConfig | None = None, **kwargs):
        if config is not None:
            if model is not None or profile is not None or mode != "tangram" or kwargs:
                raise TypeError("pass either config= or EngineConfig fields, not both")
        else:
            config = EngineConfig(model=model, profile=profile, mode=mode, **kwargs)
        self.engines = build_replicas(config)
        self.engine = self.engines[0]   # the first local replica (the only one by default)
        self._request_ids = itertools.count()   # ids of data-parallel requests (`request-K`)
        # Several processes: the global replica list (see the module docstring).
        self._processes = distributed.process_count()
        self._base = distributed.process_index() * len(self.engines)   # first local replica
        self._num_replicas = self._processes * len(self.engines)
        if self._processes > 1:
            sizes = distributed.exchange(len(self.engines))
            if len(set(sizes)) != 1:
                raise EngineConfigError(f"data_parallel_size must be the same on every process, "
                                        f"got {sizes} (process order)")

    def _local(self, replica: int) -> Engine | None:
        """The engine of global replica `replica` if this process holds it."""
        r = replica - self._base
        return self.engines[r] if 0 <= r < len(self.engines) else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` sample with when given no SamplingParams (vLLM's name): the
        model's generation config (`EngineConfig.generation_config`, see
        `models.generation_config`), else vLLM's defaults."""
        return self.engine.default_sampling_params

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt. Outputs in prompt order. No `sampling_params`: the model's
        generation defaults (`get_default_sampling_params`).

        prompts: one prompt or a list of them; a prompt is text (str), token ids (a list of ints
        or a 1-D integer array), or a dict with "prompt" or "prompt_token_ids" (vLLM's).
        Every prompt is checked before any is queued: an invalid one (empty, too long, wrong
        type) raises naming its index and nothing is left queued.
        """
        items = _prompt_list(prompts)
        params = self._params_for(len(items), sampling_params)
        return self._batch(lambda: self._plan_generate(items, params), use_tqdm)

    def _plan_generate(self, items: list, params: list) -> list:
        """(global replica, checked request) per prompt: each to the least-loaded replica."""
        requests, load = [], [0] * self._num_replicas
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
            replica = min(range(len(load)), key=load.__getitem__)
            # A replica of another process is checked by a local one (the same config).
            engine = self._local(replica) or self.engine
            checked = _checked(i, "prompts", lambda: engine.check_request(
                request_id=self._request_id(), sampling_params=p, **request))
            load[replica] += len(checked.prompt_token_ids) + checked.params.max_tokens
            requests.append((replica, checked))
        return requests

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer the last user message of each conversation (a list of {"role", "content"});
        no `sampling_params`: the model's generation defaults (`get_default_sampling_params`).

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
        ids = [_checked(i, "conversations", lambda conv=conv: self.engine.tokenizer.apply_chat_template(
            check_messages(conv), add_generation_prompt=True)) for i, conv in enumerate(conversations)]
        # Every replica's session that each conversation extends: (global replica, session id,
        # cached tokens), gathered from every process so all of them plan alike.
        found = []
        for conv_ids, p in zip(ids, params):
            here = []
            if p is None or p.n == 1:   # several branches: none is the session
                for r, e in enumerate(self.engines):
                    sid, new_ids = e.find_session(conv_ids)
                    if sid is not None:
                        here.append((self._base + r, sid, len(conv_ids) - len(new_ids)))
            found.append(here)
        if self._processes > 1:
            shares = distributed.exchange(found)
            found = [[f for share in shares for f in share[i]] for i in range(len(ids))]
        return self._batch(lambda: self._plan_chat(ids, params, found), use_tqdm)

    def _plan_chat(self, ids: list, params: list, found: list) -> list:
        """(global replica, checked request) per conversation: a session's next turn on the
        replica holding it, a new one (or n > 1 branches) on the least-loaded replica."""
        requests, claimed = [], set()   # claimed: (global replica, session id)
        load = [0] * self._num_replicas
        for i, (conv_ids, p, holders) in enumerate(zip(ids, params, found)):
            def check(conv_ids=conv_ids, p=p, holders=holders):
                if p is not None and p.n > 1:
                    replica = min(range(len(load)), key=load.__getitem__)
                    checked = (self._local(replica) or self.engine).check_request(
                        request_id=self._request_id(), prompt_token_ids=conv_ids,
                        sampling_params=p)
                    load[replica] += len(conv_ids) + checked.params.max_tokens * p.n
                    return replica, checked
                replica, session_id, cached = next(
                    (f for f in holders if (f[0], f[1]) not in claimed), (None, None, 0))
                new_ids = conv_ids[cached:]
                if session_id is None:   # a new session, on the least-loaded replica
                    replica = min(range(len(load)), key=load.__getitem__)
                    if self._local(replica) is not None:   # named by the process holding it
                        session_id = self._new_session_id(replica - self._base,
                                                          {sid for _, sid in claimed})
                claimed.add((replica, session_id))
                engine = self._local(replica)
                if engine is None:   # another process's: only its load and checks matter here
                    checked = self.engine.check_request(
                        request_id=self._request_id(), prompt_token_ids=new_ids,
                        sampling_params=p)
                else:
                    checked = engine.check_request(
                        request_id=self._request_id(), prompt_token_ids=new_ids,
                        sampling_params=p, session_id=session_id)
                load[replica] += len(new_ids) + checked.params.max_tokens
                return replica, checked
            requests.append(_checked(i, "conversations", check))
        return requests

    def end_session(self, session_id: str) -> None:
        """Free a conversation's pages now (otherwise they stay until evicted). Several
        processes: every process calls it; the one holding the session ends it."""
        holders = [e for e in self.engines if e.has_session(session_id)]
        held = [bool(holders)]
        if self._processes > 1:
            held = distributed.exchange(bool(holders))
        for engine in holders or ([] if any(held) else self.engines[:1]):   # none: its error
            engine.end_session(session_id)

    def _new_session_id(self, replica: int, claimed: set[str]) -> str:
        """A fresh session id from `replica`'s table that no other replica holds either."""
        exclude = set(claimed)
        # Processes name sessions apart (none sees the others' tables).
        prefix = f"session-p{self._base // len(self.engines)}-" if self._processes > 1 \
            else "session-"
        while True:
            sid = self.engines[replica].new_session_id(exclude=exclude, prefix=prefix)
            if not any(e.has_session(sid) for e in self.engines):
                return sid
            exclude.add(sid)

    def _request_id(self) -> str | None:
        """The id of the next request: the engine's own with one replica (as before), the
        LLM's `request-K` with several (unique across replicas; derived seeds follow it)."""
        if self._num_replicas == 1:
            return None
        while True:
            rid = f"request-{next(self._request_ids)}"
            if not any(e.is_live(rid) for e in self.engines):
                return rid

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

    def _batch(self, plan, use_tqdm: bool) -> list[RequestOutput]:
        """Run the batch `plan()` gives ((global replica, checked request) pairs): this
        process's share on its replicas, then every process's outputs gathered, in input order.
        A failure here (planning, a replica) is published to the other processes, which raise
        it, and raised here."""
        if self._processes == 1:
            return self._run(plan(), use_tqdm)
        try:
            requests = plan()
            mine = [i for i, (g, _) in enumerate(requests) if self._local(g) is not None]
            outs = self._run([(requests[i][0] - self._base, requests[i][1]) for i in mine],
                             use_tqdm)
        except BaseException as e:
            try:
                distributed.exchange(None, failed=f"{type(e).__name__}: {e}")
            except RuntimeError:
                pass   # the others' errors, if any: this process raises its own
            raise
        merged = {}
        for share in distributed.exchange(dict(zip(mine, outs))):
            merged.update(share)
        return [merged[i] for i in range(len(requests))]

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        """Queue checked (replica, request) pairs and step until all of them finished, each
        replica in its own thread when there are several. If stepping is interrupted (Ctrl-C,
        an engine failure), the batch's unfinished requests are aborted on every replica so
        the engines stay usable, and the exception goes on."""
        order = [(r, self.engines[r].enqueue(req)) for r, req in requests]
        results: dict[tuple[int, str], RequestOutput] = {}
        stop = threading.Event()
        lock = threading.Lock()
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:

            def serve(replica: int) -> None:
                engine = self.engines[replica]
                mine = {rid for r, rid in order if r == replica}
                done = 0
                while done < len(mine) and engine.has_unfinished_requests() and \
                        not stop.is_set():
                    for out in engine.step():
                        key = (replica, out.request_id)
                        if out.finished and out.request_id in mine and key not in results:
                            with lock:
                                results[key] = out
                                bar.update(1)
                            done += 1

            try:
                replicas = sorted({r for r, _ in order})
                if len(replicas) <= 1:
                    for r in replicas:
                        serve(r)
                else:
                    _run_threads(serve, replicas, stop)
            except BaseException:
                stop.set()
                for r, rid in order:
                    if (r, rid) not in results and self.engines[r].is_live(rid):
                        self.engines[r].abort(rid)
                raise
        return [results[key] for key in order]


def _run_threads(serve, replicas: list[int], stop: threading.Event) -> None:
    """`serve(r)` for every replica in its own thread; the first failure (or a Ctrl-C while
    waiting) stops the others and is raised once they have returned."""
    errors: list[BaseException] = []

    def target(r):
        try:
            serve(r)
        except BaseException as e:   # noqa: BLE001 - handed to the caller's thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=target, args=(r,), name=f"tangram-replica-{r}",
                                daemon=True) for r in replicas]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.1)
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]


def build_replicas(config: EngineConfig) -> list[Engine]:
    """The engines of `config` on this process's devices: one, or `data_parallel_size`
    replicas, each on its own run of `tensor_parallel_size` devices."""
    distributed.start(config)   # several hosts: before anything starts JAX's backend
    n = config.data_parallel_size
    if n == 1:
        return [Engine(config)]
    config.check()
    memory.configure_allocator(config.gpu_memory_utilization)   # before JAX's backend starts
    try:
        runs = [devices_for(config.tensor_parallel_size, r) for r in range(n)]
    except ValueError as e:
        raise EngineConfigError(f"data_parallel_size {n}: {e}") from None
    return [Engine(config, devices=run) for run in runs]


def _checked(index: int, what: str, check):
    """Run one item's check; its error names the item's index."""
    try:
        return check()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}[{index}]: {e}") from None


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
    if len(prompts) and is_int(prompts[0]):
        return [prompts]   # one prompt of token ids (each id is checked by the engine)
    return list(prompts)
