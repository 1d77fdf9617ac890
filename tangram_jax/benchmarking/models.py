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


def random_model_config(name: str):
    """The `ModelConfig` of a random model name (`RANDOM_8B` or `RANDOM_TINY`)."""
    shapes = {RANDOM_8B: LLAMA_8B, RANDOM_TINY: TINY}
    if name not in shapes:
        raise ValueError(f"random model must be one of {tuple(shapes)}, got {name!r}")
    return model_config(shapes[name])


def random_model(name: str = RANDOM_8B, dtype: str = "bfloat16", seed: int = 0):
    """A `LoadedModel` of `name` (`RANDOM_8B` or `RANDOM_TINY`) with random weights, and a
    word-level tokenizer over its ids (``t0`` .. ``t{vocab-1}``)."""
    import jax.numpy as jnp
    import tokenizers
    from flax import nnx
    from tokenizers import models, pre_tokenizers

    from tangram_jax.models.decoder import Decoder
    from tangram_jax.models.registry import LoadedModel
    from tangram_jax.models.tokenizer import Tokenizer

    config = random_model_config(name)
    model = Decoder(config, jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    backend = tokenizers.Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, eos_token_ids=config.eos_token_ids)
    return LoadedModel(config, model, tokenizer, name, None)
