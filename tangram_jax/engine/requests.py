"""The engine's record of each live request, and what it reports.

`LiveRequest` is the engine side of a request (the scheduler holds its `Sequence`): sampling
parameters, seed, stop checker, metrics, log-probabilities, and the output it reports
(`output`, in vLLM's `RequestOutputKind`s). `ParentRequest` reports the n completions of a
request of ``SamplingParams.n > 1`` under one id. `sampling_rows` turns the requests of a step's
rows into the plan's sampling arrays (`step_plan.SamplingRows`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from tangram_jax.engine.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput,
                                        RequestOutputKind)
from tangram_jax.engine.step_plan import PenaltyRow, SamplingRows
from tangram_jax.sampling import (LogitsAdjust, SamplingParams, StopChecker, TokenLogprobs,
                                  logits_adjust_arrays, penalty_row)
from tangram_jax.scheduler.sequence import Sequence


# Token value of a sampled token the host has not fetched yet (token ids are never negative).
PLACEHOLDER = -1


@dataclasses.dataclass
class LiveRequest:
    """Engine-side state of one live request (the scheduler holds its `Sequence`)."""

    seq: Sequence
    params: SamplingParams
    seed: int
    stop: StopChecker
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0   # session history this request continues
    sent_chars: int = 0    # text already handed out (DELTA)
    sent_tokens: int = 0   # token ids (and logprobs) already handed out (DELTA)
    forced: list[int] | None = None     # teacher forcing: the output tokens (`add_request`)
    # With params.logprobs set: one dict per accepted token, their sum, and (logprobs -1) the
    # whole log-softmax row of every accepted token.
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    full_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    # With params.prompt_logprobs: position -> the prompt token's entry
    # (`StepResult.prompt_logprobs`),
    # and whether a DELTA output carried them already.
    prompt_lp: dict[int, TokenLogprobs] = dataclasses.field(default_factory=dict)
    prompt_lp_entries: list | None = None   # decoded, once the prompt is prefilled
    prompt_lp_sent: bool = False
    # Set when something failed for this request alone while a step was dispatched; the
    # request ends with finish_reason "error" when that step's tokens are resolved.
    error: str | None = None
    # (slot, admission) whose penalty row on the device was written for this request
    # (`sampling_rows`): within one admission only this request samples in its slot.
    penalty_row_of: tuple[int, int] | None = None

    def forced_token(self) -> int:
        """The token the next generated position must take (-1: sample it)."""
        step = self.seq.num_output_tokens
        return self.forced[step] if self.forced is not None and step < len(self.forced) else -1

    def output(self, finish_reason: str | None, token_text: Callable[[int], str],
               vocab_size: int) -> RequestOutput | None:
        """The request's output after this step: only text that can no longer be taken back
        (`StopChecker.final_text`), in the request's `output_kind`; None for a running
        FINAL_ONLY request."""
        finished = finish_reason is not None
        if finished:
            self.metrics.finished_time = time.perf_counter()
        elif self.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        # Once finished nothing can be taken back: a tail held back for a stop string that never
        # came (the engine ended it: context length, abort) is final too.
        text = self.stop.text if finished else self.stop.final_text
        token_ids, logprobs = self.stop.token_ids, self.logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            text, token_ids = text[self.sent_chars:], token_ids[self.sent_tokens:]
            logprobs = logprobs[self.sent_tokens:]
            self.sent_chars += len(text)
            self.sent_tokens += len(token_ids)
        completion = CompletionOutput(0, text, list(token_ids), finish_reason,
                                      self.stop.stop_reason if finished else None)
        if self.params.logprobs is not None:
            completion.logprobs = list(logprobs)
            completion.cumulative_logprob = self.cumulative_logprob
            # Stacked once, at the end ([tokens, vocab] per step would copy quadratically).
            if self.params.logprobs == -1 and finished:
                completion.full_logprobs = (
                    np.stack(self.full_logprobs).astype(np.float32) if self.full_logprobs
                    else np.zeros((0, vocab_size), np.float32))
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not self.prompt_lp_sent:
            prompt_logprobs = self.prompt_logprob_entries(token_text)
            self.prompt_lp_sent = self.output_kind is RequestOutputKind.DELTA
        return RequestOutput(
            request_id=self.seq.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, outputs=[completion], finished=finished,
            metrics=self.metrics, session_id=self.seq.session_id,
            num_cached_tokens=self.num_cached_tokens, prompt_logprobs=prompt_logprobs)

    def prompt_logprob_entries(self, token_text: Callable[[int], str]
                               ) -> list[dict[int, Logprob] | None]:
        """`RequestOutput.prompt_logprobs` of the request's prompt tokens (decoded once)."""
        if self.prompt_lp_entries is not None:
            return self.prompt_lp_entries
        start = self.seq.prompt_start
        want, entries = self.params.prompt_logprobs, []
        for position, token in enumerate(self.prompt_token_ids, start):
            lp = self.prompt_lp.get(position)
            if lp is None:
                entries.append(None)
                continue
            entry = {}
            for rank, (i, v) in enumerate(zip(lp.top_ids[:want].tolist(),
                                              lp.top_logprobs[:want].tolist()), 1):
                entry[i] = Logprob(v, rank, token_text(i))
            entry[token] = Logprob(float(lp.token_logprob), int(lp.token_rank),
                                   token_text(token))
            entries.append(entry)
        # Outputs come only after the prompt is prefilled: the list is complete.
        self.prompt_lp_entries, self.prompt_lp = entries, {}
        return entries

    def record_logprobs(self, t: InFlightToken, token: int,
                        host: dict[tuple[int, str], np.ndarray],
                        token_text: Callable[[int], str]) -> None:
        """Append the accepted token's log-probs (fetching only the arrays it asked for)."""
        def fetch(name):
            key = (id(t.logprobs), name)
            if key not in host:
                host[key] = np.asarray(getattr(t.logprobs, name))
            return host[key][t.row]
        want = self.params.logprobs
        entry: dict[int, Logprob] = {}
        if want > 0:
            ids, values = fetch("top_ids"), fetch("top_logprobs")
            for rank, (i, v) in enumerate(zip(ids[:want].tolist(), values[:want].tolist()), 1):
                entry[i] = Logprob(v, rank, token_text(i))
        chosen = float(fetch("token_logprob"))
        entry[token] = Logprob(chosen, int(fetch("token_rank")), token_text(token))
        self.logprobs.append(entry)
        self.cumulative_logprob += chosen
        if want == -1:
            self.full_logprobs.append(fetch("full"))

    def drop_placeholders(self) -> None:
        """Forget the tokens of steps dispatched after the request ended."""
        seq = self.seq
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()


@dataclasses.dataclass
class ParentRequest:
    """A request of ``SamplingParams.n > 1`` (vLLM's parent request): one child request per
    completion, reported under the parent's id with the child's index.

    What each output holds, by kind: CUMULATIVE every completion's latest state (those not
    started: empty); DELTA only what the child that moved produced; FINAL_ONLY everything, once
    every child has finished. The output is `finished` when the last child is.
    """

    request_id: str
    child_ids: list[str]
    output_kind: RequestOutputKind
    latest: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    finished: set[int] = dataclasses.field(default_factory=set)
    error: str | None = None

    def report(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """The parent's output after child `index` reported `out` (None: nothing to say yet)."""
        completion = out.outputs[0]
        completion.index = index
        self.latest[index] = completion
        if out.finished:
            self.finished.add(index)
        self.error = self.error or out.error
        done = len(self.finished) == len(self.child_ids)
        if self.output_kind is RequestOutputKind.DELTA:
            completions = [completion]
        elif self.output_kind is RequestOutputKind.FINAL_ONLY and not done:
            return None
        else:
            completions = [self.latest.get(i) or CompletionOutput(i, "", [])
                           for i in range(len(self.child_ids))]
        return dataclasses.replace(out, request_id=self.request_id, outputs=completions,
                                   finished=done, error=self.error)


class PreparedRequest(NamedTuple):
    """A request `Engine.check_request` validated, ready for `Engine.enqueue`."""

    request_id: str | None       # None: the engine assigns one when it is queued
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None
    forced_token_ids: list[int] | None = None   # teacher forcing (`add_request`)


class InFlightToken(NamedTuple):
    """A token sampled by a dispatched step: row `row` of device array `tokens`, which goes to
    ``request.seq.token_ids[index]`` (a placeholder until then); `logprobs` the step's
    log-probabilities when a request of it asked for them."""

    request: LiveRequest
    tokens: jax.Array
    row: int
    index: int
    logprobs: TokenLogprobs | None = None


class RequestFailed(Exception):
    """A failure recorded for one request while its step was dispatched (`LiveRequest.error`)."""


def sampling_rows(reqs: list[LiveRequest], rows: int, steps: np.ndarray,
                  vocab_size: int) -> SamplingRows:
    """The sampling rows of `reqs`, padded to `rows` (padding rows greedy): temperature, top-k/p
    and seeds (a request whose row cannot be built samples greedily and is marked failed: it
    ends at resolution), `steps`, forced tokens, the log-prob mode, the logits adjustments and
    the penalty rows to write first (a request that adjusts its logits, the first time it
    samples in its slot since its admission)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.full(rows, -1, np.int32)
    top_p = np.ones(rows, np.float32)
    seeds = np.zeros(rows, np.uint32)
    for i, r in enumerate(reqs):
        try:
            temperature[i], top_k[i], top_p[i], seeds[i] = (r.params.temperature, r.params.top_k,
                                                            r.params.top_p, r.seed)
        except Exception as e:   # noqa: BLE001 - isolate any failure to its own request
            temperature[i], top_k[i], top_p[i], seeds[i] = 0.0, -1, 1.0, 0
            r.error = f"sampling parameters could not be used ({type(e).__name__}: {e})"
    return SamplingRows(temperature, top_k, top_p, seeds, steps,
                        forced_tokens=_forced_tokens(reqs, rows),
                        logprobs=_logprob_mode(reqs), adjust=_logits_adjust(reqs, rows),
                        penalty_rows=_penalty_rows(reqs, vocab_size))


def _logprob_mode(reqs: list[LiveRequest]) -> str | None:
    """What the step must compute besides tokens for these requests (`LOGPROB_MODES`)."""
    asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    return None if not asked else "full" if -1 in asked else "top"

def _logits_adjust(reqs: list[LiveRequest], rows: int) -> LogitsAdjust | None:
    """The rows' penalties, min_tokens and min_p (None when no request uses them)."""
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    return logits_adjust_arrays([r.params for r in reqs],
                                [r.seq.num_output_tokens for r in reqs], rows)


def _penalty_rows(reqs: list[LiveRequest], vocab_size: int) -> tuple[PenaltyRow, ...]:
    """The penalty rows to write before these requests sample: one for each request whose
    penalties or min_tokens read a row (min_p alone reads none) and has none in its slot since
    its admission (a new request, a session's
    next turn, a readmission after preemption, a fork's child). Every later token is counted on
    the device. Its prompt is the whole history (what a stateless client would send); a
    completion's last token may still be on the device (a placeholder): `pending`."""
    out = []
    for r in reqs:
        key = (r.seq.slot, r.seq.admission_order)
        counted = r.params.counts_tokens
        if not (counted or r.params.min_tokens > 0) or r.penalty_row_of == key:
            continue
        r.penalty_row_of = key
        ids, end = r.seq.token_ids, r.seq.prompt_start + r.seq.num_prompt_tokens
        output = ids[end:]
        pending = sum(t == PLACEHOLDER for t in output)
        if pending > 1 or (pending and output[-1] != PLACEHOLDER):
            raise AssertionError(f"{r.seq.request_id}: only the last token can be in flight")
        prompt = ids[:end] if r.params.repetition_penalty != 1 else ()
        out.append(PenaltyRow(r.seq.slot, penalty_row(
            vocab_size, prompt, [t for t in output if t != PLACEHOLDER] if counted else (),
            sorted(r.stop.stop_token_ids)), pending))
    return tuple(out)

def _forced_tokens(reqs: list[LiveRequest], rows: int) -> np.ndarray | None:
    """int32 [rows]: each request's forced next token, -1 to sample (None: nobody forced)."""
    if all(r.forced is None for r in reqs):
        return None
    forced = np.full(rows, -1, np.int32)
    forced[:len(reqs)] = [r.forced_token() for r in reqs]
    return forced
