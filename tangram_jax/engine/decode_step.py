"""The runner's decode programs, the mixed step, and token sampling.

`DecodeSteps` is the half of `ModelRunner` that produces tokens: `decode` (one token for a
padded bucket of sequences, its input read from the device's `slot_state`, attention split by
the bucket's AOT split map), the mixed step of the CPU path (prefill rows and decode rows as
one program: `_run_mixed`, `_mixed_impl`), and `sample` (the first token of prompts that
ended). A decode step is two programs: the forward pass to the logits, then the sampler
(`_sample_into_slots`), compiled twice: each row's argmax where the host sees that no row
samples or adjusts its logits (`_sampling_rows`), and the general sampler otherwise (every
row's penalties and the vocabulary sort). Neither holds a conditional: a device-side branch
makes the host wait for its predicate before it launches the rest of the program, so the next
step's launch is not hidden behind this one's work (27% of the 8B step at batch 64 on an
H200: `benchmarks/NOTES_engine.md`, "Sampling's conditionals").
`decode_split_map(s)` build the split maps the decode kernel is compiled with; `_copy_pages`
copies a fork's partly filled pages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from tangram_jax import kv_quant
from tangram_jax.kv_layout import TieredLayout
from tangram_jax.engine.tensor_parallel import AXIS
from tangram_jax.pallas_kernels import backend
from tangram_jax.pallas_kernels.decode_pools import decode_programs
from tangram_jax.pallas_kernels.split_map import (build_split_map, build_tier_split_map,
                                                  uniform_split_map)
from tangram_jax.sampling import (LogitsAdjust, TokenLogprobs, adjusting_rows, force_tokens,
                                  neutral_adjust, pack_rows, record_tokens, sample_tokens,
                                  step_keys, token_logprobs, unpack_rows)


# What a step computes besides its tokens: nothing, the chosen and top log-probs, or also the
# whole [rows, vocab] log-softmax (each a separately compiled variant of the step).
LOGPROB_MODES = (None, "top", "full")


class DecodeSteps:
    """Decode half of `ModelRunner` (a mixin: it reads the runner's state: layout, pool,
    tables, ops, placement, split maps)."""

    _pool_spec = P(None, AXIS)   # every pool array (codes, scales) split on its head axis G

    @staticmethod
    def _decode_attention(q, k, v, k_pages, v_pages, tables, lens, work, terms, *,
                          decode_attention, use_work, tiered=None, high_items=0):
        """One layer's decode attention on one device's heads (all of them without tensor
        parallelism): append the new token's K/V at slot `lens` of every group, attend.
        q [B, 1, Hq, d], k/v [B, 1, Hkv, d] (this device's heads, group-major); k/v_pages
        [num_pages, G, page_size, d] (this device's G); tables [B, groups, P]; lens [B, groups].
        terms: the layer's window and sinks (`_attention_terms`). Returns (out [B, 1, Hq, d],
        k_pages, v_pages).

        tiered: precision tiers (`kv_quant.TieredPages`; tables and lens of tier groups),
        attended by the Pallas decode kernel (``"pallas"``: one launch over both pools, work the
        high tier's `high_items` rows then the low tier's, `SplitMap.tier_work_lists`) or, on
        the CPU path, as one dense history. The token goes to the high tier."""
        batch = lens.shape[0]
        if tiered is None:
            k_pages, v_pages = DecodeSteps._append_token(k, v, k_pages, v_pages, tables, lens)
            qg = q[:, 0].reshape(batch, lens.shape[1], -1, q.shape[-1])
            out = decode_attention(qg, k_pages, v_pages, tables, lens + 1,
                                   work if use_work else None, **terms)
            return out.reshape(batch, 1, -1, q.shape[-1]), k_pages, v_pages
        k_high, v_high = DecodeSteps._append_token(k, v, k_pages.high, v_pages.high,
                                                   tables[:, 0::2], lens[:, 0::2])
        k_pages = kv_quant.TieredPages(k_high, k_pages.low)
        v_pages = kv_quant.TieredPages(v_high, v_pages.low)
        seen = lens + (jnp.arange(lens.shape[1]) % 2 == 0)        # the new token is high
        qg = q[:, 0].reshape(batch, lens.shape[1] // 2, -1, q.shape[-1])
        if tiered == "pallas":
            out = decode_attention(qg, k_pages, v_pages, tables, seen,
                                   (work[:high_items], work[high_items:]), **terms)
        else:
            out = decode_attention(qg, *kv_quant.tiered_dense_history(
                k_pages, v_pages, tables, seen, jnp.float32), None, **terms)
        return out.reshape(batch, 1, -1, q.shape[-1]), k_pages, v_pages

    @staticmethod
    def _append_token(k, v, k_pages, v_pages, tables, lens):
        """Write each row's new K/V (k/v [B, 1, Hkv, d]) at slot `lens` [B, groups] of its
        groups' pages (tables [B, groups, P]); returns the pools."""
        batch, n_groups = lens.shape
        g, ps = k_pages.shape[1], k_pages.shape[2]
        # Padded rows write into the null page 0, which nothing reads as valid.
        page = jnp.take_along_axis(tables, (lens // ps)[..., None], axis=-1)[..., 0]
        offset = lens % ps
        heads = jnp.arange(g)[None, None, :]
        k_new = k[:, 0].reshape(batch, n_groups, g, -1).astype(k_pages.dtype)
        v_new = v[:, 0].reshape(batch, n_groups, g, -1).astype(v_pages.dtype)
        slots = (page[..., None], heads, offset[..., None])
        return (kv_quant.write_slots(k_pages, slots, k_new),    # quantised if the pool is
                kv_quant.write_slots(v_pages, slots, v_new))

    def decode(self, positions: np.ndarray, slots: np.ndarray, lengths: np.ndarray,
               temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               seeds: np.ndarray, steps: np.ndarray, *, forced_tokens: np.ndarray | None = None,
               logprobs: str | None = None, adjust: LogitsAdjust | None = None,
               ) -> jax.Array | tuple[jax.Array, TokenLogprobs]:
        """One decode step for a padded batch (the bucket is `len(slots)`).

        Each row's input token is its slot's last sampled token (`slot_state`, on the device),
        and the token sampled here replaces it (and is counted in the slot's penalty row), so
        nothing waits for the host.
        positions: int [B] position of each row's input token; slots: int [B] rows of the block
        table (padded rows: the manager's null slot); lengths: int32 [B, layers, groups]
        retained tokens before this step (pages for the new token already reserved).
        Sampling arrays [B] as in `tangram_jax.sampling`. forced_tokens: int [B], the token row
        i must take (teacher forcing; -1: sample), default none. logprobs: one of
        `LOGPROB_MODES`. adjust: the rows' penalties / min_tokens / min_p (None: nobody's; the
        same program either way). Returns next tokens [B'] (device), and with `logprobs` set also their
        `TokenLogprobs` (device arrays, the model's distribution at each row): B' = B, or a
        larger bucket while B's program compiles in the background (`_ready`; rows past B are
        padding).
        """
        covering = self._ready_decode_bucket(len(slots))
        if covering != len(slots):
            (positions, slots, lengths, temperature, top_k, top_p, seeds, steps,
             forced_tokens, adjust) = self._pad_decode_rows(
                covering - len(slots), positions, slots, lengths, temperature, top_k, top_p,
                seeds, steps, forced_tokens, adjust)
        _check_logprob_mode(logprobs)
        args, static = self._decode_call(self.k_pages, self.v_pages, positions, slots, lengths)
        self.k_pages, self.v_pages, logits = self._decode(*args, **static)
        rows, greedy = _sampling_rows(temperature, top_k, top_p, seeds, steps, forced_tokens,
                                      adjust, len(slots))
        self.slot_state, next_tokens, lp = self._sample_rows(
            self.slot_state, logits, np.asarray(slots, np.int32), rows, logprobs=logprobs,
            greedy=greedy)
        return next_tokens if logprobs is None else (next_tokens, lp)

    def _ready_decode_bucket(self, bucket: int) -> int:
        """`bucket`, or while its decode program compiles in the background (warm-up's
        `background`), the smallest larger bucket whose program is compiled."""
        if self._ready("bucket", bucket):
            return bucket
        return next((b for b in sorted(self.runner_config.decode_buckets)
                     if b > bucket and self._ready("bucket", b)),
                    self._covered_by[("bucket", bucket)])

    def _pad_decode_rows(self, extra: int, positions, slots, lengths, temperature, top_k,
                         top_p, seeds, steps, forced_tokens, adjust) -> tuple:
        """`decode`'s row arrays with `extra` padding rows (the null slot, greedy, no
        history), as the scheduler pads a batch to its bucket."""
        pad = lambda x, fill: np.concatenate([np.asarray(x), fill])
        lengths = np.asarray(lengths)
        sampling = [pad(x, fill) for x, fill in zip((temperature, top_k, top_p, seeds, steps),
                                                    _greedy(extra))]
        return (pad(positions, np.zeros(extra, np.int32)),
                pad(slots, np.full(extra, self.null_slot, np.int32)),
                pad(lengths, np.zeros((extra, *lengths.shape[1:]), lengths.dtype)), *sampling,
                None if forced_tokens is None else pad(forced_tokens,
                                                       np.full(extra, -1, np.int32)),
                None if adjust is None else LogitsAdjust(*(
                    pad(x, fill) for x, fill in zip(adjust, neutral_adjust(extra)))))

    def _decode_call(self, k_pages, v_pages, positions, slots,
                     lengths) -> tuple[tuple, dict]:
        """`_decode`'s positional inputs and static arguments (the bucket is `len(slots)`)."""
        bucket = len(slots)
        split_map = self.split_maps.get(bucket) if self.ops.name == "pallas" else None
        if self.ops.name == "pallas" and split_map is None:
            raise ValueError(f"no split map for decode bucket {bucket}; have "
                             f"{sorted(self.split_maps)}")
        args = (*self.weight_args, k_pages, v_pages, self.slot_state,
                np.asarray(positions, np.int32), self.block_tables, np.asarray(slots, np.int32),
                np.asarray(lengths, np.int32))
        return args, dict(split_map=split_map,
                          table_width=self._table_width(int(np.max(lengths, initial=0)) + 1,
                                                        prefill=False))

    def _decode_layer_attention(self, split_map) -> Callable:
        """One layer's decode attention (`_decode_attention`) run per device: ``attend(q, k, v,
        k_pages, v_pages, tables, lens, work) -> (out, k_pages, v_pages)``."""
        heads = P(None, None, AXIS, None)          # [B, 1, heads, d]: heads over the devices
        return self.placement.per_device(
            functools.partial(self._decode_attention, decode_attention=self.ops.decode_attention,
                              use_work=split_map is not None,
                              tiered=None if self.tiers is None else self.ops.name,
                              high_items=split_map.tier_work_lists()[0].shape[1]
                              if self.tiers is not None and split_map is not None else 0),
            in_specs=(heads, heads, heads, self._pool_spec, self._pool_spec, P(), P(), P(),
                      self._terms_spec),
            out_specs=(heads, self._pool_spec, self._pool_spec))

    def _decode_impl(self, state, layer_states, k_pages, v_pages, slot_state, positions,
                     all_tables, slots, lengths, *, split_map, table_width):
        """The forward pass of a decode step: (k_pages, v_pages, logits float32 [B, vocab]);
        `_sample_into_slots` chooses the tokens."""
        state, layer_states = self._weight_trees(state, layer_states)
        model = nnx.merge(self.graphdef, state)
        tokens = slot_state.tokens[slots]
        block_tables = all_tables[slots][..., :table_width]   # [B, layers, groups, width]
        layout = self.layout
        # The AOT work lists are constants of the trace ([layers, items, 3]); the references
        # take none (a dummy keeps the scan's inputs uniform).
        # With precision tiers each layer's row is the high tier's list then the low tier's.
        work_lists = (jnp.zeros((layout.num_layers, 1, 3), jnp.int32) if split_map is None else
                      jnp.asarray(split_map.work_lists()) if self.tiers is None else
                      jnp.asarray(np.concatenate(split_map.tier_work_lists(), axis=1)))
        attend = self._decode_layer_attention(split_map)

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry
            layer_state, tables, lens, work = xs          # [B, Gn, P], [B, Gn], [items, 3]
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, positions[:, None])
            out, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, tables, lens, work,
                                           self._attention_terms(layer))
            h = layer.finish(h, out.astype(h.dtype))
            return (h, k_pages, v_pages), None

        h = model.embed(tokens[:, None])
        (h, k_pages, v_pages), _ = self._over_layers(
            layer_step, (h, k_pages, v_pages),
            (layer_states, jnp.swapaxes(block_tables, 0, 1), jnp.swapaxes(lengths, 0, 1),
             work_lists))
        return k_pages, v_pages, model.logits(h)[:, 0]

    # ----- a mixed step: prefill rows and decode rows in one program (the CPU path) -------------
    def _run_mixed(self, tokens, start_positions, slots, hist_lengths, num_protected,
                   decode: dict, turn_rows=None) -> tuple:
        """`prefill` of these rows and `decode(**decode)` as one program (`_mixed_impl`)."""
        decode = dict(decode)
        positions, d_slots, lengths = (decode.pop(k) for k in ("positions", "slots", "lengths"))
        sampling = [decode.pop(k) for k in ("temperature", "top_k", "top_p", "seeds", "steps")]
        logprobs = decode.pop("logprobs", None)
        forced, adjust = decode.pop("forced_tokens", None), decode.pop("adjust", None)
        if decode:
            raise ValueError(f"unknown decode arguments {sorted(decode)}")
        if set(int(s) for s in slots) & set(int(s) for s in d_slots if s != self.null_slot):
            raise ValueError("a mixed step's prefill and decode rows must be distinct sequences")
        prefill_args, prefill_static = self._prefill_args(
            tokens, start_positions, slots, hist_lengths, num_protected, None, self.k_pages,
            self.v_pages, turn_rows)
        _check_logprob_mode(logprobs)
        decode_args, decode_static = self._decode_call(self.k_pages, self.v_pages, positions,
                                                       d_slots, lengths)
        # The mixed step decides its sampler on the device (`_choose_tokens`' conditionals): it
        # runs on the CPU, where a conditional costs the host no wait on a device.
        rows, _ = _sampling_rows(*sampling, forced, adjust, len(d_slots))
        # One width for both parts: where steps mix it is the whole table (`_table_width`).
        prefill_static = dict(prefill_static, table_width=max(
            prefill_static["table_width"], decode_static["table_width"]))
        logits, kept, next_tokens, lp = self._call_mixed(prefill_args, prefill_static,
                                                         decode_args, decode_static, rows,
                                                         logprobs)
        return logits, kept, (next_tokens if logprobs is None else (next_tokens, lp))

    @property
    def mixes_steps(self) -> bool:
        """Whether a step's last prefill call and its decode rows run as one program (`prefill`
        with `decode`): the CPU path, where the two programs of a mixed step each read every
        weight and walk every layer (a decode step at batch 8 is ~0.15 s of that on the
        embedded model). Not with precision tiers (their attention reads a dense history of a
        per-width table) nor tensor parallelism; the Pallas path keeps its two programs."""
        return self.ops.name == "xla" and self.tiers is None and self.placement.tp == 1

    def _mixed_args(self, prefill_args: tuple, prefill_static: dict, decode_args: tuple,
                    decode_static: dict, d_rows: np.ndarray,
                    logprobs: str | None) -> tuple[tuple, dict]:
        """`_mixed`'s inputs and static arguments from a prefill call's and a decode call's
        (`_prefill_args`, `_decode_call`) over the same pool, and the decode rows' sampling
        (`_sampling_rows`' packed rows, a logprob mode)."""
        (state, layer_states, k_pages, v_pages, flat, positions, row_starts, lens, protected,
         tables, row_slots, hist, keep, items, held_protected, turn_hist, view_skip) = prefill_args
        (_, _, _, _, slot_state, d_positions, _, d_slots, d_lengths) = decode_args
        return ((state, layer_states, k_pages, v_pages, slot_state, tables, flat, positions,
                 row_starts, lens, protected, row_slots, hist, keep, items, held_protected,
                 turn_hist, view_skip, d_positions, d_slots, d_lengths, d_rows),
                dict(table_width=prefill_static["table_width"],
                     region_pages=prefill_static["region_pages"],
                     logprobs=logprobs))

    def _mixed_impl(self, state, layer_states, k_pages, v_pages, slot_state, all_tables,
                    tokens, positions, row_starts, row_lens, num_protected, slots, hist_lengths,
                    keep_counts, work_items, held_protected, turn_hist, view_skip, d_positions,
                    d_slots, d_lengths, d_rows, *, table_width, region_pages, logprobs):
        """A prefill call (`_prefill_impl`'s inputs, N flat tokens) and a decode step
        (`_decode_impl`'s, B rows) in one forward: per layer the projections of all N + B
        tokens in one matmul, the decode rows' attention (their token appended to the pool
        first), the prefill rows' attention over the pool, and o-proj + MLP of all tokens in
        one matmul. Returns (k_pages, v_pages, slot_state, next_tokens [B], lp, writes or None,
        prefill logits [rows, vocab], kept [rows, layers, groups]): the decode step's results,
        then the prefill's (`_prefill_impl`: its planned writes, or None where it wrote in
        place). Mixed steps exist where `_table_width` is the whole table, so both parts read
        `table_width` columns.

        Order inside a layer: the decode rows write their token, then both parts read the pool.
        Their pages are disjoint (distinct sequences), but the order matters to XLA: a read
        before a write of the same buffer in one loop iteration makes it copy the pool."""
        state, layer_states = self._weight_trees(state, layer_states)
        temperature, top_k, top_p, seeds, steps, forced, adjust = unpack_rows(d_rows)
        model = nnx.merge(self.graphdef, state)
        rows, n = row_starts.shape[0], tokens.shape[0]
        planned = self.plans_prefill_writes
        prefill_attend = self._prefill_layer_attention(rows, n, k_pages, region_pages)
        decode_attend = self._decode_layer_attention(None)
        no_work = jnp.zeros((1, 3), jnp.int32)           # the CPU path's decode takes none
        d_tokens = slot_state.tokens[d_slots]
        all_positions = jnp.concatenate([positions, d_positions])

        def layer_step(carry, xs):
            h, k_pages, v_pages = carry                     # h [1, N + B, hidden]
            (layer_state, tables, write_tables, hist, view_hist, turn_hist, keep, items, d_tables,
             d_lens) = xs
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, all_positions[None])     # one GEMM over both parts' tokens
            terms = self._attention_terms(layer)
            d_out, k_pages, v_pages = decode_attend(
                q[0, n:, None], k[0, n:, None], v[0, n:, None], k_pages, v_pages, d_tables,
                d_lens, no_work, terms)
            out, k_pages, v_pages, kept, plans, questions = prefill_attend(
                q[0, :n], k[0, :n], v[0, :n], k_pages, v_pages, tables, write_tables, hist,
                view_hist, turn_hist, keep, items, row_starts, row_lens, num_protected,
                held_protected, positions, terms)
            out = jnp.concatenate([out, d_out[:, 0].astype(out.dtype)])
            h = layer.finish(h, out[None].astype(h.dtype))
            return (h, k_pages, v_pages), (kept, plans or None, questions or None)

        h = model.embed(jnp.concatenate([tokens, d_tokens])[None])
        per_layer = lambda x: jnp.swapaxes(x, 0, 1)
        layer_inputs = self._prefill_layer_inputs(all_tables, slots, hist_lengths, turn_hist,
                                                  keep_counts, work_items, table_width,
                                                  view_skip)
        (h, k_pages, v_pages), (kept, plans, questions) = self._over_layers(
            layer_step, (h, k_pages, v_pages),
            (layer_states, *layer_inputs, per_layer(all_tables[d_slots][..., :table_width]),
             per_layer(d_lengths)))
        k_pages, v_pages, plans = self._after_layers(k_pages, v_pages, plans, questions,
                                                     layer_inputs, row_lens, num_protected,
                                                     held_protected, region_pages)
        last = h[0, jnp.clip(row_starts + row_lens - 1, 0, n - 1)]        # [rows, hidden]
        logits = model.logits(jnp.concatenate([last, h[0, n:]])[:, None])[:, 0]
        d_logits = logits[rows:]
        next_tokens, lp = _choose_tokens(d_logits, temperature, top_k, top_p, seeds, steps,
                                         forced, logprobs, adjust,
                                         (slot_state.penalties, d_slots))
        return (k_pages, v_pages, record_tokens(slot_state, d_slots, next_tokens), next_tokens, lp,
                plans if planned else None, logits[:rows], per_layer(kept))

    def _call_mixed(self, prefill_args, prefill_static, decode_args, decode_static, d_rows,
                    logprobs) -> tuple:
        """Run `_mixed` on the held pool (and apply the prefill's planned writes); returns
        (logits, kept, next_tokens, lp)."""
        args, static = self._mixed_args(prefill_args, prefill_static, decode_args, decode_static,
                                        d_rows, logprobs)
        (self.k_pages, self.v_pages, self.slot_state, next_tokens, lp, writes, logits,
         kept) = self._mixed(*args, **static)
        if writes is not None:
            self.k_pages, self.v_pages = self._apply_writes(self.k_pages, self.v_pages, writes)
        return logits, kept, next_tokens, lp

    # ----- sampling of prefill logits -----------------------------------------------------
    def sample(self, logits: list[jax.Array], slots, temperature, top_k, top_p, seeds,
               steps, *, forced_tokens=None, logprobs: str | None = None,
               adjust: LogitsAdjust | None = None) -> jax.Array | tuple[jax.Array, TokenLogprobs]:
        """Sample the first token of sequences whose prefill just ended (logits: list of [V],
        slots: int [n] their block-table rows, which remember the token for the next decode;
        sampling arrays [n]; forced_tokens, logprobs and adjust (rows [n]) as in `decode`). Rows are padded to a
        power of two (padding rows repeat row 0 and write to the null slot). Returns tokens
        [rows] (device), the first n the samples (and their `TokenLogprobs` when asked)."""
        _check_logprob_mode(logprobs)
        n = len(logits)
        pick = _pad_rows(n)
        rows = lambda x, dtype: np.asarray(x, dtype)[pick]
        padded_slots = rows(slots, np.int32)
        padded_slots[n:] = self.null_slot
        forced = rows(np.full(n, -1) if forced_tokens is None else forced_tokens, np.int32)
        adjust = neutral_adjust(n) if adjust is None else adjust
        packed, greedy = _sampling_rows(
            rows(temperature, np.float32), rows(top_k, np.int32), rows(top_p, np.float32),
            rows(seeds, np.uint32), rows(steps, np.int32), forced,
            LogitsAdjust(*(np.asarray(x)[pick] for x in adjust)), len(pick))
        self.slot_state, tokens, lp = self._sample_rows(
            self.slot_state, jnp.stack([logits[i] for i in pick]), padded_slots, packed,
            logprobs=logprobs, greedy=greedy)
        return tokens if logprobs is None else (tokens, lp)


def _greedy(rows: int) -> tuple[np.ndarray, ...]:
    """Sampling arrays (temperature, top_k, top_p, seeds, steps) of `rows` greedy rows."""
    return (np.zeros(rows, np.float32), np.full(rows, -1, np.int32), np.ones(rows, np.float32),
            np.zeros(rows, np.uint32), np.zeros(rows, np.int32))


def _greedy_rows(rows: int) -> np.ndarray:
    """`_sampling_rows`' packed arrays of `rows` greedy rows: what programs are lowered with."""
    return _sampling_rows(*_greedy(rows), None, None, rows)[0]


def _pad_rows(n: int) -> list[int]:
    """Row order for `n` rows padded to a power of two by repeating row 0 (few shapes compile)."""
    return list(range(n)) + [0] * (backend.next_power_of_2(n) - n)


def _check_logprob_mode(logprobs) -> None:
    if logprobs not in LOGPROB_MODES:
        raise ValueError(f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")


def _choose_tokens(logits, temperature, top_k, top_p, seeds, steps, forced, logprobs,
                   adjust, penalties, greedy: bool | None = None):
    """Each row's token (sampled after `adjust` with the rows' `penalties`, a (table, slots)
    pair, or forced where ``forced >= 0``) and, with `logprobs` set, the model's
    log-probabilities at that row (computed here on the device). `greedy` (static), decided
    on the host (`_sampling_rows`): True, every row is greedy and adjusts nothing, so each
    takes its argmax, the token `sample_tokens` would choose; False, every row's penalties and
    the vocabulary sort, without `sample_tokens`' conditionals (rows that change nothing come
    out as they would there); None: `sample_tokens` decides on the device."""
    decided = None if greedy is None else True
    chosen = (jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32) if greedy
              else sample_tokens(logits, temperature, top_k, top_p, step_keys(seeds, steps),
                                 adjust, penalties, adjusts=decided, samples=decided))
    tokens = force_tokens(chosen, forced)
    lp = None if logprobs is None else token_logprobs(logits, tokens, full=logprobs == "full")
    return tokens, lp


def _sample_into_slots(slot_state, logits, slots, rows, *, logprobs, greedy):
    """Choose the tokens of `logits` [B, vocab] (rows: `_sampling_rows`' int32 [11, B]) and
    record them in their `slots` [B] (padding rows: the null slot, never read); returns
    (slot_state, tokens [B], `TokenLogprobs` or None)."""
    temperature, top_k, top_p, seeds, steps, forced, adjust = unpack_rows(rows)
    tokens, lp = _choose_tokens(logits, temperature, top_k, top_p, seeds, steps, forced, logprobs,
                                adjust, (slot_state.penalties, slots), greedy)
    return record_tokens(slot_state, slots, tokens), tokens, lp


def _sampling_rows(temperature, top_k, top_p, seeds, steps, forced_tokens,
                   adjust: LogitsAdjust | None, rows: int) -> tuple[np.ndarray, bool]:
    """(the rows' sampling arrays packed for the device (`pack_rows`, int32 [11, rows]),
    greedy): greedy when no row samples (temperature 0) nor adjusts its logits (penalties,
    min_tokens' mask), decided here on the host. forced_tokens [rows] or None (none);
    adjust: None (none)."""
    forced = (np.full(rows, -1, np.int32) if forced_tokens is None
              else np.asarray(forced_tokens, np.int32))
    adjust = neutral_adjust(rows) if adjust is None else adjust
    greedy = bool(np.all(np.asarray(temperature) <= 0)) and not np.any(
        adjusting_rows(LogitsAdjust(*map(np.asarray, adjust))))
    return pack_rows(temperature, top_k, top_p, seeds, steps, forced, adjust), greedy



@functools.partial(jax.jit, donate_argnums=(0, 1))
def _copy_pages(k_pages, v_pages, src, dst):
    """The pool with pages `dst` overwritten by pages `src` (int32 [n]; a `dst` out of range is
    padding, dropped): a fork's copies of partly filled pages (`KVCacheManager.fork`). Every
    array of a page format (quantised codes and scales too) has the page axis first. With
    precision tiers the copies are of the high tier's pool (the decode tier's pages, page ids
    of that pool); the low tier's is left alone."""
    pools = kv_quant.tier_pools(k_pages, v_pages)
    pools[0] = jax.tree.map(lambda pages: pages.at[dst].set(pages[src], mode="drop"), pools[0])
    return kv_quant.from_tier_pools(pools)


def decode_split_map(layout, model_config, dtype, num_programs: int, batch: int, *,
                     group_size: int, pool_format: kv_quant.PoolFormat = kv_quant.pool_format(
                         "bf16")):
    """The AOT split map of decode bucket `batch`: over the layout's groups weighed by their
    budgets (every group holds one page format, whose measured program target
    `decode_programs` sizes the map), or, with precision tiers, over its tier groups weighed by
    the bytes each is expected to read (`build_tier_split_map`: each tier is read by its own
    launch). group_size: the KV heads of a group on one device."""
    if pool_format.tiered != isinstance(layout, TieredLayout):
        raise ValueError(f"pool format {pool_format.precision!r} and layout {layout.name!r} "
                         f"disagree on precision tiers")
    if not pool_format.tiered:
        return build_split_map(layout.group_budgets,
                               decode_programs(pool_format.precision, num_programs),
                               batch, group_size=group_size)
    tier_bytes = pool_format.page_bytes(1, 1, model_config.head_dim, jnp.dtype(dtype))
    return build_tier_split_map(layout.base.group_budgets, layout.high_share, tier_bytes,
                                num_programs, batch, group_size=group_size)


def decode_split_maps(layout, model_config, dtype, num_programs: int, buckets, *,
                      group_size: int, pool_format: kv_quant.PoolFormat = kv_quant.pool_format(
                          "bf16"), kind: str = "aot") -> dict:
    """{bucket: SplitMap} of every decode bucket (`decode_split_map`); kind ``uniform``: as many
    items per row as the AOT map, cut evenly across the groups (the ablation baseline)."""
    maps = {b: decode_split_map(layout, model_config, dtype, num_programs, b,
                                group_size=group_size, pool_format=pool_format)
            for b in buckets}
    if kind == "uniform":
        maps = {b: dataclasses.replace(
            uniform_split_map(model_config.num_layers, m.num_groups,
                              max(1, m.num_items // m.num_groups), tiered=m.tiered), batch=b)
            for b, m in maps.items()}
    return maps
