"""What one scheduler step hands the engine: the prefill pieces and the decode batch
(`Scheduler.schedule` returns a `SchedulerOutput`; `Scheduler.commit` takes it back)."""

from __future__ import annotations

import dataclasses

import numpy as np

from tangram_jax.scheduler.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Run ``seq.token_ids[start:end]`` through prefill, writing into ``seq.slot``'s pages.

    The kept tokens of every (layer, group) go to positions ``manager.retained_lengths(slot)``
    (before `commit`) onwards; `is_last` means the logits of the final token give the first
    sampled token.
    """
    seq: Sequence
    start: int
    end: int
    is_last: bool
    # The planned segment the piece lies in (`Sequence.segments`): (start, end, compressed).
    segment: tuple[int, int, bool] = (0, 0, True)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work (what runs; where it reads and writes comes from the manager).

    decode_slots: int32 [bucket] slots of `decode_seqs`, padded with the manager's null slot.
    preempted / capped: sequences preempted by recompute / ended for lack of KV capacity.
    """
    step: int
    prefill_chunks: list[PrefillChunk]
    decode_seqs: list[Sequence]
    decode_slots: np.ndarray
    preempted: list[Sequence]
    capped: list[Sequence]

    @property
    def decode_bucket(self) -> int:
        return int(self.decode_slots.size)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill_chunks) + len(self.decode_seqs)

    @property
    def is_empty(self) -> bool:
        return not self.prefill_chunks and not self.decode_seqs
