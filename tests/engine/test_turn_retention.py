"""Retention "turn" (`kv_layout`): a turn's chunks are held whole and its last chunk
compresses the whole turn; the counts are the layout's, the reservation covers the peak and the
staging comes back, the decisions do not depend on how the turn was chunked, and the writes to
destination slots are exact against loop-by-loop numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax import kv_quant
from tangram_jax.kv_layout import KVLayout
from tangram_jax.pallas_kernels.chunk_compress import (contiguous_dirty_pages, page_writes,
                                                       write_chunk_into_pages,
                                                       write_chunk_into_pages_reference)


def _layout(budgets, chunk=16, retention="turn", tail=4):
    budgets = np.asarray(budgets, float)
    layers, groups = budgets.shape
    return KVLayout(num_layers=layers, num_kv_heads=groups, head_dim=8, group_size=1,
                    page_size=4, chunk_size=chunk, head_perm=np.tile(np.arange(groups),
                                                                     (layers, 1)),
                    group_budgets=budgets, tail_rule="window", tail_window=tail,
                    retention=retention)


@pytest.mark.parametrize("turn_len", [1, 5, 16, 17, 60, 100, 257])
def test_turn_counts_hold_the_turn_then_keep_its_count_however_it_is_chunked(turn_len):
    budgets = np.asarray([[0.25, 0.5, 1.0], [0.1, 0.33, 0.7]])
    finals = []
    for chunk in (8, 16, 64):
        layout = _layout(budgets, chunk)
        tail = layout.protected_tail(turn_len)
        u = turn_len - tail
        final = layout.retained_counts(turn_len)
        want = np.minimum(u, np.ceil(budgets * u - 1e-6)).astype(int)
        want = np.where(u > 0, np.maximum(want, 1), 0) + tail
        np.testing.assert_array_equal(final, want)
        finals.append(final)
        np.testing.assert_array_equal(layout.peak_retained_counts(turn_len),
                                      np.full(budgets.shape, turn_len))
        # Every chunk but the last is held whole; the last brings the turn to its count.
        edges = list(range(0, turn_len, chunk)) + [turn_len]
        pieces = [layout.piece_retained_counts(turn_len, a, b) for a, b in zip(edges, edges[1:])]
        for p, a, b in zip(pieces[:-1], edges, edges[1:]):
            np.testing.assert_array_equal(p, b - a)
        np.testing.assert_array_equal(sum(pieces), final)
    for f in finals[1:]:
        np.testing.assert_array_equal(f, finals[0])


def test_chunk_retention_keeps_a_share_of_every_chunk():
    layout = _layout([[0.25]], chunk=16, retention="chunk", tail=4)
    # 64 tokens: 60 unprotected = 3 chunks of 16 (4 each) + 12 (3) + 4 protected.
    np.testing.assert_array_equal(layout.retained_counts(64), [[4 * 3 + 3 + 4]])
    np.testing.assert_array_equal(layout.peak_retained_counts(64), [[19]])
    np.testing.assert_array_equal(_layout([[0.25]], chunk=16).retained_counts(64), [[15 + 4]])


def test_segment_peaks_count_what_earlier_segments_keep():
    layout = _layout([[0.25]], chunk=16)
    # A turn of 40 (keeps ceil(.25 * 36) + 4 = 13), 5 decode tokens, a turn of 20 (4 + 4).
    segments = [(40, True), (5, False), (20, True)]
    np.testing.assert_array_equal(layout.segments_retained_counts(segments), [[13 + 5 + 8]])
    np.testing.assert_array_equal(layout.segments_peak_counts(segments), [[max(40, 13 + 5 + 20)]])


@pytest.mark.parametrize("precision", ["bf16", "k8v4", "k4v2"])
@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_scattered_writes_touch_only_their_slots(precision, use_kernel):
    """Rows written to any slots (destinations need not be consecutive): exactly those slots of
    K and V change, on a NaN-poisoned pool, kernel (interpreted on a CPU, compiled on a GPU)
    and reference."""
    rng = np.random.default_rng(0)
    t, heads, d, g, ps, max_pages = 12, 4, 16, 2, 4, 8
    groups = heads // g
    num_pages = groups * max_pages + 2
    table = rng.permutation(num_pages)[:groups * max_pages].reshape(groups, max_pages)
    dest = np.full((heads, t), -1)
    for h in range(heads):
        chosen = rng.choice(t, size=int(rng.integers(0, t + 1)), replace=False)
        dest[h, chosen] = rng.choice(max_pages * ps, size=len(chosen), replace=False)
    k = rng.standard_normal((t, heads, d)).astype(np.float32)
    v = rng.standard_normal((t, heads, d)).astype(np.float32)
    pool = np.full((num_pages, g, ps, d), np.nan, np.float32)
    fmt = kv_quant.page_format(precision)
    pools = [kv_quant.quantise_pages(jnp.asarray(pool), bits, jnp.float32, groups,
                                     fmt.code_unit, fmt.slot_pairs)
             for bits, groups in ((fmt.key_bits, 1), (fmt.value_bits, fmt.value_groups))]
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(dest, jnp.int32), *pools,
            jnp.asarray(table, jnp.int32))
    if use_kernel:
        out = write_chunk_into_pages(*args, max_dirty=t + contiguous_dirty_pages(t, ps))
    else:
        out = write_chunk_into_pages_reference(*args)
    k_out, v_out = (np.asarray(kv_quant.dequantise_pages(x, jnp.float32)) for x in out)
    want_k = np.full_like(pool, np.nan)
    for h in range(heads):
        grp, j = divmod(h, g)
        for i in range(t):
            if dest[h, i] >= 0:
                page, off = table[grp, dest[h, i] // ps], dest[h, i] % ps
                want_k[page, j, off] = k[i, h]
    np.testing.assert_array_equal(np.isnan(k_out).any(-1), np.isnan(want_k).any(-1))
    tol = {"bf16": 0, "k8v4": 0.05, "k4v2": 0.5}[precision]   # quantisation error of keys
    written = ~np.isnan(want_k).any(-1)
    np.testing.assert_allclose(k_out[written], want_k[written], atol=tol)
    assert not np.isnan(v_out[written]).any()


def test_page_writes_list_each_dirty_page_once():
    dest = jnp.asarray([[5, -1, 0, 13, 6, -1], [-1, -1, -1, -1, -1, -1]], jnp.int32)
    dirty, rows = page_writes(dest, 4, 5)
    np.testing.assert_array_equal(np.asarray(dirty), [[0, 1, 3, -1, -1], [-1] * 5])
    np.testing.assert_array_equal(np.asarray(rows)[0, :3],
                                  [[2, -1, -1, -1], [-1, 0, 4, -1], [-1, 3, -1, -1]])
    assert (np.asarray(rows)[1] == -1).all()


def _held_rows(engine, session_id):
    """Per (layer, group): the K rows [G, length, d] the session's slot holds, in slot order."""
    manager, runner = engine.manager, engine.runner
    slot = engine.scheduler.sessions.get(session_id).slot
    k_pages = np.asarray(kv_quant.dequantise_pages(runner.k_pages, jnp.float32))
    ps = manager.page_size
    rows = {}
    for (layer, group), n in np.ndenumerate(manager.lengths[slot]):
        pages = manager.block_tables[slot, layer, group, :-(-n // ps)]
        x = k_pages[pages]                                     # [p, G, ps, d]
        rows[layer, group] = np.moveaxis(x, 1, 0).reshape(x.shape[1], -1, x.shape[-1])[:, :n]
    return slot, rows


def test_a_turn_keeps_the_same_tokens_however_it_is_chunked_and_returns_its_staging(tiny_folder):
    """The same 190-token turn prefilled in chunks of 16, 48 and 256 (the whole turn) keeps the
    same K rows per head under the "whole" view (every chunk attends to the whole held turn, and
    the last compresses it all at once), and once prefilled the slot holds exactly the pages of the turn's count:
    the staging the reservation borrowed is back in the pool."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import tiny_engine_config

    prompt = list(np.random.default_rng(3).integers(0, 250, 190))
    held = []
    for chunk in (16, 48, 256):
        engine = Engine(tiny_engine_config(tiny_folder, "tangram", chunk_size=chunk,
                                           max_num_batched_tokens=max(64, chunk + 4),
                                           obs_window=8, retention="turn",
                                           turn_view="whole"))
        layout = engine.layout
        assert engine.runner.compacts_turns
        free = engine.manager.num_free_pages
        engine.add_request(request_id="r", prompt_token_ids=prompt, session_id="s",
                           sampling_params=SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        slot, rows = _held_rows(engine, "s")
        want = layout.retained_counts(len(prompt)) + 1           # the turn and its answer
        np.testing.assert_array_equal(engine.manager.lengths[slot], want)
        assert engine.manager.pages_held(slot) == int(
            (-(-want // engine.manager.page_size)).sum())
        assert engine.manager.num_free_pages == free - engine.manager.pages_held(slot)
        held.append(rows)
    # The same tokens up to float rounding: the scores of a token are summed in another order
    # when it is held than when it is in the last chunk, and SnapKV's max-pooling gives every
    # token within TURN_POOL_KERNEL // 2 of a peak the peak's score (exact ties), so two peaks
    # equal to rounding at the cut can fall either way: at most the tail of one such plateau
    # swaps per head.
    from tangram_jax.compression.chunk_scoring import TURN_POOL_KERNEL
    for other in held[1:]:
        for key, rows in held[0].items():
            for a, b in zip(rows, other[key]):                # one head's kept K rows each
                same = (np.abs(a[:, None, :] - b[None, :, :]).max(-1) < 1e-4).any(1)
                assert len(a) == len(b) and same.sum() >= len(a) - (TURN_POOL_KERNEL - 1), \
                    (key, same.sum(), len(a))


@pytest.mark.parametrize("mode,ratio", [("tangram", 0.5), ("tangram", 0.25), ("full", 1.0)])
def test_cpu_and_gpu_defaults_decide_retention_alike(monkeypatch, tiny_folder, mode, ratio):
    """Everything that decides which tokens a turn keeps resolves the same whichever backend
    JAX runs on (the CPU may be slower, not less accurate): the chunk, the retention, the tail
    and window, the scoring rule and the budgets. Only the step's token budget differs."""
    from tangram_jax.engine import config as config_module
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.models.registry import load_model
    from tiny_engine import tiny_profile

    model_config = load_model(str(tiny_folder)).config
    fields = dict(model=str(tiny_folder), mode=mode)
    if mode == "tangram":
        fields["profile"] = tiny_profile(str(tiny_folder))
    decided = []
    for kind in ("cpu", "gpu"):
        monkeypatch.setattr(config_module, "_backend_kind", lambda _u, kind=kind: kind)
        resolved = EngineConfig(**fields).resolve(model_config)
        layout = resolved.layout
        decided.append((layout.chunk_size, layout.retention, layout.turn_view, layout.tail_rule,
                        layout.tail_window, resolved.obs_window, resolved.scoring_rule,
                        resolved.compression_method, layout.group_budgets.tobytes()))
    assert decided[0] == decided[1]


def test_held_turn_skip_keeps_the_first_page_and_the_recent_share():
    """`held_turn_skip`: the pages between the turn's first page and its recent share
    (max(chunk, ceil(r * held)) tokens, rounded out to whole pages); none for a turn shorter
    than that, and none in sliding-window layers."""
    from tangram_jax.kv_layout import held_turn_skip
    budgets = np.asarray([[0.5, 0.25], [0.5, 0.25]])
    hist = np.asarray([[[64, 64], [64, 64]], [[100, 100], [20, 20]]])   # [rows, layers, groups]
    turn_hist = np.asarray([[[0, 0], [0, 0]], [[13, 13], [4, 4]]])
    skip = held_turn_skip(hist, turn_hist, budgets, chunk_size=16, page_size=8)
    # Row 0: held 64; recent 32 / 16 -> from page 4 / 6; the first page 0 stays: skip 3 / 5.
    # Row 1, layer 0: held 87; recent 44 / 22 -> from page 7 / 9; first page 1: skip 5 / 7.
    # Row 1, layer 1: held 16 fits one chunk: nothing skipped.
    np.testing.assert_array_equal(skip, [[[3, 5], [3, 5]], [[5, 7], [0, 0]]])
    np.testing.assert_array_equal(
        held_turn_skip(hist, turn_hist, budgets, 16, 8, windowed_layers=(1,))[:, 1], 0)


@pytest.mark.parametrize("view", ["recent", "whole"])
def test_recent_view_attends_to_the_first_page_and_the_recent_share(tiny_folder, view):
    """Retention "turn" with turn_view "recent": each held chunk of a 190-token turn attends
    to the turn's first page and its last max(chunk, ceil(r * held)) held tokens (whole pages),
    the turn's last chunk to all of it; with "whole" every chunk attends to all. The first
    token's log-probs equal a dense forward under exactly that mask, and the two views' masks
    give log-probs far apart (the test tells them apart)."""
    import jax
    import jax.numpy as jnp
    from tangram_jax.compression.profile import BudgetProfile
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.models.decoder import dense_attention
    from tangram_jax.models.registry import load_model
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import CONFIG, tiny_engine_config

    layers, heads = CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"]
    half = np.full((layers, heads), 0.5)
    profile = BudgetProfile(
        model=dict(architecture="llama", num_layers=layers, num_kv_heads=heads,
                   head_dim=CONFIG["hidden_size"] // CONFIG["num_attention_heads"],
                   name=str(tiny_folder)),
        method="snapkv", rho=0.5, lambda_=2.0, mean=half, std=np.zeros_like(half),
        budget=half, group_size=1, grouping="budget",
        head_perm=np.tile(np.arange(heads), (layers, 1)), group_budgets=half)
    engine = Engine(tiny_engine_config(tiny_folder, "tangram", profile=profile,
                                       retention="turn", turn_view=view, obs_window=8))
    chunk, ps = engine.layout.chunk_size, engine.layout.page_size
    assert (chunk, ps) == (16, 8)
    prompt = np.random.default_rng(5).integers(0, 250, 190).tolist()
    engine.add_request(request_id="r", prompt_token_ids=prompt, session_id="s",
                       sampling_params=SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    entry = done[0].outputs[0].logprobs[0]

    def masked_log_probs(recent_view: bool) -> np.ndarray:
        n = len(prompt)
        q_pos, k_pos = np.arange(n)[:, None], np.arange(n)[None, :]
        start = q_pos // chunk * chunk                       # each query's chunk start = held
        recent = np.maximum(chunk, np.ceil(0.5 * start))
        first_recent = (start - recent) // ps * ps           # the recent share, whole pages
        seen = (k_pos < ps) | (k_pos >= first_recent) | (first_recent <= ps)
        last = start == (n - 1) // chunk * chunk             # the last chunk sees the turn
        mask = (k_pos <= q_pos) & (seen | last | (not recent_view))
        model = load_model(str(tiny_folder)).model
        tokens = jnp.asarray([prompt], jnp.int32)
        positions = jnp.arange(n, dtype=jnp.int32)[None]
        h = model.embed(tokens)
        for layer in model.layers:
            q, k, v = layer.qkv(h, positions)
            h = layer.finish(h, dense_attention(q, k, v, jnp.asarray(mask)[None]))
        return np.asarray(jax.nn.log_softmax(model.logits(h)[0, -1]))

    ref = masked_log_probs(view == "recent")
    other = masked_log_probs(view != "recent")
    top = np.argsort(-ref)[:5]
    assert set(top.tolist()) <= set(entry)
    got = np.asarray([entry[t].logprob for t in top.tolist()])
    np.testing.assert_allclose(got, ref[top], atol=2e-3)
    assert np.abs(other[top] - ref[top]).max() > 0.05


def test_where_the_host_waits_on_conditionals_only_a_call_that_ends_a_turn_compacts(
        monkeypatch, tiny_folder):
    """On a GPU a device-side conditional makes the host wait for everything before it (a
    prefill call's whole layer loop; `host_waits_on_conditionals`). There a call whose rows only
    append compiles no compaction (region width 0) and a call in which a row ends its turn
    compacts every row without a conditional, keeping only the ending rows' writes. Two
    sessions whose turns end in different two-row calls (the shorter one's beside a held chunk
    of the other) keep the same K rows and lengths and answer the same tokens as the
    conditional form."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.engine.turn_compaction import TurnCompaction
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import tiny_engine_config

    rng = np.random.default_rng(5)
    turns = {"a": list(rng.integers(0, 250, 150)), "b": list(rng.integers(0, 250, 60))}
    served = []
    for host_decides in (False, True):
        monkeypatch.setattr(TurnCompaction, "host_waits_on_conditionals",
                            property(lambda self, on=host_decides: on))
        # (One token each, told at once: no decode step, so no mixed program compiles.)
        engine = Engine(tiny_engine_config(tiny_folder, "tangram", chunk_size=48,
                                           max_num_batched_tokens=112, obs_window=8,
                                           retention="turn", turn_view="whole",
                                           async_scheduling=False))
        runner = engine.runner
        widths = runner._region_widths()
        assert (widths[0] == 0) == host_decides
        # Conditionals of the compaction: none where the host decides (each layer-loop step
        # of the CPU path holds its own, the same in every width's program).
        conds = []
        for width in (0, widths[-1]):      # no compaction, the widest
            args, static = runner._null_prefill_call(2, runner.k_pages, runner.v_pages, None,
                                                     width)
            text = runner._prefill.lower(*args, **static).as_text()
            conds.append(text.count("stablehlo.case") + text.count("stablehlo.if"))
        assert (conds[0] == conds[1]) == host_decides, conds
        regions, call = [], runner._call_prefill
        monkeypatch.setattr(runner, "_call_prefill", lambda args, static: (
            regions.append(static["region_pages"]), call(args, static))[1])
        tokens = {}
        for sid, prompt in turns.items():
            engine.add_request(request_id=sid, prompt_token_ids=prompt, session_id=sid,
                               sampling_params=SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        if host_decides:   # the held chunks' calls compiled and ran no compaction
            assert 0 in regions and len(set(regions)) > 1, regions
        held = {sid: _held_rows(engine, sid) for sid in turns}
        lengths = {sid: engine.manager.lengths[slot].copy() for sid, (slot, _) in held.items()}
        served.append((tokens, lengths, {sid: rows for sid, (_, rows) in held.items()}))
    (tokens, lengths, rows), (tokens2, lengths2, rows2) = served
    assert tokens == tokens2 and len(tokens) == 2
    for sid in turns:
        np.testing.assert_array_equal(lengths[sid], lengths2[sid])
        for key in rows[sid]:
            np.testing.assert_allclose(rows[sid][key], rows2[sid][key], atol=1e-5)
