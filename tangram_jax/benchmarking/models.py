"""The random Llama-3.1-8B-shaped model of the GPU benchmarks, built on the device in seconds
(no file: 16 GB of safetensors would take longer to write and read than a whole run)."""

from __future__ import annotations

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128)
# CPU smoke tests of the same paths: the KV shape of the 8B model, everything else small.
TINY = dict(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_layers=2,
            num_heads=8, num_kv_heads=8, head_dim=128)
RANDOM_8B = "random-llama-8b"
RANDOM_TINY = "random-tiny"


def model_config(shape: dict):
    """A Llama-3.1 `ModelConfig` of `shape` (one of the dicts above)."""
    from tangram_jax.models.config import ModelConfig
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                       max_position_embeddings=131072, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=False, bos_token_id=128000,
                       eos_token_ids=(128001,), **shape)


def random_model_config(name: str, num_layers: int | None = None):
    """The `ModelConfig` of a random model name (`RANDOM_8B` or `RANDOM_TINY`), with
    `num_layers` layers instead of the shape's where given (checks of per-layer paths at the
    real widths that need not pay for every layer)."""
    shapes = {RANDOM_8B: LLAMA_8B, RANDOM_TINY: TINY}
    if name not in shapes:
        raise ValueError(f"random model must be one of {tuple(shapes)}, got {name!r}")
    if num_layers is not None and not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    return model_config(dict(shapes[name], num_layers=num_layers or shapes[name]["num_layers"]))


def random_model(name: str = RANDOM_8B, dtype: str = "bfloat16", seed: int = 0,
                 num_layers: int | None = None):
    """A `LoadedModel` of `name` (`RANDOM_8B` or `RANDOM_TINY`; `num_layers` as in
    `random_model_config`) with random weights, and a word-level tokenizer over its ids
    (``t0`` .. ``t{vocab-1}``)."""
    import jax.numpy as jnp
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from tangram_jax.models.registry import LoadedModel
    from tangram_jax.models.tokenizer import Tokenizer

    config = random_model_config(name, num_layers)
    model = random_decoder(config, jnp.dtype(dtype), seed)
    backend = tokenizers.Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, eos_token_ids=config.eos_token_ids)
    return LoadedModel(config, model, tokenizer, name, None)


def random_decoder(config, dtype, seed: int = 0, placement=None):
    """A `Decoder` of `config` whose weights are random, made on the device: matrices normal
    with std fan_in^-0.5 (the embedding 0.02), norm scales at their identity, biases and sinks
    zero. One compiled generator per (shape, scale, sharding) takes the weight's key as an
    argument, so the layers share theirs: an 8B model costs a few small compiles and a few
    hundred calls. (Built op by op, `Decoder(..., rngs=)` takes Python's lock for every
    initialiser, which slows a build lowering beside it; one program for every weight makes
    XLA constant-fold the keys.) `placement`: an `engine.tensor_parallel.Placement` whose
    `weight_sharding` each weight is made in (default: the default device)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tangram_jax.models.decoder import Decoder

    dtype = jnp.dtype(dtype)
    graphdef, state = nnx.split(Decoder.abstract(config, dtype))
    makers = {}
    for index, (path, var) in enumerate(nnx.to_flat_state(state)):
        if not isinstance(var, nnx.Param):
            continue   # per-layer constants: `set_constants` below
        shape, name = var.get_value().shape, str(path[-1])
        sharding = None if placement is None else placement.weight_sharding(path, len(shape))
        if "bias" in name or name == "sinks":
            fill = 0.0
        elif name == "weight":   # an RMSNorm scale: w, or 1 + w where `norm_unit_offset`
            fill = 0.0 if config.norm_unit_offset else 1.0
        else:
            fill = None
            std = 0.02 if name == "embed_tokens" else shape[-2] ** -0.5
        cache_key = (shape, fill, None if fill is not None else std, sharding)
        if cache_key not in makers:
            if fill is not None:
                make = (lambda seed, index, shape=shape, fill=fill:
                        jnp.full(shape, fill, dtype))
            else:
                make = (lambda seed, index, shape=shape, std=std:
                        (jax.random.normal(jax.random.fold_in(jax.random.key(seed), index),
                                           shape, jnp.float32) * std).astype(dtype))
            makers[cache_key] = jax.jit(make, out_shardings=sharding)
        var.set_value(makers[cache_key](seed, index))
    model = nnx.merge(graphdef, state)
    model.set_constants()
    return model


def random_model_source(name: str = RANDOM_8B, dtype: str = "bfloat16", seed: int = 0,
                        num_layers: int | None = None):
    """`random_model(...)` as a `registry.ModelSource` (config known, weights made when
    loaded): an engine given it builds its steps while the weights are made."""
    import jax.numpy as jnp

    from tangram_jax.models.registry import ModelSource

    return ModelSource(name, None, random_model_config(name, num_layers), jnp.dtype(dtype),
                       lambda: random_model(name, dtype, seed, num_layers))


# Hugging Face config.json facts of the paper's other model shapes (random weights only), and
# tiny CPU smoke-test versions of each (same families, small sizes).
FAMILY_SHAPES = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=151645),
    "gemma3-12b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=15360, vocab_size=262208, max_position_embeddings=131072,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), rms_norm_eps=1e-6,
        eos_token_id=[1, 106]),
}
# The serving benchmarks' 8B shape as a family entry (the dense baseline of the TP profiles).
FAMILY_SHAPES["llama3-8b"] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=128001)
FAMILY_SHAPES["qwen3-moe-tiny"] = dict(
    FAMILY_SHAPES["qwen3-30b-a3b"], hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=8,
    num_experts_per_tok=2, vocab_size=512)
FAMILY_SHAPES["gemma3-tiny"] = dict(
    FAMILY_SHAPES["gemma3-12b"], hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=512,
    sliding_window=64, sliding_window_pattern=3)


def family_config(name: str):
    """The `ModelConfig` of a `FAMILY_SHAPES` entry."""
    from tangram_jax.models.config import ModelConfig
    if name not in FAMILY_SHAPES:
        raise ValueError(f"model shape must be one of {tuple(FAMILY_SHAPES)}, got {name!r}")
    return ModelConfig.from_hf_dict(FAMILY_SHAPES[name])
