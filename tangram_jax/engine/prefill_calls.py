"""A step's prefill rows as runner calls: which rows share a call, what each row keeps.

`run_prefill_rows` is the host half of `ModelRunner.execute`'s prefill: it cuts the plan's
`PrefillRow`s into calls of `ModelRunner.prefill` (at most `max_prefill_rows` rows a call; a
row of a compressing layout one compression chunk, since a chunk's selection depends on the
chunk before it), gives each call's rows their protected tails and keep counts from the layout,
tracks each sequence's retained lengths across the calls, and runs the step's decode rows with
the last call.
"""

from __future__ import annotations

import numpy as np

from tangram_jax.engine.step_plan import DecodeRows, PrefillRow
from tangram_jax.sampling import TokenLogprobs


def run_prefill_rows(runner, rows: tuple[PrefillRow, ...], max_prefill_rows: int,
                     decode: DecodeRows | None = None) -> tuple:
    """Run `rows` (and `decode` with the last call) on `runner`.

    Where the layout keeps every token (`runner.prefill_whole_rows`: ``full``) a call row is a
    whole plan row, so a call's GEMMs and attention see up to the step's token budget.
    Otherwise a call row is one compression chunk, and a call takes the next chunk of up to
    `max_prefill_rows` plan rows (chunks of one row depend on each other, those of different
    rows do not).

    Returns (last_logits, retained, prompt_logprobs, decoded): last_logits {plan row index:
    logits [V]} of rows that end their prompt; retained {request id: int64 [layers, groups]
    retained lengths after its rows}, which in ``dynamic`` mode come back from the device (a
    host round trip per call), otherwise from the layout's keep rule; prompt_logprobs {request
    id: {position: TokenLogprobs}} of rows with prompt targets (the entry of the prompt token
    that follows each position); decoded: `ModelRunner.decode`'s result for `decode`, or None.
    """
    layout = runner.layout
    dynamic = runner.runner_config.mode == "dynamic"
    hist = {r.request_id: r.retained for r in rows}
    last_logits, prompt_logprobs = {}, {}
    calls = []   # (offset into each row, indices of its rows), in dependency order
    if runner.prefill_whole_rows:
        calls = [(0, list(range(i, min(i + max_prefill_rows, len(rows)))))
                 for i in range(0, len(rows), max_prefill_rows)]
        span = max((r.num_tokens for r in rows), default=0)
    else:
        span = layout.chunk_size
        for offset in range(0, max((r.num_tokens for r in rows), default=0), span):
            due = [i for i, r in enumerate(rows) if r.start + offset < r.end]
            calls += [(offset, due[i:i + max_prefill_rows])
                      for i in range(0, len(due), max_prefill_rows)]
    decoded = None
    for index, (offset, members) in enumerate(calls):
        part = [rows[i] for i in members]
        starts = [r.start + offset for r in part]
        ends = [min(start + span, r.end) for start, r in zip(starts, part)]
        # What each chunk keeps whole: the protected tail of its turn (rows start on the chunk
        # grid of their planned segment), or all of it in a segment decode wrote. A whole row
        # keeps every token anyway.
        protected = [0 if runner.prefill_whole_rows else
                     layout.chunk_protected(r.segment[1] - r.segment[0], start - r.segment[0],
                                            end - start) if r.segment[2] else end - start
                     for r, start, end in zip(part, starts, ends)]
        # Each row's count: the layout's rule for the row's place in its turn (a segment decode
        # wrote keeps all); under retention "turn" also where the turn's held tokens start and
        # how many of its protected tail they include (the turn's last row compresses them).
        counts = turn_rows = None
        if not (runner.prefill_whole_rows or dynamic):
            counts = [_row_keep_counts(layout, r, start, end, protected_b)
                      for r, start, end, protected_b in zip(part, starts, ends, protected)]
        if runner.compacts_turns:
            turn_rows = dict(turn_hist=[], keep_counts=counts, held_protected=[])
            for r, start in zip(part, starts):
                seg_start, seg_end, compressed = r.segment
                into, turn_len = start - seg_start, seg_end - seg_start
                turn_rows["turn_hist"].append(hist[r.request_id] - (
                    layout.retained_counts(turn_len, upto=into) if compressed else 0))
                turn_rows["held_protected"].append(
                    max(0, into - turn_len + layout.protected_tail(turn_len))
                    if compressed else 0)
        want = any(r.prompt_targets is not None for r in part)
        targets = [r.prompt_targets[a - r.start:b - r.start] if r.prompt_targets is not None
                   else np.full(b - a, -1, np.int32)
                   for r, a, b in zip(part, starts, ends)] if want else None
        with_decode = decode.arguments() if decode is not None and index == len(calls) - 1 \
            else None
        logits, kept, *lp_rows = runner.prefill(
            [r.token_ids[a - r.start:b - r.start] for r, a, b in zip(part, starts, ends)],
            starts, [r.slot for r in part], [hist[r.request_id] for r in part],
            protected, targets, decode=with_decode, **(turn_rows or {}))
        if with_decode is not None:
            decoded = lp_rows.pop()
        for r, a, t, lp in zip(part, starts, targets or (), lp_rows[0] if lp_rows else ()):
            if r.prompt_targets is None:
                continue
            record = prompt_logprobs.setdefault(r.request_id, {})
            for i in np.flatnonzero(t >= 0):
                record[a + i + 1] = TokenLogprobs(*(x[i] for x in lp[:4]), None)
        kept_host = np.asarray(kept) if dynamic else None
        for b, (i, r, start, end) in enumerate(zip(members, part, starts, ends)):
            rid = r.request_id
            if kept_host is not None:   # the per-input count: a host round trip
                hist[rid] = hist[rid] + kept_host[b]
            elif runner.prefill_whole_rows:   # every token kept
                hist[rid] = hist[rid] + (end - start)
            else:
                hist[rid] = hist[rid] + counts[b]
            if end == r.end and r.is_last:
                last_logits[i] = logits[b]
    if decode is not None and not calls:
        decoded = runner.decode(**decode.arguments())
    return last_logits, hist, prompt_logprobs, decoded


def _row_keep_counts(layout, row: PrefillRow, start: int, end: int,
                     protected: int) -> np.ndarray:
    """int64 [layers, groups]: the slots a compression-chunk call row of tokens [start, end) of
    `row`'s segment adds: ``layout.piece_retained_counts`` of its place in the turn, every
    token of a segment decode wrote."""
    seg_start, seg_end, compressed = row.segment
    if not compressed:
        return np.full((layout.num_layers, layout.num_groups), end - start, np.int64)
    if layout.retention == "chunk":
        return layout.chunk_keep_counts(end - start, protected)
    return layout.piece_retained_counts(seg_end - seg_start, start - seg_start, end - seg_start)
