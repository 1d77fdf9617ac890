"""The NNX decoder against Hugging Face transformers (PyTorch CPU) on tiny random models.

Each family is built in transformers with random weights (norms and biases too, so a mapping
mistake cannot hide behind an all-ones or all-zeros tensor), saved as safetensors, loaded by
`load_hf_folder`, and compared on logits.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder, DenseKVCache, dense_attention
from tangram_jax.models.head_permutation import permute_kv_heads
from tangram_jax.models.hf_loader import CheckpointError, decoder_from_state_dict, load_hf_folder

_COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
)

# name -> (config class, model class, extra config). Together they cover: plain RoPE and Llama-3
# scaling, tied and untied heads, q/k/v bias (Qwen2), q/k/v/o bias (Llama attention_bias),
# qk-norm (Qwen3), head_dim != hidden/heads (Qwen3), and a sliding window shorter than the test
# sequences (Mistral).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=5)),
}


def build_tiny_hf_model(family: str, folder, seed: int = 0):
    """Random tiny transformers model of `family`, saved to `folder`; returns the torch model (eval)."""
    config_cls, model_cls, extra = FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**_COMMON, **extra)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_hf_model(request.param, folder)
    config, model = load_hf_folder(folder, jnp.float32)
    return request.param, folder, hf_model, config, model


def run_dense(model: Decoder, config: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Logits `[B, T, V]` of one prefill over unpadded tokens `[B, T]`."""
    batch, t_len = tokens.shape
    cache = DenseKVCache.create(config, batch, t_len + 3, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
    logits, cache = model(jnp.asarray(tokens, jnp.int32), positions, cache)
    assert np.array_equal(np.asarray(cache.lengths), [t_len] * batch)
    return np.asarray(logits)


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_logits_match_transformers(tiny):
    family, _, hf_model, config, model = tiny
    assert config.architecture == {"llama3": "llama"}.get(family, family)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 11))
    ours, ref = run_dense(model, config, tokens), hf_logits(hf_model, tokens)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # the comparison is not between two near-zero tensors
    err = np.abs(ours - ref).max()
    assert err < 1e-4, f"{family}: max abs logit error {err}"


def test_config_facts(tiny):
    family, _, _, config, _ = tiny
    expected = {
        "llama": dict(tie_word_embeddings=False, attention_bias=False, qk_norm=False, rope_scaling=None),
        "llama3": dict(tie_word_embeddings=True, attention_bias=True, o_proj_bias=True, rope_theta=500000.0),
        "qwen2": dict(tie_word_embeddings=True, attention_bias=True, o_proj_bias=False, qk_norm=False),
        "qwen3": dict(qk_norm=True, head_dim=24, attention_bias=False),
        "mistral": dict(sliding_window=5),
    }[family]
    for key, value in expected.items():
        assert getattr(config, key) == value, (family, key)
    if family == "llama3":
        assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.q_per_kv == 2 and config.eos_token_ids == (2,)
    assert config.fingerprint() == dict(architecture=config.architecture, num_layers=2, num_kv_heads=2,
                                        head_dim=config.head_dim, num_heads=4, vocab_size=128)


def test_layer_halves_compose_to_call(tiny):
    """embed -> (qkv, attention, finish) per layer -> logits equals __call__, the engine's contract."""
    _, _, _, config, model = tiny
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, size=(1, 7)), jnp.int32)
    positions = jnp.arange(7, dtype=jnp.int32)[None]
    causal = jnp.tril(jnp.ones((1, 7, 7), bool))
    if config.sliding_window is not None:
        causal &= ~jnp.tril(jnp.ones((1, 7, 7), bool), -config.sliding_window)
    h = model.embed(tokens)
    for layer in model.layers:
        q, k, v = layer.qkv(h, positions)
        assert q.shape == (1, 7, 4, config.head_dim) and k.shape == v.shape == (1, 7, 2, config.head_dim)
        h = layer.finish(h, dense_attention(q, k, v, causal))
    np.testing.assert_allclose(np.asarray(model.logits(h)), run_dense(model, config, np.asarray(tokens)), atol=1e-5)


def test_permute_kv_heads_keeps_logits(tiny):
    family, folder, _, config, _ = tiny
    _, model = load_hf_folder(folder, jnp.float32)  # a private copy: the permutation is in place
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(2, 9))
    before = run_dense(model, config, tokens)
    k_before = np.asarray(model.layers[1].k_proj.kernel[...]).copy()
    perm = np.stack([np.random.default_rng(10 + l).permutation(config.num_kv_heads)
                     for l in range(config.num_layers)])
    perm[1] = [1, 0]  # make sure at least one layer really moves
    permute_kv_heads(model, perm)
    dh = config.head_dim
    np.testing.assert_array_equal(np.asarray(model.layers[1].k_proj.kernel[...])[:, :dh], k_before[:, dh:])
    after = run_dense(model, config, tokens)
    np.testing.assert_allclose(after, before, atol=1e-4, rtol=0)  # summation order moves; heads do not


def test_permute_kv_heads_rejects_bad_permutations(tiny):
    _, _, _, config, model = tiny
    with pytest.raises(ValueError, match="shape"):
        permute_kv_heads(model, np.zeros((config.num_layers, config.num_kv_heads + 1), np.int64))
    with pytest.raises(ValueError, match="permutation"):
        permute_kv_heads(model, np.zeros((config.num_layers, config.num_kv_heads), np.int64))


def test_bf16_model_runs_close_to_fp32(tiny):
    family, folder, hf_model, config, model = tiny
    _, model16 = load_hf_folder(folder, jnp.bfloat16)
    assert model16.layers[0].q_proj.kernel[...].dtype == jnp.bfloat16
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, size=(2, 8))
    ours16, ours32 = run_dense(model16, config, tokens), run_dense(model, config, tokens)
    assert ours16.dtype == np.float32 and np.isfinite(ours16).all()
    scale = np.abs(ours32).max()
    assert np.abs(ours16 - ours32).max() < 0.1 * scale, family
    # The same bf16 weights in transformers agree with us about as well as bf16 allows.
    ref16 = hf_logits(hf_model.to(torch.bfloat16), tokens)
    hf_model.to(torch.float32)
    assert np.abs(ours16 - ref16).max() < 0.1 * scale, family


# ---------------------------------------------------------------------------------- bad input

def _llama_dict(**overrides):
    d = dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2)
    d.update(overrides)
    return d


def test_unknown_architecture_is_named():
    with pytest.raises(ValueError, match=r"unknown architecture.*gpt_neox.*supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict(_llama_dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]))
    # A known class name in `architectures` is enough when model_type is absent.
    d = _llama_dict(architectures=["Qwen2ForCausalLM"])
    del d["model_type"]
    assert ModelConfig.from_hf_dict(d).architecture == "qwen2"


def test_unsupported_rope_type_rejected():
    with pytest.raises(ValueError, match="unknown RoPE scaling type 'longrope'"):
        ModelConfig.from_hf_dict(_llama_dict(rope_scaling=dict(type="longrope", factor=4.0)))
    # The transformers 4.x layout (top-level rope_theta, rope_scaling with "rope_type") is read too.
    config = ModelConfig.from_hf_dict(_llama_dict(rope_theta=5e5, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)))
    assert config.rope_theta == 5e5 and config.rope_scaling["factor"] == 8.0


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_folder(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_llama_dict(model_type="bert", architectures=["BertModel"])))
    with pytest.raises(ValueError, match="unknown architecture.*bert"):
        load_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_llama_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf_folder(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path):
    build_tiny_hf_model("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_hf_folder(tmp_path)
    weights.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_hf_folder(tmp_path)
    weights.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt"):
        load_hf_folder(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = build_tiny_hf_model("qwen3", tmp_path / "whole")
    hf_model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config, model = load_hf_folder(tmp_path / "sharded")
    tokens = np.arange(6)[None] * 7 % 128
    np.testing.assert_allclose(run_dense(model, config, tokens), hf_logits(hf_model, tokens), atol=1e-4)
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"shard files that do not exist.*{shards[-1]}"):
        load_hf_folder(tmp_path / "sharded")


def test_state_dict_errors_name_the_tensor():
    config = ModelConfig.from_hf_dict(_llama_dict())
    rng = np.random.default_rng(0)
    good = {}
    good["model.embed_tokens.weight"] = rng.normal(size=(128, 64)).astype(np.float32)
    good["model.norm.weight"] = np.ones(64, np.float32)
    good["lm_head.weight"] = rng.normal(size=(128, 64)).astype(np.float32)
    for i in range(2):
        p = f"model.layers.{i}"
        for name, shape in [("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (96, 64)), ("mlp.up_proj", (96, 64)), ("mlp.down_proj", (64, 96))]:
            good[f"{p}.{name}.weight"] = rng.normal(size=shape).astype(np.float32)
        good[f"{p}.input_layernorm.weight"] = np.ones(64, np.float32)
        good[f"{p}.post_attention_layernorm.weight"] = np.ones(64, np.float32)
    model = decoder_from_state_dict(config, good, jnp.float32)
    np.testing.assert_array_equal(np.asarray(model.layers[1].k_proj.kernel[...]),
                                  good["model.layers.1.self_attn.k_proj.weight"].T)

    missing = dict(good)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        decoder_from_state_dict(config, missing, jnp.float32)
    bad_shape = dict(good, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(64, 64\), expected \(32, 64\)"):
        decoder_from_state_dict(config, bad_shape, jnp.float32)
    extra = dict(good, **{"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"not used by a llama model with 2 layers: 'model\.layers\.2"):
        decoder_from_state_dict(config, extra, jnp.float32)
