"""Retention "turn" in the prefill: a turn's chunks are held whole and its last row compacts
the whole turn.

`TurnCompaction` is the part of `ModelRunner` that serves `kv_layout`'s retention "turn"
(`compacts_turns`): `_turn_rows` checks each prefill row's turn arguments (or makes every row a
whole turn of its own), `_region_widths` are the static widths of the held region a
compaction reads. Inside a prefill's layer loop a turn's last row keeps what its compaction
needs of the layer's attention (`_turn_question`) and writes nothing; after the loop
`_compact_turns` runs every layer's compaction in one scan: `_turn_compaction` scores the held
turn and the row by `chunk_scoring.turn_scores` and writes the top back in temporal order. A
row whose turn is still held appends its chunk in the loop.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tangram_jax.compression.chunk_scoring import turn_scores
from tangram_jax import kv_quant
from tangram_jax.engine.tensor_parallel import AXIS
from tangram_jax.pallas_kernels.chunk_compress import chunk_destinations


# The held pages a short turn's compaction reads (retention "turn", `_region_widths`): a
# follow-up question and its protected tail fit; a longer turn reads the whole table.
SHORT_REGION_PAGES = 64
# `shard_map` specs of one row's `_turn_question` + (k_row, v_row): by head on the devices.
QUESTION_SPECS = (P(None, AXIS, None), P(AXIS, None), P(AXIS, None), P(None, AXIS, None),
                  P(None, AXIS, None))


class TurnCompaction:
    """Retention "turn" for `ModelRunner` (a mixin: it reads the runner's layout, tables and
    config; `PrefillSteps` calls it)."""

    def _turn_rows(self, tokens, hist_lengths, num_protected, turn_hist, keep_counts,
                   held_protected):
        """(turn_hist, keep_counts, held_protected) of every row for retention "turn"
        (checked; `prefill`), None where the runner does not compact turns."""
        if not self.compacts_turns:
            return None
        n = len(tokens)
        if turn_hist is None and keep_counts is None and held_protected is None:
            # Every row a whole turn of its own: compressed as it is written.
            layout = self.layout
            bad = [len(t) for t, p in zip(tokens, num_protected)
                   if p != layout.protected_tail(len(t))]
            if bad:
                raise ValueError(f"retention 'turn': rows of {bad} tokens are not whole turns "
                                 f"(their protected tails differ); pass turn_hist, keep_counts "
                                 f"and held_protected")
            turn_hist = [np.asarray(h) for h in hist_lengths]
            keep_counts = [layout.retained_counts(len(t)) for t in tokens]
            held_protected = [0] * n
        if turn_hist is None or keep_counts is None or held_protected is None or \
                not len(turn_hist) == len(keep_counts) == len(held_protected) == n:
            raise ValueError("retention 'turn' needs turn_hist, keep_counts and held_protected "
                             "for every row")
        turn_hist = [np.asarray(x, np.int64) for x in turn_hist]
        keep_counts = [np.asarray(x, np.int64) for x in keep_counts]
        for t, h0, h, k, p in zip(tokens, turn_hist, hist_lengths, keep_counts, held_protected):
            h = np.asarray(h)
            if h0.shape != self.counts_shape or k.shape != self.counts_shape or \
                    (h0 > h).any() or (k > len(t)).any() or (h + k < h0).any() or \
                    not 0 <= p <= (h - h0).min():
                raise ValueError(f"turn_hist and keep_counts must be {self.counts_shape} with "
                                 f"turn_hist <= hist, keep_counts <= the row's tokens and "
                                 f"hist + keep_counts >= turn_hist; held_protected in "
                                 f"[0, hist - turn_hist]")
        return turn_hist, keep_counts, [int(p) for p in held_protected]

    @property
    def host_waits_on_conditionals(self) -> bool:
        """Whether a device-side conditional (`lax.cond`) makes the host wait: on a GPU, XLA
        reads the predicate back before it launches the rest of the program, so the call
        returns only when the device has run everything before the branch (a prefill chunk's
        whole layer loop) and the next step's host work no longer overlaps the device's. On
        the CPU the program runs on the host anyway."""
        return self.placement.devices[0].platform != "cpu"

    def _region_widths(self) -> list[int]:
        """The static region widths (pages) of turn compactions a prefill call compiles for
        (`_region_width`): `SHORT_REGION_PAGES` (what a follow-up turn holds) and the whole
        block table (a long turn), so a prefill shape compiles twice, not once per length.
        Where the host waits on conditionals also 0: a call whose rows only append (the
        host knows which rows end their turn: `_prefill_args`) compiles no compaction, and a
        compacting call compacts every row and keeps the writes of those that end their turn
        (`_compact_turns`). Elsewhere a call whose rows only append takes the short one and
        skips its compaction on the device (a conditional). [0] where the runner does not
        compact turns."""
        if not self.compacts_turns:
            return [0]
        full = int(self.block_tables.shape[-1])
        return sorted({min(SHORT_REGION_PAGES, full), full}
                      | ({0} if self.host_waits_on_conditionals else set()))

    def _region_width(self, pages: int) -> int:
        """The smallest of `_region_widths` that holds `pages` pages and whose programs are
        compiled (`_ready`: warm-up may leave all but the widest to the background; the whole
        table's never is)."""
        return next(w for w in self._region_widths()
                    if w >= pages and self._ready("region_pages", w))

    @staticmethod
    def _turn_question(q_row, obs_row, lse, row_start, row_len):
        """What a turn's compaction needs of its last row's attention in a layer, taken inside
        the layer loop (the compaction itself runs after it: `_compact_turns`): q_win
        [W, Hq, d] (the question window's queries), lse_win [Hq, W] (their log-sum-exp over
        the call's keys), mass_row [Hq, T] float32 (the window's attention on each of the
        row's keys, summed over the window). q_row [T, Hq, d]; obs_row [Hq, W, T]; lse
        [Hq, N]; row_start, row_len int32 scalars."""
        chunk, window = q_row.shape[0], obs_row.shape[1]
        local = row_len - window + jnp.arange(window)
        q_win = q_row[jnp.clip(local, 0, chunk - 1)]                          # [W, Hq, d]
        lse_win = lse[:, jnp.clip(row_start + local, 0, lse.shape[1] - 1)]   # [Hq, W]
        return q_win, lse_win, obs_row.sum(axis=1)

    def _compact_turns(self, k_pages, v_pages, write_tables, hist, turn_hist, keep, questions,
                       row_lens, num_protected, held_protected, region_pages: int):
        """Retention "turn"'s compactions of a prefill call, after its layer loop: one
        `lax.scan` over the layers (a compaction reads and writes only its own layer's
        pages, which no later layer of the call reads, so it need not run inside the
        unrolled loop, where its 32 copies made the whole-table prefill 3.3x the HLO of
        full's and its compile the start-up's critical path). Each row whose turn ends
        here (`keep` < its length) has the whole turn scored and written back
        (`_turn_compaction`); the other rows wrote their chunk in the loop (where the host
        waits on conditionals, their compaction is computed and its writes dropped: only a
        call with an ending row compacts; elsewhere a conditional skips it).

        write_tables [layers, rows, groups, P]; hist, turn_hist, keep [layers, rows, groups];
        questions: per row (q_win, lse_win, mass_row, k_row, v_row) stacked over the layers
        (`_turn_question`, the row's K/V [layers, T, heads, d]); row_lens, num_protected,
        held_protected [rows]. Returns (k_pages, v_pages, plans stacked over the layers: the
        writes where they are planned, else [])."""
        page_size = self.layout.page_size
        rows = len(questions)
        host_decides = self.host_waits_on_conditionals

        def compact(k_pages, v_pages, write_tables, hist, turn_hist, keep, questions,
                    row_lens, num_protected, held_protected):
            plans = []
            for b in range(rows):
                q_win, lse_win, mass_row, k_row, v_row = questions[b]
                ends_turn = jnp.any(keep[b] < row_lens[b])
                compacted = lambda: self._turn_compaction(   # noqa: E731
                    q_win, lse_win, mass_row, k_row, v_row, row_lens[b], k_pages, v_pages,
                    write_tables[b], hist[b], turn_hist[b], keep[b], num_protected[b],
                    held_protected[b], region_pages)
                if host_decides:   # the call compacts (`_prefill_args`): keep the ending rows'
                    dest, k_src, v_src = compacted()
                    dest = jnp.where(ends_turn, dest, -1)
                else:
                    dest, k_src, v_src = jax.lax.cond(
                        ends_turn, compacted,
                        lambda: _nothing_written(k_row, v_row, region_pages, page_size))
                k_pages, v_pages = self._write_rows(k_src, v_src, dest, k_pages, v_pages,
                                                    write_tables[b], plans)
            return k_pages, v_pages, plans

        compact = self.placement.per_device(
            compact, in_specs=(self._pool_spec, self._pool_spec) + (P(),) * 4
            + ([QUESTION_SPECS] * rows,) + (P(),) * 3,
            out_specs=(self._pool_spec, self._pool_spec, []))

        def layer(carry, xs):
            k_pages, v_pages = carry
            k_pages, v_pages, plans = compact(k_pages, v_pages, *xs, row_lens, num_protected,
                                              held_protected)
            return (k_pages, v_pages), plans or None

        (k_pages, v_pages), plans = jax.lax.scan(
            layer, (k_pages, v_pages), (write_tables, hist, turn_hist, keep, questions))
        return k_pages, v_pages, plans or []

    def _turn_compaction(self, q_win, lse_win, mass_row, k_row, v_row, row_len, k_pages,
                         v_pages, table, hist, turn_hist, keep, num_protected, held_protected,
                         region_pages: int):
        """The last row of a turn under retention "turn": the whole turn (its held slots
        ``turn_hist .. hist - 1`` of each group, then the row's tokens) scored by the turn's
        question (the row's last obs_window queries) and the question-agnostic rule
        (`chunk_scoring.turn_scores`), the top ``hist + keep - turn_hist`` of each head written
        back in temporal order from slot ``turn_hist``.

        q_win [W, Hq, d], lse_win [Hq, W], mass_row [Hq, T] (`_turn_question`); k_row, v_row
        [T, heads, d] (the row, padded); row_len, num_protected (the row's protected tokens),
        held_protected (the turn's protected tokens held before the row): int32 scalars; table
        int [groups, P]; hist, turn_hist, keep int [groups]. Returns (dest [heads, R + T],
        k_src, v_src [R + T, heads, d]) for the write: R = region_pages * page_size held
        slots, read from the pages (dequantised) and written back compacted, then the row's
        tokens."""
        chunk, heads, dim = k_row.shape
        group_size = heads // hist.shape[0]
        ps = self.layout.page_size
        window = q_win.shape[0]
        q_per_kv = self.config.q_per_kv
        # The held slots: per group the table columns from its turn's first page on.
        first = turn_hist // ps                                              # [groups]
        cols = jnp.clip(first[:, None] + jnp.arange(region_pages)[None], 0, table.shape[1] - 1)
        page_ids = jnp.clip(jnp.take_along_axis(table, cols, axis=1), 0, None)
        slot = (first[:, None] * ps + jnp.arange(region_pages * ps)[None])   # [groups, R]
        held = (slot >= turn_hist[:, None]) & (slot < hist[:, None])
        per_head = lambda x: jnp.repeat(x, group_size, axis=0)              # noqa: E731

        def gather(pages):   # [groups, R_pages] -> [heads, R, d] in the pool's value dtype
            x = kv_quant.take_pages(pages, page_ids)       # [groups, Rp, G, ps, d]
            x = jnp.moveaxis(x, 2, 1)                      # [groups, G, Rp, ps, d]
            return x.reshape(heads, region_pages * ps, dim)

        k_held, v_held = gather(k_pages), gather(v_pages)
        # The question's attention on the held tokens: exp(q k / sqrt(d) - lse), summed over
        # the window, averaged over each head's query heads (what `mass_row` holds for the row).
        local = row_len - window + jnp.arange(window)
        # (In the pool's dtype with float32 sums, as the attention kernels compute them.)
        q_win = q_win.astype(k_held.dtype)
        logits = jnp.einsum("wgjd,gsd->gjws", q_win.reshape(window, heads, q_per_kv, dim),
                            k_held, preferred_element_type=jnp.float32).reshape(
            heads * q_per_kv, window, -1) / math.sqrt(dim)
        live = (local >= 0)[None, :, None] & per_head(held)[:, None].repeat(q_per_kv, 0)
        probs = jnp.where(live, jnp.exp(logits - lse_win[..., None]), 0.0)
        mass_held = probs.sum(axis=1).reshape(heads, q_per_kv, -1).mean(axis=1)
        mass_row = mass_row.reshape(heads, q_per_kv, chunk).mean(axis=1)
        # One temporal axis: held slots, then the row.
        mass = jnp.concatenate([mass_held, mass_row], axis=1)
        keys = jnp.concatenate([k_held.astype(jnp.float32),
                                jnp.swapaxes(k_row, 0, 1).astype(jnp.float32)], axis=1)
        t = jnp.arange(chunk)
        candidate = jnp.concatenate([per_head(held), jnp.broadcast_to(
            t[None] < row_len, (heads, chunk))], axis=1)
        protected = jnp.concatenate([
            per_head((slot >= hist[:, None] - held_protected) & held),
            jnp.broadcast_to((t[None] >= row_len - num_protected) & (t[None] < row_len),
                             (heads, chunk))], axis=1)
        scores = turn_scores(mass, keys, candidate, protected,
                             method=self.runner_config.method,
                             rule=self.runner_config.scoring_rule)
        total = scores.shape[1]
        dest = chunk_destinations(scores, hist + keep - turn_hist, jnp.int32(total), turn_hist,
                                  group_size)
        k_src = jnp.concatenate([jnp.swapaxes(k_held, 0, 1).astype(k_row.dtype), k_row])
        v_src = jnp.concatenate([jnp.swapaxes(v_held, 0, 1).astype(v_row.dtype), v_row])
        return dest, k_src, v_src


def _nothing_written(k_row, v_row, region_pages: int, page_size: int):
    """`_turn_compaction`'s outputs for a row whose turn is still held (it wrote its chunk in
    the layer loop): no destination."""
    total = region_pages * page_size + k_row.shape[0]
    zeros = jnp.zeros((region_pages * page_size, *k_row.shape[1:]), k_row.dtype)
    return (jnp.full((k_row.shape[1], total), -1, jnp.int32), jnp.concatenate([zeros, k_row]),
            jnp.concatenate([zeros.astype(v_row.dtype), v_row]))
