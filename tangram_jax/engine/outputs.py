"""What the engine hands back per request (the shape vLLM users know)."""

from __future__ import annotations

import dataclasses
import enum


class RequestOutputKind(enum.Enum):
    """What each output of a running request carries (vLLM's `RequestOutputKind`).

    CUMULATIVE: the whole text and token ids so far; DELTA: only what is new since the request's
    previous output; FINAL_ONLY: nothing until the request finishes, then everything. In every
    kind the text is only what can no longer be taken back (see `StopChecker.final_text`), so a
    stream of outputs never shrinks.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request (seconds, `time.perf_counter` clock).

    arrival_time: when it was added; first_token_time: when its first token was sampled;
    finished_time: when it ended; token_times: when each output token was sampled.
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclasses.dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's shape): `logprob` of the model's raw
    distribution (log_softmax of the logits), `rank` 1 = most likely, `decoded_token` its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated completion: text so far, its token ids, and why it ended (None: running).

    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or context),
    "abort", or "error" (see `RequestOutput.error`).
    stop_reason: the stop string or stop token id that ended it (None for EOS, length, abort).
    With `RequestOutputKind.DELTA`, text, token_ids and logprobs hold only what is new.
    logprobs: with `SamplingParams.logprobs` set, one dict per generated token: token id ->
      `Logprob`, holding the top `logprobs` tokens and the generated one (only the generated
      one when `logprobs` is -1); None otherwise.
    cumulative_logprob: sum of the generated tokens' log-probabilities (with logprobs set).
    full_logprobs: with `logprobs` -1, float32 [num_tokens, vocab]: the whole log-softmax at
      every generated position (set in the request's final output).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    full_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of `LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    session_id: str | None = None
    error: str | None = None
    # Prompt tokens already in the KV cache: the session history this request continues.
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token of this request (token id
    # -> Logprob: the prompt token and the top `prompt_logprobs` alternatives), None for the
    # first (nothing predicts it; in a session turn the history's last token predicts it
    # inside the previous turn's decode, which kept no distribution). DELTA outputs carry it
    # once, in the first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
