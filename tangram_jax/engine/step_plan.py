"""The step plan: everything the device does in one engine step, as data.

`Engine.step` turns the scheduler's output and the KV-cache manager's device feed into a
`StepPlan` (numpy arrays and ints, nothing of requests or of the manager), the runner executes it
(`ModelRunner.execute(plan) -> StepResult`), and the engine reads the tokens back. As in vLLM v1
(`execute_model(scheduler_output)`) and nano-vllm (`step`: schedule, run, postprocess), the
runner is the only owner of device work: it splits prefill rows into calls, chooses split maps
and compiled shapes, and holds the pool; the engine never touches device arrays but the tokens.

One plan, in the order the runner runs it:
0. `host_transfers`: the host tier's moves (`engine/host_offload.py`): pages of sessions swapped
   out copied to host memory before anything of the step may reuse them, host copies of
   sessions swapped back in copied into their fresh pages before their prefill reads them.
1. `table_updates`: the manager's block-table writes since the last step.
2. `prefill`: rows of prompt (or replayed) tokens, each a `PrefillRow`; rows of one request run
   in order, rows of different requests side by side (`prefill_calls.run_prefill_rows`).
3. `decode`: one token for each running sequence (`DecodeRows`), with the last prefill call
   (one program where the runner mixes steps).
4. `first_tokens`: the first sampled token of each sequence whose prompt ended in this step,
   from the last logits of its prefill row (`FirstTokenRows`).
Page copies of forked sequences (parallel samples) are made by the scheduler's commit, after the
plan ran: the engine hands them to `ModelRunner.copy_pages`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tangram_jax.sampling import LogitsAdjust
from tangram_jax.scheduler.host_pool import HostTransfer


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    """One scheduler `PrefillChunk` as data: tokens [start, end) of a request's sequence.

    token_ids: int32 [end - start]; slot: its block-table row; segment: (start, end,
    compressed) of the turn (or decode-written span) the tokens belong to; is_last: the row ends
    the prompt (its last logits sample the first token); retained: int64 [layers, groups] the
    tokens the sequence holds before the row (`KVCacheManager.retained_lengths`);
    prompt_targets: int32 [end - start], the prompt token each position predicts (-1 past the
    prompt), when the request asked for prompt log-probabilities, else None."""

    request_id: str
    slot: int
    token_ids: np.ndarray
    start: int
    end: int
    segment: tuple[int, int, bool]
    is_last: bool
    retained: np.ndarray
    prompt_targets: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class PenaltyRow:
    """A slot's penalty row to write before the step samples (`sampling.SlotState`): row int32
    [vocab] (`sampling.penalty_row` of the request's host ids), plus `pending` (0 or 1) counts
    of the slot's last sampled token, which the host has not fetched yet."""

    slot: int
    row: np.ndarray
    pending: int


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling arrays of `rows` rows (`tangram_jax.sampling`): temperature float32,
    top_k int32, top_p float32, seeds uint32, steps int32 (tokens the row's completion has);
    forced_tokens int32 (-1: sample) or None (nobody forced); logprobs one of
    `decode_step.LOGPROB_MODES`; adjust the rows' penalties / min_tokens / min_p or None;
    penalty_rows the `PenaltyRow`s to write first."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    forced_tokens: np.ndarray | None = None
    logprobs: str | None = None
    adjust: LogitsAdjust | None = None
    penalty_rows: tuple[PenaltyRow, ...] = ()

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(temperature, top_k, top_p, seeds, steps): the positional sampling arguments."""
        return self.temperature, self.top_k, self.top_p, self.seeds, self.steps

    def options(self) -> dict:
        """forced_tokens, logprobs and adjust as keyword arguments."""
        return dict(forced_tokens=self.forced_tokens, logprobs=self.logprobs,
                    adjust=self.adjust)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """One decode token for each of a padded bucket of sequences (the bucket is `len(slots)`).

    positions: int32 [B] position of each row's input token; slots: int32 [B] block-table rows
    (padding: the manager's null slot); lengths: int32 [B, layers, groups] retained tokens
    before the step (pages for the new token reserved); sampling: [B] rows."""

    positions: np.ndarray
    slots: np.ndarray
    lengths: np.ndarray
    sampling: SamplingRows

    def arguments(self) -> dict:
        """`ModelRunner.decode`'s keyword arguments."""
        s = self.sampling
        return dict(positions=self.positions, slots=self.slots, lengths=self.lengths,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seeds=s.seeds,
                    steps=s.steps, **s.options())


@dataclasses.dataclass(frozen=True)
class FirstTokenRows:
    """First tokens sampled from prefill logits: row i samples from the last logits of
    ``plan.prefill[sources[i]]`` (a row that `is_last`; parallel samples repeat their parent's
    row) into block-table row ``slots[i]``."""

    sources: tuple[int, ...]
    slots: tuple[int, ...]
    sampling: SamplingRows


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step's device work (see the module docstring). max_prefill_rows: prefill rows
    a runner call may batch (`EngineConfig.max_prefill_rows`)."""

    table_updates: tuple[np.ndarray, np.ndarray]
    prefill: tuple[PrefillRow, ...] = ()
    host_transfers: tuple[HostTransfer, ...] = ()
    decode: DecodeRows | None = None
    first_tokens: FirstTokenRows | None = None
    max_prefill_rows: int = 1


@dataclasses.dataclass
class StepResult:
    """What an executed plan gives back. Tokens are device arrays (the host waits only when it
    reads them, a step late under asynchronous scheduling): decode_tokens [B] with their
    `TokenLogprobs` when the rows asked (else None), first_tokens [>= len(sources)] likewise.
    retained: {request id: int64 [layers, groups] retained tokens after its rows} (dynamic
    selection: counts come back from the device; None otherwise). prompt_logprobs: {request id:
    {position: TokenLogprobs}} of rows with prompt_targets."""

    decode_tokens: object = None
    decode_logprobs: object = None
    first_tokens: object = None
    first_logprobs: object = None
    retained: dict[str, np.ndarray] | None = None
    prompt_logprobs: dict[str, dict] = dataclasses.field(default_factory=dict)


def prompt_targets(token_ids, prompt_end: int, start: int, end: int) -> np.ndarray:
    """int32 [end - start]: the prompt token each of positions start..end-1 predicts (-1 past
    the prompt, which ends at `prompt_end`: those are generated tokens, not prompt)."""
    targets = np.full(end - start, -1, np.int32)
    last = min(end + 1, prompt_end)
    if last > start + 1:
        targets[:last - start - 1] = token_ids[start + 1:last]
    return targets


def prefill_rows(pieces, manager, with_prompt_logprobs=frozenset()) -> tuple[PrefillRow, ...]:
    """The scheduler's `PrefillChunk`s of a step as `PrefillRow`s; `manager` gives each
    sequence's retained lengths, `with_prompt_logprobs` the request ids whose rows carry
    prompt targets."""
    rows = []
    for p in pieces:
        seq = p.seq
        targets = (prompt_targets(seq.token_ids, seq.prompt_start + seq.num_prompt_tokens,
                                  p.start, p.end)
                   if seq.request_id in with_prompt_logprobs else None)
        rows.append(PrefillRow(
            request_id=seq.request_id, slot=seq.slot,
            token_ids=np.asarray(seq.token_ids[p.start:p.end], np.int32), start=p.start,
            end=p.end, segment=tuple(p.segment), is_last=p.is_last,
            retained=manager.retained_lengths(seq.slot), prompt_targets=targets))
    return tuple(rows)
