"""Serving precision tiers (``k8v4-k4v2``): the tiered pool's dense history, the compression
writing the top-ranked kept tokens to the high tier and the rest to the low tier, decode
attention as a launch per tier's pool and one merge (the Pallas kernel in interpret mode
against its jnp reference), the split map over the tier groups weighing them by their tiers'
bytes, and the engine end to end on a tiny model."""

import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from tangram_jax import LLM, kv_quant
from tangram_jax.compression.profile import TierBudgets
from tangram_jax.sampling import SamplingParams
from tangram_jax.kv_layout import KVLayout, TieredLayout
from tangram_jax.pallas_kernels import chunk_compress, decode_attention, decode_merge

from tiny_engine import prefill_then_decode, tiny_engine_config, tiny_profile

G, PS, D = 2, 4, 16


def _pool(rng, num_pages, bits):
    x = jnp.asarray(rng.normal(size=(num_pages, G, PS, D)), jnp.float32)
    return kv_quant.quantise_pages(x, bits, jnp.float32)


def _tiered_pools(rng, num_pages):
    return (kv_quant.TieredPages(_pool(rng, num_pages, 8), _pool(rng, num_pages, 4)),
            kv_quant.TieredPages(_pool(rng, num_pages, 4), _pool(rng, num_pages, 2)))


def test_dense_history_lists_both_tiers_of_each_group():
    rng = np.random.default_rng(0)
    k, v = _tiered_pools(rng, 12)
    batch, groups, width = 2, 2, 3
    tables = jnp.asarray(rng.integers(1, 12, size=(batch, 2 * groups, width)), jnp.int32)
    lens = jnp.asarray(rng.integers(0, width * PS + 1, size=(batch, 2 * groups)), jnp.int32)
    kd, vd, td, ld = kv_quant.tiered_dense_history(k, v, tables, lens, jnp.float32)
    np.testing.assert_array_equal(ld, lens[:, 0::2] + lens[:, 1::2])
    for pools, dense in ((k, kd), (v, vd)):
        tiers = [np.asarray(kv_quant.dequantise_pages(p, jnp.float32))
                 for p in (pools.high, pools.low)]
        for b in range(batch):
            for g in range(groups):
                want = [tiers[t][int(tables[b, 2 * g + t, s // PS]), :, s % PS]
                        for t in (0, 1) for s in range(int(lens[b, 2 * g + t]))]
                got = [np.asarray(dense)[int(td[b, g, s // PS]), :, s % PS]
                       for s in range(int(ld[b, g]))]
                want, got = (np.array(x).reshape(-1, G, D) for x in (want, got))
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_tiered_compression_splits_the_kept_set_by_rank(use_kernel):
    """Of each head's kept tokens the top `high` by score land in the high tier's pages (after
    its history), the next `low` in the low tier's; together they are exactly the tokens the
    untiered selection keeps."""
    rng = np.random.default_rng(1)
    chunk, heads, groups = 10, 4, 2
    num_pages, width = 20, 4
    k_chunk = jnp.asarray(rng.normal(size=(chunk, heads, D)), jnp.float32)
    v_chunk = jnp.asarray(rng.normal(size=(chunk, heads, D)), jnp.float32)
    scores = jnp.asarray(rng.permutation(heads * chunk).reshape(heads, chunk), jnp.float32)
    chunk_len = 9
    keep = jnp.asarray([2, 3, 0, 4], jnp.int32)            # (high, low) of groups 0 and 1
    hist = jnp.asarray([1, 5, 0, 2], jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[:4 * width].reshape(4, width),
                        jnp.int32)
    k, v = _tiered_pools(rng, num_pages)
    compress = (functools_partial_interpret(chunk_compress.compress_chunk_into_pages)
                if use_kernel else chunk_compress.compress_chunk_into_pages_reference)
    k2, v2 = chunk_compress.compress_chunk_into_tiers(
        compress, k_chunk, v_chunk, scores, keep, chunk_len, k, v, table, hist)
    masked = np.where(np.arange(chunk) < chunk_len, np.asarray(scores), -np.inf)
    for h in range(heads):
        g = h // G
        order = np.argsort(-masked[h], kind="stable")
        hi_n, lo_n = int(keep[2 * g]), int(keep[2 * g + 1])
        for tier, chosen, pools in ((0, order[:hi_n], (k2.high, v2.high)),
                                    (1, order[hi_n:hi_n + lo_n], (k2.low, v2.low))):
            chosen = np.sort(chosen)                     # written in temporal order
            for pool, src in zip(pools, (k_chunk, v_chunk)):
                dense = np.asarray(kv_quant.dequantise_pages(pool, jnp.float32))
                for c, t in enumerate(chosen):
                    slot = int(hist[2 * g + tier]) + c
                    got = dense[int(table[2 * g + tier, slot // PS]), h % G, slot % PS]
                    bound = np.asarray(kv_quant.error_bound(src[t, h], pool.bits))
                    assert np.abs(got - np.asarray(src[t, h])).max() <= bound + 1e-6


def functools_partial_interpret(fn):
    return lambda *a: fn(*a, interpret=True)


def _poisoned_tiered_pools(rng, tier_lens, width):
    """(k, v TieredPages K8V4 + K4V2, tables [batch, 2 * groups, width]): each tier's pool holds
    exactly its tier groups' pages (shuffled ids); every slot past a tier group's length is
    NaN (its scale and zero stay NaN), so a kernel reading one shows."""
    batch, tier_groups = tier_lens.shape
    num_pages = batch * tier_groups * width + 1
    tables = (1 + rng.permutation(num_pages - 1)).reshape(batch, tier_groups, width)
    pools = {}
    for tier, (key_bits, value_bits) in enumerate(((8, 4), (4, 2))):
        owned = np.zeros((num_pages, PS), bool)
        for b in range(batch):
            for g in range(tier, tier_groups, 2):
                for t in range(int(tier_lens[b, g])):
                    owned[tables[b, g, t // PS], t % PS] = True
        for name, bits in (("k", key_bits), ("v", value_bits)):
            x = rng.normal(size=(num_pages, G, PS, D)).astype(np.float32)
            x[~owned[:, None, :, None].repeat(G, 1).repeat(D, 3)] = np.nan
            pools[name, tier] = kv_quant.quantise_pages(jnp.asarray(x), bits, jnp.float32)
    return (kv_quant.TieredPages(pools["k", 0], pools["k", 1]),
            kv_quant.TieredPages(pools["v", 0], pools["v", 1]),
            jnp.asarray(tables, jnp.int32))


def test_tiered_decode_kernel_matches_reference():
    """One launch over both tiers' items (a launch per tier's pool with the uniform lists),
    then one merge: every kind of work list pair (the tiered AOT map cut by tier, uniform
    splits finer than the blocks, runtime planning per tier, and a static high list with a
    planned low one), both loop variants and both heads-per-program settings against the
    dense-history reference. Tier lengths are ragged: a group empty in
    both tiers, high only, low only, page boundaries (PS, 2 PS, one short and one past), both
    tiers at the table's end; unowned slots are NaN."""
    from tangram_jax.pallas_kernels import split_map as sm
    rng = np.random.default_rng(2)
    batch, groups, q_per_kv, width = 4, 3, 2, 5
    cap = width * PS
    tier_lens = rng.integers(0, cap + 1, size=(batch, 2 * groups)).astype(np.int32)
    tier_lens[0] = [0, 0, 5, 0, 0, 7]               # empty group; high only; low only
    tier_lens[1] = [PS, PS, 2 * PS, PS - 1, PS + 1, 2 * PS + 1]  # page boundaries
    tier_lens[2] = [cap, cap, 1, cap, cap, 1]       # full tables, one-token tiers
    k, v, tables = _poisoned_tiered_pools(rng, tier_lens, width)
    q = jnp.asarray(rng.normal(size=(batch, groups, G * q_per_kv, D)), jnp.float32)
    lens = jnp.asarray(tier_lens)
    want = decode_attention.ragged_paged_decode_attention_reference(q, k, v, tables, lens)
    assert np.isfinite(np.asarray(want)).all()
    aot = sm.build_tier_split_map(np.array([[0.2, 0.5, 0.9]]), np.array([[0.3, 0.6, 0.1]]),
                                  (40, 24), 24, batch, group_size=G)      # K8V4 / K4V2 at D = 16
    planned = [sm.plan_runtime_work(tier_lens[:, t::2], 24, PS, group_size=G) for t in (0, 1)]
    work_lists = {
        "aot": tuple(w[0] for w in aot.tier_work_lists()),
        "uniform": tuple(w[0] for w in sm.uniform_split_map(1, 2 * groups, 7,   # > the blocks
                                                            tiered=True).tier_work_lists()),
        "runtime_planned": tuple(planned),
        "aot_high_planned_low": (aot.tier_work_lists()[0][0], planned[1]),
    }
    paths = {"aot": dict(num_stages=2), "uniform": dict(num_stages=3),
             "runtime_planned": dict(heads_per_program=G), "aot_high_planned_low": {}}
    for name, work in work_lists.items():
        got = decode_attention.ragged_paged_decode_attention(
            q, k, v, tables, lens, work_list=work, interpret=True, block_tokens=2 * PS,
            num_warps=4, **paths[name])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                                   err_msg=name)
        assert not np.asarray(got)[0, 0].any()
    with pytest.raises(ValueError, match="pair"):
        decode_attention.ragged_paged_decode_attention(q, k, v, tables, lens,
                                                       work_list=work_lists["aot"][0])


def test_tiered_decode_merges_the_partials_of_both_launches():
    """Each tier's launch (`decode_partials` with `tier`) reads only its tier groups' rows of the shared tables and lengths
    (``2 g + t``) in its pool's format: its partials are the untiered reference over that tier
    alone; the merge of both launches' partials is the reference over both tiers."""
    rng = np.random.default_rng(3)
    tier_lens = np.array([[3 * PS + 1, 5 * PS], [0, 2 * PS - 1]], np.int32)   # 2 rows, 1 group
    k, v, tables = _poisoned_tiered_pools(rng, tier_lens, 6)
    q = jnp.asarray(rng.normal(size=(2, 1, G, D)), jnp.float32)
    lens = jnp.asarray(tier_lens)
    work = jnp.asarray([(0, s, 2) for s in range(2)], jnp.int32)
    parts = []
    for tier, (kt, vt) in enumerate(((k.high, v.high), (k.low, v.low))):
        o_part, lse, _ = decode_attention.decode_partials(
            q, kt, vt, tables, lens, work, interpret=True, block_tokens=PS, num_warps=2,
            num_stages=2, tier=tier, num_tiers=2)
        alone = decode_attention.ragged_paged_decode_attention_reference(
            q, kt, vt, tables[:, tier::2], lens[:, tier::2])
        merged = decode_merge.merge_partials(o_part, lse, work, 1)
        np.testing.assert_allclose(np.asarray(merged).reshape(alone.shape), np.asarray(alone),
                                   rtol=2e-5, atol=2e-5, err_msg=str(tier))
        parts.append((o_part, lse))
    merged = decode_merge.merge_partials(
        jnp.concatenate([p[0] for p in parts], axis=1),
        jnp.concatenate([p[1] for p in parts], axis=1), jnp.concatenate([work, work]), 1)
    full = decode_attention.ragged_paged_decode_attention_reference(q, k, v, tables, lens)
    np.testing.assert_allclose(np.asarray(merged).reshape(full.shape), np.asarray(full),
                               rtol=2e-5, atol=2e-5)
    # One launch over both tiers: its items are the high list's then the low list's, each
    # read in its tier's format, so its partials are the two launches' side by side.
    o_one, lse_one, work_one = decode_attention.decode_partials(
        q, k, v, tables, lens, (work, work), interpret=True, block_tokens=(PS, 2 * PS),
        num_warps=2, num_stages=3)
    np.testing.assert_array_equal(np.asarray(work_one), np.concatenate([work, work]))
    for tier, (o_part, lse) in enumerate(parts):
        items = slice(tier * len(work), (tier + 1) * len(work))
        merged = decode_merge.merge_partials(o_part, lse, work, 1)
        np.testing.assert_allclose(
            np.asarray(decode_merge.merge_partials(o_one[:, items], lse_one[:, items],
                                                       work, 1)),
            np.asarray(merged), rtol=2e-5, atol=2e-5, err_msg=str(tier))
    # The decode and merge launches a layer makes: one decode launch over both tiers, then
    # the merge; the reference's output.
    def attend(q):
        return decode_attention.ragged_paged_decode_attention(
            q, k, v, tables, lens, work_list=(work, work), interpret=True, block_tokens=PS,
            num_warps=4)
    jaxpr = str(jax.make_jaxpr(attend)(q))
    assert jaxpr.count("name=ragged_paged_decode_attention") == 1
    assert jaxpr.count("name=ragged_paged_decode_merge") == 1
    np.testing.assert_allclose(np.asarray(attend(q)).reshape(full.shape), np.asarray(full),
                               rtol=2e-5, atol=2e-5)


def test_tiered_split_map_weighs_tier_groups_by_their_bytes():
    """The engine's AOT map of a tiered layout is over its tier groups, each weighed by its
    budget x tier share x its tier's bytes per slot: a group all in the high tier (K8V4,
    208 B at head_dim 128) gets about 208 / 112 the items of one of the same budget all in the
    low tier (K4V2); the empty tiers get one item each, which the kernel runs as a no-op."""
    from tangram_jax.engine.decode_step import decode_split_map
    import types
    base = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128, group_size=2, page_size=PS,
                    chunk_size=8, head_perm=np.arange(4)[None], group_budgets=np.array([[0.5,
                                                                                       0.5]]))
    tiered = TieredLayout(base, np.array([[1.0, 0.0]]))
    smap = decode_split_map(tiered, types.SimpleNamespace(head_dim=128), jnp.bfloat16, 40, 1,
                            group_size=2, pool_format=kv_quant.pool_format("k8v4-k4v2"))
    assert smap.tiered and smap.num_groups == 4
    high_of_0, low_of_0, high_of_1, low_of_1 = smap.splits[0]
    assert low_of_0 == 1 and high_of_1 == 1
    assert 208 / 112 * 0.8 <= high_of_0 / low_of_1 <= 208 / 112 * 1.25
    high, low = smap.tier_work_lists()
    assert (high[0, :, 2] > 0).sum() == high_of_0 + high_of_1
    assert (low[0, :, 2] > 0).sum() == low_of_0 + low_of_1
    untiered = decode_split_map(base, None, jnp.bfloat16, 40, 1, group_size=2)
    assert not untiered.tiered and untiered.num_groups == 2


def test_engine_split_map_takes_each_page_format_s_measured_program_target():
    """An untiered layout's map is sized for `decode_programs(kv_precision, num_programs)`:
    twice the items per row for K8V8, four times for K8V4 and K4V2 (each measured fastest
    there); a tiered layout's map does not depend on the setting (the engine's maps:
    test_kv_precision)."""
    from tangram_jax.engine.decode_step import decode_split_map
    from tangram_jax.pallas_kernels.tuning import DECODE_PROGRAM_SCALE
    from tangram_jax.pallas_kernels.split_map import build_split_map
    import types
    base = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128, group_size=2, page_size=PS,
                    chunk_size=8, head_perm=np.arange(4)[None],
                    group_budgets=np.array([[0.5, 0.5]]))
    items = {name: decode_split_map(base, None, jnp.bfloat16, 24, 1, group_size=2,
                                    pool_format=kv_quant.pool_format(name)).num_items
             for name in ("bf16", "k8v8", "k8v4", "k4v2")}
    assert items == {name: build_split_map(base.group_budgets, 24 * DECODE_PROGRAM_SCALE[name],
                                           1, group_size=2).num_items for name in items}
    assert items["k8v4"] == items["k4v2"] == 2 * items["k8v8"] == 4 * items["bf16"] == 48
    tiered = TieredLayout(base, np.array([[0.5, 0.5]]))
    cfg = types.SimpleNamespace(head_dim=128)
    tiers = kv_quant.pool_format("k8v4-k4v2")
    assert decode_split_map(tiered, cfg, jnp.bfloat16, 24, 1, group_size=2,
                            pool_format=tiers).num_items == 24   # num_programs, unscaled
    for layout, fmt in ((tiered, kv_quant.pool_format("k8v4")), (base, tiers)):
        with pytest.raises(ValueError, match="disagree on precision tiers"):
            decode_split_map(layout, cfg, jnp.bfloat16, 24, 1, group_size=2, pool_format=fmt)


# ----- the engine end to end (tiny model, CPU serving path) -----------------------------------

def _tiered_profile(folder, high_share):
    profile = tiny_profile(str(folder))
    share = np.broadcast_to(np.asarray(high_share, np.float64), profile.budget.shape).copy()
    return dataclasses.replace(profile, tiers=TierBudgets(
        precision="k8v4-k4v2", mass=0.9, lambda_=0.0, mean=share, std=np.zeros_like(share),
        high_share=share))


def _serve(folder, precision, profile, prompts, max_tokens=12):
    llm = LLM(config=tiny_engine_config(folder, "tangram", kv_precision=precision,
                                        profile=profile))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_tiny_engine_serves_tiers(tiny_folder):
    """k8v4-k4v2 in tangram mode: prompts over several compression chunks (chunk 16), decode
    past a page (page 8); the pool is a K8V4 + K4V2 pair whose low tier was written; what a
    prompt's prefill wrote per (layer, group, tier) is the tiered retained-count formula; every
    page comes back. With every high share 1 the low tier stays empty and the tokens are
    exactly K8V4's (same codes, same keys): the tier plumbing routes nothing wrongly."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=n).tolist() for n in (5, 40, 70)]
    shares = np.random.default_rng(1).uniform(0.2, 0.8, (2, 2))   # [layers, kv_heads]
    llm, mixed = _serve(tiny_folder, "k8v4-k4v2", _tiered_profile(tiny_folder, shares), prompts)
    runner, manager = llm.engine.runner, llm.engine.manager
    assert isinstance(runner.k_pages, kv_quant.TieredPages)
    assert [runner.k_pages.high.bits, runner.k_pages.low.bits,
            runner.v_pages.high.bits, runner.v_pages.low.bits] == [8, 4, 4, 2]
    assert runner.tier_page_bytes == tuple(
        kv_quant.page_bytes(kv_quant.page_format(f), 1, 8, runner.base_layout.head_dim,
                            runner.kv_dtype) for f in ("k8v4", "k4v2"))
    assert np.asarray(runner.k_pages.low.scale).any()
    assert all(len(ids) == 12 for ids in mixed)
    assert all(p.num_used == 0 for p in manager.pools)
    # What a prompt's prefill wrote and reserved (read when its first decode step grows it):
    # the tiered formula, per tier group.
    engine, layout, first_decode = llm.engine, llm.engine.layout, []
    grow = manager.grow_for_decode

    def recording_grow(slots):
        if len(slots):
            first_decode.append((manager.lengths[slots].copy(),
                                 manager.reserved_lengths[slots].copy()))
        return grow(slots)

    manager.grow_for_decode = recording_grow
    llm.generate([{"prompt_token_ids": prompts[2]}],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    written, reserved = first_decode[0]
    np.testing.assert_array_equal(written[0], layout.retained_counts(len(prompts[2])))
    np.testing.assert_array_equal(reserved, written)
    assert all(p.num_used == 0 for p in manager.pools)

    _, k8v4 = _serve(tiny_folder, "k8v4", tiny_profile(str(tiny_folder)), prompts)
    _, all_high = _serve(tiny_folder, "k8v4-k4v2", _tiered_profile(tiny_folder, 1.0), prompts)
    assert all_high == k8v4


# ----- the runner on the Pallas kernels (interpret mode) against the CPU serving path -------

def _runner_steps(use_kernels: bool, kv_precision: str = "k8v4-k4v2", max_pages: int = 16):
    """A tiny random model's runner over quantised pools (precision tiers: `kv_precision`
    ``k8v4-k4v2``), block tables of `max_pages` columns: two prefill chunks of one sequence,
    then three decode steps (the first crosses a page: of the high tier with tiers). Returns (prefill
    logits, decoded tokens, every pool dequantised, the runner; its `prefill_widths` lists
    the table width of each prefill call)."""
    from flax import nnx
    from test_runner import CONFIG, LAYOUT
    from tangram_jax.engine.decode_step import decode_split_map
    from tangram_jax.engine.model_runner import AttentionOps, ModelRunner, RunnerConfig
    from tangram_jax.models.decoder import Decoder
    from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
    if kv_precision == "k8v4-k4v2":
        layout = TieredLayout(LAYOUT, np.array([[0.5, 0.0], [1.0, 0.3], [0.6, 0.5]]))
        pool_pages = (40, 24)
    else:
        layout, pool_pages = LAYOUT, 64
    manager = KVCacheManager(layout, pool_pages, 2, max_pages, model_kv_shape=(3, 2, 8))
    split_maps = {1: decode_split_map(layout, CONFIG, jnp.float32, 4, 1, group_size=1,
                                      pool_format=kv_quant.pool_format(kv_precision))}
    runner = ModelRunner(Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0)), CONFIG, layout,
                         pool_pages, manager.block_tables.shape, split_maps=split_maps,
                         runner_config=RunnerConfig(layer_loop="scan"),
                         pool_format=kv_quant.pool_format(kv_precision),
                         ops=AttentionOps.for_backend(use_kernels=use_kernels))
    prefill, runner.prefill_widths = runner._prefill, []

    def recorded_prefill(*args, **static):
        runner.prefill_widths.append(static["table_width"])
        return prefill(*args, **static)

    runner._prefill = recorded_prefill
    tokens = np.random.default_rng(0).integers(1, 97, 27)
    logits, decoded, _ = prefill_then_decode(runner, manager, layout, tokens, as_one_turn=True)
    tiers = lambda pages: (pages.high, pages.low) if isinstance(pages, kv_quant.TieredPages) \
        else (pages,)
    pools = [np.asarray(kv_quant.dequantise_pages(p, jnp.float32))
             for pages in (runner.k_pages, runner.v_pages) for p in tiers(pages)]
    return logits, decoded, pools, runner


def test_tiered_runner_on_kernels_matches_the_cpu_path():
    """The runner's kernel branch (tiered dense history into the prefill kernel, compression
    kernel into both tiers, the tiered decode kernel with the split map's tier work lists) and
    the CPU serving path give the same step results."""
    kernel_logits, kernel_tokens, kernel_pools, _ = _runner_steps(True)
    xla_logits, xla_tokens, xla_pools, _ = _runner_steps(False)
    np.testing.assert_allclose(kernel_logits, xla_logits, rtol=1e-4, atol=1e-4)
    assert kernel_tokens == xla_tokens
    for a, b in zip(kernel_pools, xla_pools):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_precision", ["k8v4-k4v2", "k8v4"])
def test_kernel_prefill_dequantises_only_the_columns_its_rows_hold(kv_precision):
    """The Pallas prefill reads a quantised pool as a dense history of its rows' table
    columns: the runner passes the columns the rows' retained tokens need (a power of two,
    at least an eighth of the table), not `max_model_len`'s, with the same step results as
    the CPU path; decode steps keep the whole table (the decode kernel reads pages in
    place)."""
    max_pages = 128                        # 512 slots; the sequence holds at most 8 pages
    kernel = _runner_steps(True, kv_precision, max_pages)
    xla = _runner_steps(False, kv_precision, max_pages)
    runner = kernel[3]
    assert runner._table_widths(prefill=True) == [16, 32, 64, 128]
    assert runner._table_widths(prefill=False) == [max_pages]
    assert runner._table_width(27, prefill=True) == 16       # 7 pages
    assert runner._table_width(27, prefill=False) == max_pages
    assert runner._table_width(100 * 4, prefill=True) == 128
    assert runner.prefill_widths == [16, 16]                  # both chunks
    np.testing.assert_allclose(kernel[0], xla[0], rtol=1e-4, atol=1e-4)
    assert kernel[1] == xla[1]
    for a, b in zip(kernel[2], xla[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_embedded_model_tiers_answer_as_k8v4():
    """SmolLM2-135M, tangram at ratio 0.5 with its shipped tiered profile (mean high share
    0.35 at G 1): k8v4-k4v2 against k8v4 (the tiered pool's high format) on the prompts of the
    precision test. Seen: the same 12 tokens on both prompts; asked: the first 6 and the city
    (K4V2 alone drifts after "Paris."). The pools (kv_cache_tokens: the same slots): the
    tiered one's bytes per slot, its arrays' nbytes, are the share's mix of K8V4 and K4V2
    pages, below K8V4's (seen before per-plane value scales: 79.4 against 112 B)."""
    from test_kv_precision import EMBEDDED_PROMPTS as prompts
    from test_kv_precision import EMBEDDED_SMALL_ENGINE as small
    params = SamplingParams(temperature=0, max_tokens=12)
    outs, pools = {}, {}
    for precision in ("k8v4", "k8v4-k4v2"):
        llm = LLM(mode="tangram", ratio=0.5, kv_precision=precision, **small)
        outs[precision] = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.engine.runner
        pools[precision] = pool = llm.engine.kv_pool()
        assert pool["bytes"] == sum(x.nbytes for x in jax.tree.leaves((runner.k_pages,
                                                                         runner.v_pages)))
        if precision == "k8v4-k4v2":
            layout = llm.engine.layout
            assert isinstance(layout, TieredLayout) and (layout.high_share < 1).any()
            share = layout.pool_high_share
    assert pools["k8v4-k4v2"]["slots"] == pools["k8v4"]["slots"]
    # K8V4 at head_dim 64: 64 + 8 key bytes, 32 + 2 x 8 value bytes (a scale and zero a plane).
    assert pools["k8v4"]["bytes_per_slot"] == pytest.approx(120, rel=1e-3)
    assert pools["k8v4-k4v2"]["bytes_per_slot"] == pytest.approx(120 * share + 64 * (1 - share),
                                                                 rel=2e-3)
    assert pools["k8v4-k4v2"]["bytes_per_slot"] < 0.8 * pools["k8v4"]["bytes_per_slot"]
    for tiered, base in zip(outs["k8v4-k4v2"], outs["k8v4"]):
        t, b = tiered.outputs[0].token_ids, base.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(t, b)) if x != y), min(len(t), len(b)))
        assert same >= 6, (tiered.outputs[0].text, base.outputs[0].text)
    assert "Paris" in outs["k8v4-k4v2"][0].outputs[0].text


def test_manager_decode_feed_counts_the_high_tier_only():
    """A decode token is appended to the high tier groups: where it is written (the lengths
    before it), the pages the next one needs and the table limit leave the low tier alone."""
    from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
    base = KVLayout(num_layers=1, num_kv_heads=2, head_dim=D, group_size=1, page_size=4,
                    chunk_size=8, head_perm=np.array([[0, 1]]),
                    group_budgets=np.array([[0.5, 1.0]]))
    tiered = TieredLayout(base, np.array([[0.5, 0.5]]))
    manager = KVCacheManager(tiered, (20, 12), 2, 8, model_kv_shape=(1, 2, D))
    slot = manager.allocate_slot()
    assert manager.reserve(slot, 16)
    manager.commit_prefill(slot, 16)
    before = manager.lengths[slot].copy()            # [1, 4]: (high, low) of two groups
    np.testing.assert_array_equal(before, tiered.retained_counts(16))
    # The next token needs a page exactly in the high tier groups whose pages are full.
    full = before[0] % 4 == 0
    np.testing.assert_array_equal(manager.decode_demand(slot),      # (high, low) pages
                                  [int((full & tiered.decode_tier_groups).sum()), 0])
    assert manager.grow_for_decode(np.array([slot])).all()
    np.testing.assert_array_equal(manager.lengths[slot] - before, [tiered.decode_tier_groups])
    np.testing.assert_array_equal(manager.decode_write_lengths(np.array([slot]))[0], before)
