"""Gemma-3, Qwen3-MoE and GPT-OSS against Hugging Face transformers (PyTorch CPU) on tiny random
checkpoints (`tiny_families`): logits of the dense decoder, greedy generation of the dense
reference, and greedy tokens and log-probabilities of the paged engine in `full` mode and in
`tangram` mode at ratio 1, for prompts far longer than the local layers' window.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import causal_mask, dense_attention
from tangram_jax.models.head_permutation import permute_kv_heads
from tangram_jax.models.hf_loader import CheckpointError, decoder_from_state_dict, load_hf_folder
from tangram_jax.reference import generate_dense
from tangram_jax.sampling import SamplingParams
from test_decoder import hf_logits, run_dense
from tiny_families import FAMILIES, WINDOW, build_family_model

PROMPT_LENGTHS = (23, 40, 9)      # past the window of 6, several 16-token chunks, one short
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_family_model(request.param, folder)
    config, model = load_hf_folder(folder, jnp.float32)
    return request.param, folder, hf_model, config, model


def hf_greedy(hf_model, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]


def test_config_facts(tiny):
    family, _, _, config, _ = tiny
    assert config.architecture == family
    if family == "gemma3":
        assert config.layer_windows == (WINDOW, 0, WINDOW, WINDOW)
        assert config.local_rope_theta == 100.0 and config.rope_scaling["rope_type"] == "linear"
        assert config.query_pre_attn_scalar == 24 and config.final_logit_softcapping == 30.0
        assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
        assert config.moe is None
    elif family == "qwen3_moe":
        assert config.layer_windows == (0,) * 4 and config.qk_norm
        assert (config.moe.num_experts, config.moe.top_k, config.moe.routing) == (8, 2,
                                                                                 "softmax_topk")
        assert config.moe.norm_topk_prob
    else:
        assert config.layer_windows == (WINDOW, 0, WINDOW, 0) and config.attention_sinks
        assert config.moe.routing == "topk_softmax" and config.moe.activation == "clamped_swiglu"
        assert config.rope_scaling["rope_type"] == "yarn" and config.attention_bias
    assert config.fingerprint()["num_layers"] == 4


def test_logits_match_transformers_past_the_window(tiny):
    family, _, hf_model, config, model = tiny
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 40))
    ours, ref = run_dense(model, config, tokens), hf_logits(hf_model, tokens)
    assert np.abs(ref).max() > 1.0  # the comparison is not between two near-zero tensors
    err = np.abs(ours - ref).max()
    assert err < 1e-4, f"{family}: max abs logit error {err}"
    if config.local_layers:
        # The window is what makes them equal: the same weights with every layer global differ.
        unwindowed = dataclasses.replace(config, layer_types=None, sliding_window=None)
        _, state = load_state(tiny)
        globally = decoder_from_state_dict(unwindowed, state, jnp.float32)
        assert np.abs(run_dense(globally, unwindowed, tokens) - ref).max() > 1e-2


def load_state(tiny):
    from tangram_jax.models.hf_loader import read_hf_folder
    return read_hf_folder(tiny[1])


def test_greedy_dense_reference_matches_transformers(tiny):
    family, _, hf_model, config, model = tiny
    singles = [generate_dense(model, config, [p], SamplingParams(temperature=0,
                                                                 max_tokens=MAX_TOKENS),
                              eos_token_ids=())[0] for p in prompts()]
    for prompt, ours in zip(prompts(), singles):
        assert ours == hf_greedy(hf_model, prompt, MAX_TOKENS), (family, len(prompt))
    batched = generate_dense(model, config, prompts(),
                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS), eos_token_ids=())
    assert batched == singles


def test_layer_halves_compose_to_call(tiny):
    """embed -> (qkv, attention with the layer's window and sinks, finish) -> logits equals
    __call__: the contract the engine and calibration run the layers by."""
    _, _, _, config, model = tiny
    t = 20
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 200, size=(1, t)), jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    h = model.embed(tokens)
    for layer in model.layers:
        q, k, v = layer.qkv(h, positions)
        mask = causal_mask(positions, positions[0], layer.attention_window())
        h = layer.finish(h, dense_attention(q, k, v, mask, layer.attention_sinks()))
    np.testing.assert_allclose(np.asarray(model.logits(h)),
                               run_dense(model, config, np.asarray(tokens)), atol=1e-5)


def test_permute_kv_heads_keeps_logits(tiny):
    _, folder, _, config, _ = tiny
    _, model = load_hf_folder(folder, jnp.float32)  # a private copy: the permutation is in place
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(2, 20))
    before = run_dense(model, config, tokens)
    perm = np.tile([1, 0], (config.num_layers, 1))
    permute_kv_heads(model, perm)
    np.testing.assert_allclose(run_dense(model, config, tokens), before, atol=1e-4, rtol=0)


def test_bf16_model_runs_close_to_fp32(tiny):
    family, folder, _, config, model = tiny
    _, model16 = load_hf_folder(folder, jnp.bfloat16)
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, size=(2, 20))
    ours16, ours32 = run_dense(model16, config, tokens), run_dense(model, config, tokens)
    assert np.isfinite(ours16).all()
    assert np.abs(ours16 - ours32).max() < 0.1 * np.abs(ours32).max(), family


# ----------------------------------------------------------------------------- the engine

ENGINE = dict(max_num_seqs=4, num_pages=160, max_model_len=256, chunk_size=16, page_size=8,
              max_num_batched_tokens=64, decode_buckets=(4,), dtype="float32")


def identity_profile(config: ModelConfig, folder) -> BudgetProfile:
    """A tangram profile of budget 1 everywhere (ratio 1), heads in reversed order, one head a
    group: the engine's tangram layout with nothing dropped."""
    layers, heads = config.num_layers, config.num_kv_heads
    ones = np.ones((layers, heads))
    return BudgetProfile(model=dict(config.fingerprint(), name=str(folder)), method="snapkv",
                         rho=1.0, lambda_=2.0, mean=ones, std=np.zeros_like(ones), budget=ones,
                         group_size=1, grouping="budget",
                         head_perm=np.tile(np.arange(heads)[::-1], (layers, 1)),
                         group_budgets=ones)


@pytest.mark.parametrize("mode", ["full", "tangram"])
def test_engine_greedy_tokens_and_logprobs_match_transformers(tiny, mode):
    """The paged engine (CPU serving path: windowed history blocks, sinks, experts) generates
    transformers' greedy tokens, and each token's log-probability is transformers' log-softmax
    at that position."""
    from tangram_jax import LLM
    family, folder, hf_model, config, _ = tiny
    extra = dict(profile=identity_profile(config, folder)) if mode == "tangram" else {}
    llm = LLM(model=str(folder), mode=mode, **ENGINE, **extra)
    if mode == "tangram":
        assert llm.engine.layout.num_groups == config.num_kv_heads
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([dict(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
    for prompt, out in zip(prompts(), outs):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(hf_model, prompt, MAX_TOKENS), (family, mode, len(prompt))
        ref = torch.log_softmax(torch.as_tensor(hf_logits(hf_model, [prompt + tokens])[0]), -1)
        for i, (entry, token) in enumerate(zip(out.outputs[0].logprobs, tokens)):
            want = float(ref[len(prompt) - 1 + i, token])
            assert abs(entry[token].logprob - want) < 1e-4, (family, mode, i)


# ----------------------------------------------------------------------------- bad input

def _gemma_dict(**overrides):
    d = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=128, max_position_embeddings=64, sliding_window=6,
             rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=2)
    d.update(overrides)
    return d


def test_gemma3_transformers_4_layout_is_read():
    """The 4.x config.json of the Hub's Gemma-3 checkpoints: rope_theta, rope_local_base_freq,
    rope_scaling and the sliding_window_pattern (every pattern-th layer global)."""
    config = ModelConfig.from_hf_dict(_gemma_dict(rope_scaling=dict(rope_type="linear",
                                                                    factor=8.0)))
    assert config.layer_windows == (6, 0, 6, 0)
    assert (config.rope_theta, config.local_rope_theta) == (10000.0, 100.0)
    assert config.rope_scaling == dict(rope_type="linear", factor=8.0)
    assert config.query_pre_attn_scalar == 256 and config.final_logit_softcapping is None


def test_unsupported_family_settings_are_named():
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict(_gemma_dict(attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(_gemma_dict(use_bidirectional_attention=True))
    moe = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4,
               num_attention_heads=4, intermediate_size=96, vocab_size=128,
               max_position_embeddings=64, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32)
    assert ModelConfig.from_hf_dict(moe).moe.num_experts == 8
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\].*every layer must be"):
        ModelConfig.from_hf_dict(dict(moe, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.from_hf_dict(dict(moe, num_experts_per_tok=9))


def test_mxfp4_experts_dequantize_as_transformers(tiny):
    """The Hub's GPT-OSS experts are MXFP4 (`*_blocks` / `*_scales`): dequantized at load as
    transformers' `convert_moe_packed_tensors` does, into the unquantized layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from tangram_jax.models.hf_loader import dequantize_mxfp4
    family, folder, _, config, _ = tiny
    if family != "gpt_oss":
        pytest.skip("GPT-OSS checkpoints only")
    _, state = load_state(tiny)
    rng = np.random.default_rng(6)
    e, d, i = 8, 64, 32
    packed = {}
    for proj, (rows, cols) in (("gate_up_proj", (2 * i, d)), ("down_proj", (d, i))):
        name = f"model.layers.0.mlp.experts.{proj}"
        blocks = rng.integers(0, 256, size=(e, rows, cols // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 130, size=(e, rows, cols // 32), dtype=np.uint8)
        want = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales),
                                          dtype=torch.float32).numpy()
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), want)
        assert want.shape == state[name].shape
        del state[name]
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        packed[proj] = want
    moe = decoder_from_state_dict(config, state).layers[0].moe
    gate_up = packed["gate_up_proj"]   # interleaved gate / up columns, split at load
    np.testing.assert_array_equal(np.asarray(moe.gate_up[...]),
                                  np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], -1))
    np.testing.assert_array_equal(np.asarray(moe.down[...]), packed["down_proj"])
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    with pytest.raises(CheckpointError, match="down_proj_blocks has no"):
        decoder_from_state_dict(config, state)


def test_engine_refuses_what_would_drop_a_window(tiny):
    """Local layers keep every token (kv_layout, "Local layers"): dynamic mode, precision tiers
    and a profile with a local layer's budget below 1 are refused, naming the layers."""
    from tangram_jax.engine.config import EngineConfig, EngineConfigError
    family, folder, _, config, _ = tiny
    if not config.local_layers:
        pytest.skip("a model without local layers")
    with pytest.raises(EngineConfigError, match="dynamic mode"):
        EngineConfig(model=str(folder), mode="dynamic", ratio=0.5, **ENGINE).resolve(config)
    profile = identity_profile(config, folder)
    low = profile.group_budgets.copy()
    low[config.local_layers[0]] = 0.5
    low_profile = dataclasses.replace(profile, group_budgets=low, budget=low, mean=low)
    with pytest.raises(EngineConfigError, match=r"budgets must be 1.*layers \[0\]"):
        EngineConfig(model=str(folder), mode="tangram", profile=low_profile,
                     **ENGINE).resolve(config)
    # Sequences no longer than the window: the window never masks, every layer is global.
    short = dict(ENGINE, max_model_len=WINDOW)
    resolved = EngineConfig(model=str(folder), mode="tangram", profile=low_profile,
                            **short).resolve(config)
    assert resolved.layout.compresses


# ----------------------------------------------------------------------------- the checkpoints

def test_saved_config_round_trips(tiny):
    _, folder, _, config, _ = tiny
    raw = json.loads((folder / "config.json").read_text())
    assert ModelConfig.from_hf_dict(raw) == config
    assert hash(ModelConfig.from_hf_dict(raw)) == hash(config)
    # The per-layer constants are state: one layer structure serves every layer kind.
    graphdefs = [nnx.split(layer)[0] for layer in load_hf_folder(folder)[1].layers]
    assert all(g == graphdefs[0] for g in graphdefs)


def test_calibration_pads_samples_to_few_programs_with_the_same_counts(tiny):
    """Pilot samples padded to `padded_length` (one compiled layer program per padded length)
    give the counts and high-tier shares of the samples run alone, local layers and sinks
    included."""
    from tangram_jax.compression.calibration import padded_length, run_calibration
    from tangram_jax.compression.pilot_data import PilotSample
    _, _, _, config, model = tiny
    rng = np.random.default_rng(7)
    samples = [PilotSample("random", n, tuple(int(t) for t in rng.integers(3, 256, size=n)))
               for n in (37, 45)]
    assert {padded_length(len(s.tokens)) for s in samples} == {48}
    runs = [run_calibration(model, config, samples, rhos=(0.25, 0.5), tier_mass=0.9, pad=pad)
            for pad in (True, False)]
    for rho in (0.25, 0.5):
        np.testing.assert_array_equal(runs[0].retention[rho], runs[1].retention[rho])
        np.testing.assert_allclose(runs[0].high_share[rho], runs[1].high_share[rho])


def test_calibration_pins_local_layers_and_the_profile_serves(tiny):
    """Calibration runs the local layers with their window (and sinks) but keeps them whole:
    their budgets are 1, the global layers' follow the ratio; the engine serves the profile in
    tangram mode, compressing the global layers only."""
    from tangram_jax import LLM
    from tangram_jax.compression.calibration import profile_from_run, run_calibration
    from tangram_jax.compression.pilot_data import PilotSample
    family, folder, _, config, model = tiny
    if not config.local_layers:
        pytest.skip("a model without local layers")
    rng = np.random.default_rng(5)
    samples = [PilotSample("random", 48, tuple(int(t) for t in rng.integers(3, 256, size=48)))
               for _ in range(2)]
    run = run_calibration(model, config, samples, rhos=(0.25,))
    # A tokenizer that does not match the model: one clear error, not clamped embeddings.
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        run_calibration(model, config, [PilotSample("random", 2, (3, config.vocab_size))],
                        rhos=(0.25,))
    local, full = list(config.local_layers), [i for i in range(4) if i not in config.local_layers]
    retention = run.retention[0.25]
    assert (retention[:, local] == 1).all() and (retention[:, full] < 0.75).all()
    profile = profile_from_run(run, 0.25, model=dict(config.fingerprint(), name=str(folder)),
                               rescale=True)
    assert (profile.budget[local] == 1).all()
    np.testing.assert_allclose(profile.budget[full].mean(axis=1), 0.25)
    llm = LLM(model=str(folder), mode="tangram", profile=profile, **ENGINE)
    layout = llm.engine.layout
    assert layout.compresses and (layout.group_budgets[local] == 1).all()
    out = llm.generate([dict(prompt_token_ids=p) for p in prompts()],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
