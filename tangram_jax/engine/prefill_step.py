"""The runner's prefill programs: compression-chunk and whole rows of prompt tokens.

`PrefillSteps` is the half of `ModelRunner` that runs prompt rows: `prefill` (a ragged batch of
rows, one compression chunk or one whole piece of a turn each) checks its rows and builds the
jitted program's inputs (`_prefill_args`: rows packed on a flat token axis, block tables cut to
a compiled width, retention "turn"'s held regions), and `_prefill_impl` runs the layers: each
layer's attention over the rows' history and themselves (`_prefill_layer_attention`), the
chunk's scores (`_row_scores`, `chunk_scoring`), and the kept K/V written into the pages (the
kernels in place; the CPU path returns a plan of writes that `_apply_writes` scatters), or under
retention "turn" the whole held turn compacted by its last chunk, every layer's in one scan after
the layer loop (`_compact_turns`, in `turn_compaction.py` with the checks of a row's turn
arguments). The host half, which rows share
a call and what each keeps, is `prefill_calls.py`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from tangram_jax.compression.chunk_scoring import chunk_scores, dynamic_keep_count
from tangram_jax.kv_layout import held_turn_skip
from tangram_jax.engine.xla_attention import apply_chunk_writes
from tangram_jax.pallas_kernels.chunk_compress import (chunk_destinations,
                                                       compress_chunk_into_tiers,
                                                       contiguous_dirty_pages)
from tangram_jax.engine.tensor_parallel import AXIS
from tangram_jax.engine.turn_compaction import QUESTION_SPECS
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.prefill_attention import (item_capacity, observation_probs,
                                                          pack_rows, prefill_work_items,
                                                          row_alignment)
from tangram_jax.sampling import TokenLogprobs, token_logprobs


# The narrowest block-table width of the CPU path over precision tiers (pages): shorter rows are
# padded to it, so short contexts share one compiled shape.
_MIN_TABLE_WIDTH = 16


class PrefillSteps:
    """Prefill half of `ModelRunner` (a mixin: it reads the runner's state: layout, pool,
    tables, ops, placement)."""

    @property
    def prefill_whole_rows(self) -> bool:
        """True when a prefill row may span several compression chunks: the layout keeps every
        token (``full``, or a profile of budgets 1), so no chunk's selection depends on the
        scores of the chunk before it, and a row is a whole piece of a turn (one long causal
        attention, one KV append). Otherwise a row is one compression chunk (always with
        precision tiers: the tier rule splits each chunk's kept tokens by rank)."""
        return (not self.layout.compresses and self.runner_config.mode != "dynamic"
                and self.tiers is None)

    def prefill_token_buckets(self, max_rows: int = 1) -> list[int]:
        """Flat-token sizes a call of whole rows is padded to (`prefill_whole_rows`): the
        configured `RunnerConfig.prefill_token_buckets` rounded up to the row alignment, else
        the alignment's doublings (at most half a call is padding; `NOTES_memory.md`: each
        8B prefill program costs ~25 s of compile cold and ~1.6 s warm, more than the padding
        of a long prompt's last step); up to `max_prefill_tokens` plus one alignment of slack
        per extra row (always a bucket)."""
        align = row_alignment(self.prefill_tuning)
        cap = -(-self.runner_config.max_prefill_tokens // align) * align + align * (max_rows - 1)
        if self.runner_config.prefill_token_buckets is not None:
            return sorted({-(-b // align) * align for b in self.runner_config.prefill_token_buckets
                           if b < cap} | {cap})
        return _doublings(align, cap)

    def _token_bucket(self, rows: int, used: int) -> int | None:
        """The flat-token bucket a call of `rows` (padded) rows using `used` tokens runs at:
        the smallest that holds them whose programs are compiled (`_ready`: warm-up may leave
        all but two buckets to the background, `step_compiler.SHORT_TURN_TOKENS`); None when
        none holds them."""
        fits = [b for b in (self.prefill_token_buckets(rows) if self.prefill_whole_rows
                            else self.chunk_token_buckets(rows)) if b >= used]
        return next((b for b in fits if self._ready("tokens", b)), fits[-1] if fits else None)

    def chunk_token_buckets(self, rows: int) -> list[int]:
        """Flat-token sizes of a call of `rows` compression-chunk rows (not
        `prefill_whole_rows`): every row's chunk, aligned; on the CPU path also the powers of
        two of the row alignment below that from `rows` alignments up (a follow-up turn's few
        dozen tokens cost a 64-token GEMM, not a whole chunk's; each size is one more compiled
        prefill and mixed program)."""
        align = row_alignment(self.prefill_tuning)
        whole = rows * (-(-self.layout.chunk_size // align) * align)
        if self.ops.name != "xla":
            return [whole]
        return _doublings(rows * align, whole)

    def prefill(self, tokens: list[np.ndarray], start_positions: list[int], slots: list[int],
                hist_lengths: list[np.ndarray],
                num_protected: list[int] | None = None,
                prompt_targets: list[np.ndarray] | None = None,
                decode: dict | None = None, *,
                turn_hist: list[np.ndarray] | None = None,
                keep_counts: list[np.ndarray] | None = None,
                held_protected: list[int] | None = None) -> tuple:
        """Run one prefill row for each of several sequences in one call (a ragged batch: the
        GEMMs see every row's tokens at once), writing each one's kept K/V into its pages.

        Row b: tokens[b] int [n_b], start_positions[b] the absolute position of its first token
        (a compression-chunk boundary of its turn), slots[b] its block-table row (reservation
        applied by `update_block_tables`), hist_lengths[b] int [layers, groups] retained tokens
        before the row, num_protected[b] how many of its last tokens are the turn's protected
        tail (`KVLayout.chunk_protected`; default none). With `prefill_whole_rows` a row is any
        piece of a turn (n_b >= 1, all rows together within `max_prefill_tokens`; every token
        is kept, so protection changes nothing); otherwise one compression chunk
        (1 <= n_b <= layout.chunk_size). The slots must be distinct. Rows are padded to a
        power of two with empty rows on the null slot, so few shapes compile.
        Returns (last_logits [rows, vocab] float32, kept [rows, layers, groups] int32), device
        arrays whose first ``len(tokens)`` rows are the given rows. Without dynamic selection
        `kept` is the layout's keep rule for each row (``chunk_keep_counts(n_b, num_protected[b])``
        for a chunk, n_b for a whole row). With `prompt_targets` a third item: each row's
        log-probabilities of its targets (see `_run_prefill`).

        decode: a decode step to run with this call (the keyword arguments of `decode`; its
        rows are other sequences than these). Where the runner `mixes_steps` and no
        prompt_targets are asked, both run as one program (`_mixed_impl`: one pass over the
        weights and the layers); otherwise the prefill, then the decode. Its result (`decode`'s
        return value) is then the last item of the returned tuple.

        Retention "turn" (`compacts_turns`) needs, per row, turn_hist[b] int [layers, groups]
        (the retained tokens before the row's turn: its held tokens are slots turn_hist ..
        hist - 1) and keep_counts[b] int [layers, groups] (what the row changes the group's
        count by, ``layout.piece_retained_counts`` of the row within its turn: the row's length
        while the turn is held, and for its last row the turn's count less what it holds, so
        that row compresses the whole turn); held_protected[b]: of the turn's protected tail,
        the tokens already held before the row. Without them every row is a whole turn of its
        own, compressed as it is written.
        """
        n_rows = len(tokens)
        if not (n_rows == len(start_positions) == len(slots) == len(hist_lengths) > 0):
            raise ValueError("prefill needs one start position, slot and history per row")
        if len(set(int(s) for s in slots)) != n_rows:
            raise ValueError(f"prefill rows must be distinct sequences, got slots {list(slots)}")
        if num_protected is None:
            num_protected = [0] * n_rows
        limit = None if self.prefill_whole_rows else self.layout.chunk_size
        for t, p in zip(tokens, num_protected):
            if len(t) < 1 or (limit is not None and len(t) > limit):
                raise ValueError(f"a prefill row holds 1..{limit or 'max_prefill_tokens'} "
                                 f"tokens, got {len(t)}")
            if not 0 <= p <= len(t):
                raise ValueError(f"num_protected must be in [0, {len(t)}] for a row of {len(t)} "
                                 f"tokens, got {p}")
        if prompt_targets is not None and [len(t) for t in prompt_targets] != \
                [len(t) for t in tokens]:
            raise ValueError("prompt_targets needs one target per token of every row")
        turn_rows = self._turn_rows(tokens, hist_lengths, num_protected, turn_hist, keep_counts,
                                    held_protected)
        if decode is not None and self.mixes_steps and prompt_targets is None:
            return self._run_mixed(tokens, start_positions, slots, hist_lengths, num_protected,
                                   decode, turn_rows)
        out = self._run_prefill(tokens, start_positions, slots, hist_lengths, num_protected,
                                prompt_targets, turn_rows)
        return out if decode is None else (*out, self.decode(**decode))

    def _run_prefill(self, tokens, start_positions, slots, hist_lengths, num_protected,
                     prompt_targets=None, turn_rows=None):
        """`prefill` without the checks. With `prompt_targets` (int [n_b] per row: the token
        each position's logits predict, -1 for none) it also returns each row's
        `TokenLogprobs` of those targets (numpy, [n_b] / [n_b, MAX_TOP_LOGPROBS]; the
        prompt_logprobs of vLLM), computed on the device over every position of the call."""
        args, static = self._prefill_args(tokens, start_positions, slots, hist_lengths,
                                          num_protected, None, self.k_pages, self.v_pages,
                                          turn_rows)
        if prompt_targets is None:
            logits, kept = self._call_prefill(args, static)
            return logits, kept
        row_starts = args[6]
        flat_targets = np.full(args[4].shape[0], -1, np.int32)
        for start, t in zip(row_starts, prompt_targets):
            flat_targets[start:start + len(t)] = t
        logits, kept, lp = self._call_prefill((*args, flat_targets), static)
        host = TokenLogprobs(*(np.asarray(x) for x in lp[:4]), None)
        rows = [TokenLogprobs(*(x[start:start + len(t)] for x in host[:4]), None)
                for start, t in zip(row_starts, prompt_targets)]
        return logits, kept, rows

    def _call_prefill(self, args, static) -> tuple:
        """Run `_prefill` and take the pool it wrote (kernels: in place) or apply the writes
        it planned (the CPU path); returns the rest of its results."""
        if self.plans_prefill_writes:
            writes, *rest = self._prefill(*args, **static)
            self.k_pages, self.v_pages = self._apply_writes(self.k_pages, self.v_pages, writes)
        else:
            self.k_pages, self.v_pages, *rest = self._prefill(*args, **static)
        return tuple(rest)

    def _prefill_args(self, tokens, start_positions, slots, hist_lengths, num_protected,
                      num_tokens, k_pages, v_pages, turn_rows=None,
                      region_pages: int | None = None) -> tuple[tuple, dict]:
        """`_prefill`'s inputs and static arguments for these rows; `num_tokens` forces the
        flat-token bucket of whole rows (warm-up); turn_rows: `_turn_rows`'s (turn_hist,
        keep_counts, held_protected), or None (every row keeps all: a warm-up call);
        region_pages forces the static region width of turn compactions (warm-up)."""
        n_rows = len(tokens)
        rows = backend.next_power_of_2(n_rows)
        layout = self.layout
        align = row_alignment(self.prefill_tuning)
        lens = np.zeros(rows, np.int32)
        lens[:n_rows] = [len(t) for t in tokens]
        protected = np.zeros(rows, np.int32)
        protected[:n_rows] = num_protected
        starts, used = pack_rows(lens[:n_rows], align)
        if num_tokens is None:
            num_tokens = self._token_bucket(rows, used)
            if num_tokens is None:
                raise ValueError(f"a prefill call of {int(lens.sum())} tokens in {n_rows} "
                                 f"rows exceeds max_prefill_tokens "
                                 f"{self.runner_config.max_prefill_tokens}")
        # Empty padding rows start at the end of the flat axis (they own no token).
        row_starts = np.full(rows, num_tokens, np.int32)
        row_starts[:n_rows] = starts
        flat = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        for b in range(n_rows):
            s, n = starts[b], lens[b]
            flat[s:s + n] = tokens[b]
            positions[s:s + n] = int(start_positions[b]) + np.arange(n)
        row_slots = np.full(rows, self.null_slot, np.int32)
        row_slots[:n_rows] = slots
        hist = np.zeros((rows, *self.counts_shape), np.int32)
        hist[:n_rows] = np.stack([np.asarray(h, np.int32) for h in hist_lengths])
        turn_hist = hist.copy()
        held_protected = np.zeros(rows, np.int32)
        if self.prefill_whole_rows or self.runner_config.mode == "dynamic":
            keep = np.zeros_like(hist)     # whole rows keep all; dynamic decides on device
        elif self.compacts_turns:
            keep = np.broadcast_to(lens[:, None, None], hist.shape).astype(np.int32)
            if turn_rows is not None:
                turn_hist[:n_rows] = np.stack(turn_rows[0])
                keep[:n_rows] = np.stack(turn_rows[1])
                held_protected[:n_rows] = turn_rows[2]
        else:
            keep = np.stack([layout.chunk_keep_counts(int(n), int(p))
                             for n, p in zip(lens, protected)]).astype(np.int32)
        # The rows that compact their turn (retention "turn": the turn's last row).
        compacts = (keep < lens[:, None, None]).any(axis=(1, 2))[:n_rows]
        # Retention "turn" with the "recent" view: rows that hold their turn (all but its last)
        # attend to its first page and its recent share only (`kv_layout.held_turn_skip`).
        view_skip = np.zeros_like(hist)
        if self.compacts_turns and layout.turn_view == "recent" and turn_rows is not None:
            holds = ~compacts
            view_skip[:n_rows][holds] = held_turn_skip(
                hist[:n_rows][holds], turn_hist[:n_rows][holds], layout.group_budgets,
                layout.chunk_size, layout.page_size, self.config.local_layers)
        # The kernel's item list per layer, heaviest first (ahead of the call, on the host).
        # (Tiers: a group's history is both its tiers, read as one.)
        group_hist = hist - view_skip * layout.page_size
        if self.tiers is not None:
            group_hist = group_hist[..., 0::2] + group_hist[..., 1::2]
        items = prefill_work_items(
            row_starts, lens, np.swapaxes(group_hist, 0, 1), num_tokens=num_tokens,
            num_items=item_capacity(num_tokens, self.base_layout.num_groups,
                                    self.base_layout.group_size // self.placement.tp,
                                    self.prefill_tuning), tuning=self.prefill_tuning)
        args = (*self.weight_args, k_pages, v_pages, flat, positions, row_starts,
                lens, protected, self.block_tables, row_slots, hist, keep, items, held_protected,
                turn_hist, view_skip)
        # The columns attention reads: the history's (the CPU path plans its writes from the
        # whole table after the loop), or the history's and the row's (kernels write in place).
        reach = int(hist.max()) + (0 if self.plans_prefill_writes else int(lens.max()))
        if region_pages is None:
            region_pages = 0
            if self.compacts_turns:   # the pages each compaction's held tokens span
                ps = layout.page_size
                span = (turn_hist % ps + hist - turn_hist + ps - 1) // ps
                # (A compacting call reads at least a page: width 0 compiles no compaction.)
                region_pages = self._region_width(
                    max(1, int(span[:n_rows][compacts].max())) if compacts.any() else 0)
        return args, dict(table_width=self._table_width(reach, prefill=True),
                          region_pages=region_pages)

    @property
    def dense_pool(self) -> bool:
        """Whether the pool holds pages of values (bf16), not quantised codes or tiers."""
        return not self.pool_format.tiered and not self.pool_format.page_formats[0].quantised

    @property
    def plans_prefill_writes(self) -> bool:
        """Whether prefill plans its K/V writes and scatters them after the layer loop (the CPU
        path: writing inside the loop made XLA copy the whole pool every layer) rather than
        writing in place. Plans are of dense (bf16) pools on one device."""
        return self.ops.plan_writes is not None and self.placement.tp == 1 and self.dense_pool

    def prefill_chunk(self, tokens: np.ndarray, start_position: int, slot: int,
                      hist_lengths: np.ndarray,
                      num_protected: int = 0) -> tuple[jax.Array, jax.Array]:
        """`prefill` of a single row: (last_logits [vocab], kept [layers, groups])."""
        logits, kept = self.prefill([tokens], [start_position], [slot], [hist_lengths],
                                    [num_protected])
        return logits[0], kept[0]

    def _prefill_layer_attention(self, rows: int, n: int, k_pages,
                                 region_pages: int = 0) -> Callable:
        """One layer's prefill attention, compression scoring and KV write for `rows` rows over
        a flat axis of `n` tokens (run per device): ``attend(q, k, v, k_pages, v_pages, tables,
        write_tables, hist, view_hist, turn_hist, keep, items, row_starts, row_lens,
        num_protected, held_protected, positions, terms) -> (out [n, Hq, d], k_pages, v_pages,
        kept [rows, groups], planned writes)``; attention reads `view_hist` slots of `tables`
        (`_prefill_layer_inputs`), the writes go after `hist` slots of `write_tables`.
        region_pages: static, the held pages a turn compaction of this call reads
        (`_turn_compaction`; 0: no row compacts its turn)."""
        chunk = self.layout.chunk_size
        whole_rows = self.prefill_whole_rows
        group_size = self.base_layout.group_size // self.placement.tp   # heads of a group here
        tiered = self.tiers is not None

        def attend(q, k, v, k_pages, v_pages, tables, write_tables, hist, view_hist, turn_hist,
                   keep, items, row_starts, row_lens, num_protected, held_protected, positions,
                   terms):
            """The layer's attention, compression scoring and KV write on one device's heads
            (all of them without tensor parallelism). q [N, Hq, d], k/v [N, Hkv, d]; pools
            [num_pages, G, page_size, d] (this device's G); terms: the layer's window and sinks
            (`_attention_terms`). Returns (out [N, Hq, d], k_pages, v_pages, kept [rows,
            groups], the planned writes (a list; empty unless planned), what each row's turn
            compaction needs after the loop (a list, one `_turn_question` + (k_row, v_row)
            a row where `region_pages`; else empty))."""
            k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
            plans = []
            # Tiers: tables and lengths of tier groups; both prefill paths read a group's two
            # tiers as one dense history (`kv_quant.tiered_dense_history`).
            out, lse = self.ops.prefill_attention(q, k, v, k_pages, v_pages, tables, view_hist,
                                                  row_starts, row_lens, items,
                                                  tuning=self.prefill_tuning, **terms)
            if whole_rows:
                # Every token kept: each row's K/V appended after its history, in order.
                pad = ((0, n), (0, 0), (0, 0))
                k_flat, v_flat = jnp.pad(k, pad), jnp.pad(v, pad)
                t = jnp.arange(n, dtype=jnp.int32)[None, :]
                for b in range(rows):
                    dest = jnp.where(t < row_lens[b], jnp.repeat(hist[b], group_size)[:, None]
                                     + t, -1)
                    k_pages, v_pages = self._write_rows(
                        jax.lax.dynamic_slice_in_dim(k_flat, row_starts[b], n),
                        jax.lax.dynamic_slice_in_dim(v_flat, row_starts[b], n), dest,
                        k_pages, v_pages, write_tables[b], plans)
                kept = jnp.broadcast_to(row_lens[:, None], hist.shape)
                return out, k_pages, v_pages, kept, plans, []
            # One compression chunk per row: score, select, write.
            obs = observation_probs(q, k, lse, row_starts, row_lens,
                                    obs_window=self.runner_config.obs_window, chunk=chunk)
            pad = ((0, chunk), (0, 0), (0, 0))   # a padding row's slice stays in range
            q_flat, k_flat, v_flat = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
            kept, questions = [], []
            for b in range(rows):
                q_row, k_row, v_row = (jax.lax.dynamic_slice_in_dim(x, row_starts[b], chunk)
                                       for x in (q_flat, k_flat, v_flat))
                if tiered:
                    scores, keep_b = self._row_scores(
                        obs[b], q_row, k_row, v_row, row_lens[b], num_protected[b],
                        positions[jnp.minimum(row_starts[b], n - 1)], keep[b])
                    k_pages, v_pages = compress_chunk_into_tiers(
                        self.ops.compress_chunk, k_row, v_row, scores, keep_b, row_lens[b],
                        k_pages, v_pages, write_tables[b], hist[b])
                    kept.append(keep_b)
                    continue
                if self.compacts_turns:
                    # Held whole (the row's length) and appended now, or the turn's last row,
                    # whose whole turn `_compact_turns` writes after the loop.
                    keep_b = keep[b]
                    dest = chunk_destinations(
                        -jnp.arange(chunk, dtype=jnp.float32)[None].repeat(k.shape[1], 0),
                        jnp.minimum(keep_b, row_lens[b]), row_lens[b], hist[b], group_size)
                    if region_pages:
                        dest = jnp.where(jnp.any(keep_b < row_lens[b]), -1, dest)
                        questions.append((*self._turn_question(
                            q_row, obs[b], lse, row_starts[b], row_lens[b]), k_row, v_row))
                    k_src, v_src = k_row, v_row
                else:
                    scores, keep_b = self._row_scores(
                        obs[b], q_row, k_row, v_row, row_lens[b], num_protected[b],
                        positions[jnp.minimum(row_starts[b], n - 1)], keep[b])
                    dest = chunk_destinations(scores, keep_b, row_lens[b], hist[b], group_size)
                    k_src, v_src = k_row, v_row
                k_pages, v_pages = self._write_rows(k_src, v_src, dest, k_pages, v_pages,
                                                    write_tables[b], plans)
                kept.append(keep_b)
            return out, k_pages, v_pages, jnp.stack(kept), plans, questions

        heads = P(None, AXIS, None)                      # [N, heads, d]: heads over the devices
        questions = [QUESTION_SPECS] * (rows if self.compacts_turns and region_pages else 0)
        attend = self.placement.per_device(
            attend, in_specs=(heads, heads, heads, self._pool_spec, self._pool_spec)
            + (P(),) * 12 + (self._terms_spec,),
            out_specs=(heads, self._pool_spec, self._pool_spec, P(), [], questions))

        return attend

    def _prefill_impl(self, state, layer_states, k_pages, v_pages, tokens, positions, row_starts,
                      row_lens, num_protected, all_tables, slots, hist_lengths, keep_counts,
                      work_items, held_protected, turn_hist, view_skip, targets=None, *,
                      table_width, region_pages):
        """tokens, positions [N] (flat, rows at row_starts); row_starts, row_lens, num_protected,
        held_protected, slots [rows]; hist_lengths, keep_counts, turn_hist, view_skip [rows,
        layers, groups] (view_skip: `_prefill_layer_inputs`); work_items [layers, items, 5];
        table_width, region_pages: static, the block-table columns attention reads and the held
        pages a turn compaction reads (see `_table_width`, `_prefill_args`). Returns (k_pages,
        v_pages, logits, kept[, lp]), or
        with `plans_prefill_writes` (writes, logits, kept[, lp]): the pool untouched, its
        writes for `_apply_writes`."""
        state, layer_states = self._weight_trees(state, layer_states)
        model = nnx.merge(self.graphdef, state)
        rows, n = row_starts.shape[0], tokens.shape[0]
        planned = self.plans_prefill_writes
        attend = self._prefill_layer_attention(rows, n, k_pages, region_pages)

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry
            # [rows, Gn, width], [rows, Gn, P or width], [rows, Gn] x 3, [I, 5]
            layer_state, tables, write_tables, hist, view_hist, turn_hist, keep, items = xs
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, positions[None])      # GEMMs over every row's tokens at once
            out, k_pages, v_pages, kept, plans, questions = attend(
                q[0], k[0], v[0], k_pages, v_pages, tables, write_tables, hist, view_hist,
                turn_hist, keep, items, row_starts, row_lens, num_protected, held_protected,
                positions, self._attention_terms(layer))
            h = layer.finish(h, out[None].astype(h.dtype))
            return (h, k_pages, v_pages), (kept, plans or None, questions or None)

        h = model.embed(tokens[None])                    # [1, N, hidden]
        layer_inputs = self._prefill_layer_inputs(all_tables, slots, hist_lengths, turn_hist,
                                                  keep_counts, work_items, table_width,
                                                  view_skip)
        (h, k_pages, v_pages), (kept, plans, questions) = self._over_layers(
            layer_step, (h, k_pages, v_pages), (layer_states, *layer_inputs))
        k_pages, v_pages, plans = self._after_layers(k_pages, v_pages, plans, questions,
                                                     layer_inputs, row_lens, num_protected,
                                                     held_protected, region_pages)
        # The CPU path returns its writes of every layer and row (`_apply_writes` scatters them
        # in place, in a second program): scattered here, after the loop, they could still be
        # ordered before a layer's history read (unrolled, nothing makes the scatter wait for
        # the last layer's attention), and XLA copied the pool (1 GiB) to keep them apart.
        pool = (plans,) if planned else (k_pages, v_pages)
        last = h[0, jnp.clip(row_starts + row_lens - 1, 0, h.shape[1] - 1)]   # [rows, hidden]
        logits = model.logits(last[:, None])[:, 0]
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)    # [layers, rows, ...] -> [rows, layers, ...]
        if targets is None:
            return *pool, logits, per_layer(kept)
        # prompt_logprobs: every position's distribution over the token that follows it.
        lp = token_logprobs(model.logits(h)[0], jnp.maximum(targets, 0), full=False)
        return *pool, logits, per_layer(kept), lp

    def _write_rows(self, k_src, v_src, dest, k_pages, v_pages, table, plans: list) -> tuple:
        """Rows of k_src, v_src [S, heads, d] into the slots `dest` [heads, S] gives (-1: none)
        of the pool: now (the kernel), or where `plans_prefill_writes`
        planned for after the step (then `table` is the row's whole table of this layer and
        `plans` collects the plan). Returns (k_pages, v_pages)."""
        page_size = self.layout.page_size
        if self.plans_prefill_writes:
            plans.append(self.ops.plan_writes(
                k_src, v_src, dest, k_pages.shape[0], page_size,
                self.base_layout.group_size // self.placement.tp, table))
            return k_pages, v_pages
        return self.ops.write_chunk(k_src, v_src, dest, k_pages, v_pages, table,
                                    max_dirty=contiguous_dirty_pages(k_src.shape[0], page_size))

    def _after_layers(self, k_pages, v_pages, plans, questions, layer_inputs, row_lens,
                      num_protected, held_protected, region_pages: int) -> tuple:
        """The turn compactions of a prefill call's rows (`_compact_turns`), after its layer
        loop (`questions`: what the loop kept of each row's attention, None where no row can
        compact). Returns (k_pages, v_pages, plans): the loop's planned writes, then the
        compactions' (planned writes; None where the kernels wrote in place)."""
        if not questions:
            return k_pages, v_pages, plans
        _, write_tables, hist, _, turn_hist, keep, _ = layer_inputs
        k_pages, v_pages, turn_plans = self._compact_turns(
            k_pages, v_pages, write_tables, hist, turn_hist, keep, questions, row_lens,
            num_protected, held_protected, region_pages)
        return k_pages, v_pages, (list(plans) + list(turn_plans)) if plans else plans

    def _prefill_layer_inputs(self, all_tables, slots, hist_lengths, turn_hist, keep_counts,
                              work_items, table_width, view_skip) -> tuple:
        """The prefill's per-layer inputs (leading axis layers): the rows' tables of the
        columns attention reads, the tables writes use (the whole table where writes are
        planned), histories, the histories attention reads, turn starts, keep counts, work
        items. view_skip [rows, layers, groups]: pages of a held turn attention skips
        (`kv_layout.held_turn_skip`): its table's columns after the turn's first page jump
        that many pages, and it reads that many pages fewer."""
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)    # [rows, layers, ...] -> [layers, rows, ...]
        tables = all_tables[slots]
        view_tables, view_hist = tables[..., :table_width], hist_lengths
        if self.compacts_turns:
            cols = jnp.arange(table_width)
            first = (turn_hist // self.layout.page_size)[..., None]
            jump = jnp.where(cols > first, view_skip[..., None], 0)
            view_tables = jnp.take_along_axis(
                tables, jnp.minimum(cols + jump, tables.shape[-1] - 1), axis=-1)
            view_hist = hist_lengths - view_skip * self.layout.page_size
        return (per_layer(view_tables),
                per_layer(tables if self.plans_prefill_writes else tables[..., :table_width]),
                per_layer(hist_lengths), per_layer(view_hist), per_layer(turn_hist),
                per_layer(keep_counts), work_items)

    def _row_scores(self, obs_probs, q, k, v, chunk_len, num_protected, first_position, keep):
        """Scores [num_kv_heads, T] of one compression chunk and the tokens each group keeps
        [groups] (`tangram_jax.compression.chunk_scoring`, by the runner's method; dynamic mode
        decides the count on the device). obs_probs [Hq, obs_window, T]; q, k, v the row's
        [T, heads, d] (padded); first_position: the row's first token position."""
        scores = chunk_scores(self.runner_config.method, obs_probs, q, k, v, chunk_len,
                              num_protected, first_position, q_per_kv=self.config.q_per_kv,
                              inv_freq=self._inv_freq, rule=self.runner_config.scoring_rule)
        if self.runner_config.mode == "dynamic":
            # One count for every head of the layer: under tensor parallelism it is decided
            # over all devices' heads (the selection does not depend on the heads' order).
            every_head = (jax.lax.all_gather(scores, AXIS, axis=0, tiled=True)
                          if self.placement.tp > 1 else scores)
            count = dynamic_keep_count(every_head, chunk_len, num_protected,
                                       self.runner_config.dynamic_ratio,
                                       self.runner_config.dynamic_safeguard)
            return scores, jnp.full(keep.shape, count, jnp.int32)
        return scores, keep

    def _table_width(self, max_tokens: int, *, prefill: bool) -> int:
        """Block-table columns a step passes to attention when rows hold at most `max_tokens`
        retained tokens per group (history plus what the step writes).

        The Pallas decode kernel reads only the pages a row's length covers, and so does the
        CPU path's attention (`xla_attention` walks a row's table in blocks and skips those
        past its length): both get the whole table (one compiled shape). Where attention
        first gathers every column of the rows' tables into a dense history
        (`_reads_dense_history`: precision tiers on the CPU path, quantised pools in the
        Pallas prefill), the width is the pages `max_tokens` needs, rounded up to a power of
        two and at least `_dense_width_floor` pages, so a step dequantises what its rows hold,
        not `max_model_len`, and few widths compile.
        """
        full = int(self.block_tables.shape[-1])
        if not self._reads_dense_history(prefill):
            return full
        pages = -(-max(int(max_tokens), 1) // self.layout.page_size)
        return min(full, max(self._dense_width_floor, backend.next_power_of_2(pages)))

    def _table_widths(self, *, prefill: bool) -> list[int]:
        """Every width `_table_width` returns for prefill (or decode) steps: the shapes
        warm-up compiles."""
        full = int(self.block_tables.shape[-1])
        if not self._reads_dense_history(prefill):
            return [full]
        return _doublings(min(self._dense_width_floor, full), full)

    def _reads_dense_history(self, prefill: bool) -> bool:
        """Whether a step's attention gathers its rows' table columns into a dense history:
        the CPU path over precision tiers (`kv_quant.tiered_dense_history`, prefill and
        decode), and the Pallas prefill over a quantised or tiered pool (`prefill_attention.
        dense_history`: the kernel reads one dense page format)."""
        if self.ops.name == "pallas":
            return prefill and not self.dense_pool
        return self.tiers is not None

    @property
    def _dense_width_floor(self) -> int:
        """The narrowest dense-history width (pages): `_MIN_TABLE_WIDTH` on the CPU path; on
        the Pallas path an eighth of the table rounded up to a power of two (at most 4 widths a
        prefill shape compiles: each adds seconds of warm-up on the 8B model, 50-120 s in all
        on an H100, and a dense history of an eighth of `max_model_len` costs little beside a
        chunk's attention)."""
        if self.ops.name != "pallas":
            return _MIN_TABLE_WIDTH
        return max(_MIN_TABLE_WIDTH,
                   backend.next_power_of_2(-(-int(self.block_tables.shape[-1]) // 8)))


def _doublings(first: int, last: int) -> list[int]:
    """first, 2 first, 4 first, ... below `last`, then `last`: the sizes a few compiled
    shapes cover."""
    sizes = []
    while first < last:
        sizes.append(first)
        first *= 2
    return sizes + [last]


def _apply_planned_writes(k_pages, v_pages, writes):
    """Scatter a CPU prefill's planned writes (one (where, rows) per row, stacked over the
    layers) into the pool, in place (the pool is donated)."""
    for where, rows_kv in writes:
        k_pages, v_pages = apply_chunk_writes(k_pages, v_pages, where, rows_kv)
    return k_pages, v_pages


def _reference_write(k_chunk, v_chunk, dest, k_pages, v_pages, block_table, *, max_dirty):
    """`write_chunk_into_pages`'s signature over its pure-jnp scatter (`max_dirty` unused)."""
    from tangram_jax.pallas_kernels.chunk_compress import write_chunk_into_pages_reference
    del max_dirty
    return write_chunk_into_pages_reference(k_chunk, v_chunk, dest, k_pages, v_pages,
                                            block_table)
