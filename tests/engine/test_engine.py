"""The engine end to end on the embedded SmolLM2 (CPU, XLA reference kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.kv_layout import pages_for
from tangram_jax.llm import LLM
from tangram_jax.reference import generate_dense
from tangram_jax.sampling import SamplingParams

pytestmark = pytest.mark.slow

SMALL = dict(max_num_seqs=4, kv_cache_tokens=4096, max_model_len=1024, chunk_size=32,
             page_size=16, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10)

PROMPTS = [
    "The capital of France is",
    # Several compression chunks of 32 tokens, a partial last one.
    "Paul Graham wrote that the way to get startup ideas is not to try to think of startup "
    "ideas. It's to look for problems, preferably problems you have yourself. The very best "
    "startup ideas tend to have three things in common: they're something the founders "
    "themselves want, that they themselves can build, and that few others realize are worth "
    "doing. Microsoft, Apple, Yahoo, Google, and Facebook all began this way. Question: "
    "according to the text, what do the best startup ideas have in common? Answer:",
]


def _identity_budget_profile(model_config, group_size: int,
                             method: str = "snapkv") -> BudgetProfile:
    """Every budget 1 (nothing dropped), heads in a non-trivial (reversed) order."""
    layers, heads = model_config.num_layers, model_config.num_kv_heads
    ones = np.ones((layers, heads))
    perm = np.tile(np.arange(heads)[::-1], (layers, 1))
    return BudgetProfile(
        model=dict(model_config.fingerprint(), name="smollm2"), method=method, rho=1.0,
        lambda_=2.0, mean=ones, std=np.zeros_like(ones), budget=ones, group_size=group_size,
        grouping="budget", head_perm=perm, group_budgets=np.ones((layers, heads // group_size)))


@pytest.fixture(scope="module")
def full_llm():
    return LLM(mode="full", **SMALL)


def test_rho_one_tangram_equals_full_and_dense_reference(full_llm):
    tok = full_llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
    prompts = [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1]), chat]
    assert len(prompts[1]) > 2 * SMALL["chunk_size"]

    full = [o.outputs[0].token_ids for o in full_llm.generate(prompts, GREEDY, use_tqdm=False)]

    cfg = full_llm.engine.model_config
    # Waiting for every step's tokens (no asynchronous scheduling) must not change them either.
    # (A profile calibrated with KeyDiff is served with KeyDiff: tests/engine/test_runner.py
    # checks what that scorer keeps; budgets of 1 keep everything whatever the scorer.)
    tangram = LLM(mode="tangram", profile=_identity_budget_profile(cfg, group_size=1,
                                                                   method="keydiff"),
                  async_scheduling=False, **SMALL)
    assert tangram.engine.runner.runner_config.method == "keydiff"
    assert tangram.engine.layout.num_groups == cfg.num_kv_heads
    ours = [o.outputs[0].token_ids for o in tangram.generate(prompts, GREEDY, use_tqdm=False)]

    from tangram_jax.models.registry import load_model
    loaded = load_model(None)
    dense = generate_dense(loaded.model, loaded.config, prompts, GREEDY,
                           eos_token_ids=loaded.tokenizer.eos_token_ids)
    assert full == dense
    assert ours == dense
    text = full_llm.tokenizer.decode(full[0])
    assert "Paris" in text


def _expected_lengths(layout, turns):
    """Retained tokens per (layer, group) after `turns` = [(new tokens, generated), ...]:
    each turn's new tokens are compressed in chunks; every generated token is appended
    uncompressed (the last one by the step the engine had already dispatched when it learned
    that the turn was over)."""
    total = np.zeros(layout.group_budgets.shape, np.int64)
    for new_tokens, generated in turns:
        total += layout.retained_counts(new_tokens) + generated
    return total


def test_multi_turn_chat_pages_are_exactly_the_reservation():
    # Chunks of 64: the whole first turn is one compression chunk, later turns add more. A
    # window of 8: every turn's last 8 tokens stay whole (the tail rule), the rest compresses
    # (with the default 32 these short turns would be nearly all tail).
    llm = LLM(mode="tangram", ratio=0.5, group_size=1, **dict(SMALL, chunk_size=64, obs_window=8))
    engine, manager, layout = llm.engine, llm.engine.manager, llm.engine.layout
    assert layout.compresses
    questions = [["What is a hash map?", "How is it different from a tree map?"],
                 ["Write a haiku about autumn.", "Now one about winter."],
                 ["Explain recursion to a child.", "Give an example in Python."],
                 ["What is the capital of France?", "What is it famous for?"]]
    convs = [[{"role": "user", "content": q[0]}] for q in questions]
    history = [[] for _ in questions]
    params = SamplingParams(temperature=0, max_tokens=12)
    for turn in range(2):
        before = {}
        if turn:
            for c, q in zip(convs, questions):
                c.append({"role": "user", "content": q[1]})
        for i, c in enumerate(convs):
            ids = llm.tokenizer.apply_chat_template(c)
            sid, new = engine.find_session(ids)
            before[i] = (sid, len(new))
            if turn:
                assert sid is not None, "the second turn must continue the first turn's session"
                assert len(new) < len(ids)
        outs = llm.chat(convs, params, use_tqdm=False)
        if turn == 0:
            # Compression must not cost the answer (the window/generation prompt survives).
            assert "Paris" in outs[3].outputs[0].text, outs[3].outputs[0].text
        for i, (c, out) in enumerate(zip(convs, outs)):
            assert out.finished and out.outputs[0].token_ids
            c.append({"role": "assistant", "content": out.outputs[0].text})
            history[i].append((before[i][1], len(out.outputs[0].token_ids)))
            seq = engine.sessions.get(out.session_id)
            slot = seq.slot
            expected = _expected_lengths(layout, history[i])
            np.testing.assert_array_equal(manager.lengths[slot], expected)
            np.testing.assert_array_equal(manager.reserved_lengths[slot], expected)
            np.testing.assert_array_equal(manager.table.num_pages[slot],
                                          pages_for(expected, layout.page_size))
    usage = engine.kv_usage()
    assert 0 < usage["kv_bytes_held"] < usage["full_kv_bytes"]
    for out in outs:
        llm.end_session(out.session_id)
    assert manager.pool.num_used == 0


def test_pool_size_and_startup_times_are_reported(full_llm):
    engine = full_llm.engine
    pool = engine.kv_usage()["pool"]
    assert pool["sized_by"] == "kv_cache_tokens" and "plan" not in pool   # CPU: no GPU sizing
    assert pool["full_kv_tokens"] == SMALL["kv_cache_tokens"]
    assert pool["bytes"] == pool["num_pages"] * engine.runner.kv_bytes_per_page
    assert set(engine.startup_seconds) == {"load_model", "load_wait", "build", "collect",
                                           "warmup", "total"}


def test_abort_mid_decode_returns_all_pages(full_llm):
    engine = full_llm.engine
    free0 = engine.manager.num_free_pages
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], sampling_params=params)
    engine.add_request("drop", PROMPTS[1], sampling_params=params)
    for _ in range(3):
        engine.step()
    assert engine.manager.num_free_pages < free0
    engine.abort("drop")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["keep"]
    assert len(outputs[0].outputs[0].token_ids) == 50
    assert engine.manager.num_free_pages == free0


def test_host_fetches_tokens_only_after_the_next_step_is_queued(full_llm, monkeypatch):
    engine, runner = full_llm.engine, full_llm.engine.runner
    events = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            tokens = fn(*args, **kwargs)
            events.append(("dispatch", [tokens]))
            return tokens
        monkeypatch.setattr(runner, name, wrapped)

    record("decode", runner.decode)
    record("sample", runner.sample)
    resolve = engine._resolve

    def resolve_spy(in_flight):
        events.append(("resolve", [t.tokens for t in in_flight]))
        return resolve(in_flight)

    monkeypatch.setattr(engine, "_resolve", resolve_spy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("late", PROMPTS[0], sampling_params=params)
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append([len(o.outputs[0].token_ids) for o in engine.step()])
    # Tokens arrive one step late: nothing after the prefill step, then one per step.
    assert per_step == [[], [1], [2], [3], [4], [5], [6]]
    checked = 0
    for i, (kind, arrays) in enumerate(events):
        dispatched = [j for j, (k, d) in enumerate(events[:i])
                      if k == "dispatch" and any(d[0] is a for a in arrays)]
        if kind == "resolve" and dispatched:   # (tokens of steps before the spy: not ours)
            # A newer step was queued before the host blocked on these tokens.
            assert any(k == "dispatch" for k, _ in events[max(dispatched) + 1:i]), events
            checked += 1
    assert checked == 6
    assert engine.manager.num_free_pages == engine.manager.pool.capacity


def test_bad_input_is_refused_while_others_finish(full_llm):
    engine = full_llm.engine
    engine.add_request("good", PROMPTS[0], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", prompt_token_ids=[1] * 2000, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="alternate|role"):
        engine.add_request("roles", messages=[{"role": "user", "content": "a"},
                                              {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("vocab", prompt_token_ids=[10**7], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("sampling", PROMPTS[0], sampling_params=SamplingParams(top_p=0))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"]
    assert "Paris" in done[0].outputs[0].text


def test_bad_engine_configuration_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        EngineConfig(mode="turbo")
    with pytest.raises(ValueError, match="ratio"):
        EngineConfig(ratio=0)


def test_profile_for_another_model_is_refused(full_llm, tmp_path):
    cfg = full_llm.engine.model_config
    profile = _identity_budget_profile(cfg, group_size=1)
    profile.model["num_layers"] = cfg.num_layers + 2
    with pytest.raises(ValueError, match="num_layers|layers|model"):
        Engine(EngineConfig(mode="tangram", profile=profile, **SMALL))


def test_dynamic_mode_compresses_then_reclaims():
    llm = LLM(mode="dynamic", ratio=0.5, **SMALL)
    engine, manager = llm.engine, llm.engine.manager
    prompt = llm.tokenizer.encode(PROMPTS[1])
    engine.add_request("dyn", prompt_token_ids=prompt, session_id="s",
                       sampling_params=SamplingParams(temperature=0, max_tokens=4))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done and done[0].outputs[0].token_ids
    slot = engine.sessions.get("s").slot
    cached = len(prompt) + len(done[0].outputs[0].token_ids) - 1
    lengths = manager.lengths[slot]
    # The per-input selection kept about half of the prompt; the pages above it went back.
    assert (lengths < cached).all() and (lengths >= cached // 3).all()
    assert manager.usage()["pages_reclaimed"] > 0
    np.testing.assert_array_equal(manager.table.num_pages[slot],
                                  pages_for(manager.reserved_lengths[slot], manager.page_size))


def test_logprobs_under_forced_tokens_are_the_dense_models(full_llm):
    """Teacher forcing: the output is the forced tokens (an EOS among them does not stop it),
    and the log-probs are log_softmax of the dense reference's logits at every position."""
    import jax
    import jax.numpy as jnp
    from tangram_jax.models.decoder import DenseKVCache
    from tangram_jax.models.registry import load_model
    engine, tok = full_llm.engine, full_llm.tokenizer
    prompt = tok.encode(PROMPTS[0])
    forced = tok.encode(" a small town by the sea")[:4] + [tok.eos_token_ids[0]] + \
        tok.encode(" and")[:1]
    engine.add_request("top", prompt_token_ids=prompt, forced_token_ids=forced,
                       sampling_params=SamplingParams(temperature=0, max_tokens=2, logprobs=5))
    engine.add_request("all", prompt_token_ids=prompt, forced_token_ids=forced,
                       sampling_params=SamplingParams(temperature=0.8, seed=3, logprobs=-1))
    engine.add_request("plain", prompt_token_ids=prompt, sampling_params=GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})

    loaded = load_model(None)
    seq = prompt + forced
    cache = DenseKVCache.create(loaded.config, 1, 64)
    logits, _ = loaded.model(jnp.asarray([seq], jnp.int32),
                             jnp.arange(len(seq), dtype=jnp.int32)[None], cache)
    ref = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:len(seq) - 1], axis=-1))

    top, full = done["top"].outputs[0], done["all"].outputs[0]
    assert top.token_ids == forced and full.token_ids == forced
    assert done["plain"].outputs[0].logprobs is None
    assert len(top.logprobs) == len(forced)
    for i, (entry, token) in enumerate(zip(top.logprobs, forced)):
        order = np.argsort(-ref[i], kind="stable")
        assert set(entry) == set(order[:5].tolist()) | {token}
        np.testing.assert_allclose(entry[token].logprob, ref[i, token], atol=2e-3)
        # (float noise may swap near-ties between the engine and the dense path)
        assert abs(entry[token].rank - (int((ref[i] > ref[i, token]).sum()) + 1)) <= 1
        for rank, t in enumerate(order[:5].tolist(), 1):
            if t != token:
                assert abs(entry[t].rank - rank) <= 1
            np.testing.assert_allclose(entry[t].logprob, ref[i, t], atol=2e-3)
        assert entry[token].decoded_token == tok.decode([token], skip_special_tokens=False)
    np.testing.assert_allclose(top.cumulative_logprob, ref[np.arange(len(forced)), forced].sum(),
                               atol=1e-2)
    assert full.full_logprobs.shape == (len(forced), loaded.config.vocab_size)
    assert full.full_logprobs.dtype == np.float32
    np.testing.assert_allclose(full.full_logprobs, ref, atol=2e-3)
    assert all(list(entry) == [t] for entry, t in zip(full.logprobs, forced))


def test_bad_logprobs_and_forced_tokens_are_refused(full_llm):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(TypeError, match="logprobs"):
        SamplingParams(logprobs=1.5)
    with pytest.raises(ValueError, match="forced_token_ids"):
        full_llm.engine.add_request("bad", prompt="Hi", forced_token_ids=[-3])
    with pytest.raises(ValueError, match="forced_token_ids"):
        full_llm.engine.add_request("bad", prompt="Hi", forced_token_ids=[])
    assert not full_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["full", "tangram", "dynamic"])
def test_greedy_output_does_not_depend_on_preemption(mode):
    """A pool too small for three requests at once preempts the newest while it decodes; its
    recompute replays the prompt with its own chunking and the generated tokens whole, so every
    greedy answer equals the one served alone."""
    from tangram_jax.engine.config import build_layout
    from tangram_jax.models.registry import load_model
    cfg = dict(SMALL, chunk_size=32, ratio=0.25)
    max_new = 28
    tok_prompts = [PROMPTS[1], PROMPTS[1].replace("Paul Graham", "Someone"),
                   "Write a short story about a robot who learns to paint. " * 3]
    loaded = load_model(None)
    layout = build_layout(EngineConfig(mode=mode, **cfg), loaded.config,
                          is_embedded=True).with_tail("window", 32)
    lengths = [len(loaded.tokenizer.encode(p)) for p in tok_prompts]
    one = max(int(pages_for(layout.retained_counts(n) + max_new, layout.page_size).sum())
              for n in lengths)
    llm = LLM(mode=mode, num_pages=int(1.6 * one) + 1, **cfg)
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in tok_prompts]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert engine.scheduler.metrics.num_preemptions == 0
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine.scheduler.metrics.num_preemptions > 0
    assert together == alone


def test_weights_load_beside_the_build_and_answer_as_a_load_before_it(tmp_path, monkeypatch):
    """A model whose config is known first (a HF folder) loads its weights on another thread
    while the runner is built and its steps compiled for their shapes (`ModelSource`); the
    tokens and log-probs equal those of the same model loaded before the build (a factory),
    the profile's head permutation included; a load that fails raises its own error from
    `Engine(...)`."""
    from tangram_jax.engine.config import EngineConfig
    from tangram_jax.models import registry
    from tiny_engine import build_tiny_model, tiny_engine_config, tiny_profile

    folder = build_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)

    def answer(engine):
        engine.add_request(prompt="the cat sat on the mat " * 6, sampling_params=params)
        out = [o for o in engine.stream() if o.finished][0].outputs[0]
        return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]

    config = tiny_engine_config(folder, "tangram", compile_cache_dir="off",
                                profile=tiny_profile(str(folder), seed=2, group_size=2))
    beside = Engine(config)
    assert beside.load_overlapped and beside.startup_report()["load_overlapped"]
    assert beside.runner._head_perm is not None   # the profile permutes heads
    before = Engine(EngineConfig(**{**config.__dict__,
                                    "model": lambda: registry.load_model(str(folder))}))
    assert not before.load_overlapped
    ids, logprobs = answer(beside)
    assert ids == answer(before)[0]
    np.testing.assert_allclose(logprobs, answer(before)[1], rtol=0, atol=1e-6)

    def broken(*args, **kwargs):
        raise OSError("model.safetensors: read error")

    monkeypatch.setattr(registry, "_load", broken)
    with pytest.raises(OSError, match="read error"):
        Engine(tiny_engine_config(folder, "full", compile_cache_dir="off"))
