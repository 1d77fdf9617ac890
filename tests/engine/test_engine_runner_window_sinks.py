"""The runner's glue for local layers and attention sinks, on both attention implementations: the
Pallas kernels (interpreted on the CPU, what a GPU runs) and the CPU serving path give the dense
reference's logits and greedy tokens for a tiny GPT-OSS-shaped model (a local layer of window 5
between global ones, sinks, experts), prefilled in pieces whose history reaches past the window,
under each way of looping over the layers."""


import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tangram_jax.engine.model_runner import AttentionOps, ModelRunner, RunnerConfig
from tangram_jax.kv_layout import KVLayout
from tangram_jax.models.config import ModelConfig, MoEConfig
from tangram_jax.models.decoder import Decoder, DenseKVCache
from tangram_jax.pallas_kernels.split_map import build_split_map
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from tiny_engine import prefill_then_decode

CONFIG = ModelConfig(
    architecture="gpt_oss", vocab_size=97, hidden_size=32, intermediate_size=16, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False,
    attention_bias=True, o_proj_bias=True, qk_norm=False, bos_token_id=None, eos_token_ids=(0,),
    sliding_window=5, layer_types=("full_attention", "sliding_attention", "full_attention"),
    attention_sinks=True,
    moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, routing="topk_softmax",
                  router_bias=True, expert_bias=True, activation="clamped_swiglu"))
LAYOUT = KVLayout.monolithic(3, 2, 8, page_size=4, chunk_size=16)
TOKENS = np.random.default_rng(0).integers(1, 97, 27)


def make_model() -> Decoder:
    model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for layer in model.layers:          # sinks that matter (they start at 0)
        layer.sinks.set_value(jnp.asarray(rng.normal(size=4) * 2, jnp.float32))
    return model


def kernel_ops() -> AttentionOps:
    """The Pallas kernels (interpreted on the CPU: the GPU path's code)."""
    return AttentionOps.for_backend(use_kernels=True)


@pytest.fixture(scope="module")
def dense():
    """Logits of every position (one dense pass) and the greedy continuation."""
    from tangram_jax.reference import generate_dense
    from tangram_jax.sampling import SamplingParams
    model = make_model()
    cache = DenseKVCache.create(CONFIG, 1, len(TOKENS))
    logits = np.asarray(model(jnp.asarray(TOKENS[None], jnp.int32),
                              jnp.arange(len(TOKENS), dtype=jnp.int32)[None], cache)[0][0])
    tokens = generate_dense(model, CONFIG, [TOKENS.tolist()],
                            SamplingParams(temperature=0, max_tokens=4), eos_token_ids=())[0]
    return logits, tokens


@pytest.mark.parametrize("ops, layer_loop", [("pallas", "unrolled"), ("pallas", "switch"),
                                             ("xla", "switch"), ("xla", "scan")])
def test_runner_equals_dense_reference(dense, ops, layer_loop):
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    runner = ModelRunner(make_model(), CONFIG, LAYOUT, 64, manager.block_tables.shape,
                         split_maps={1: build_split_map(LAYOUT.group_budgets, 8, 1,
                                                        group_size=LAYOUT.group_size)},
                         runner_config=RunnerConfig(mode="full", layer_loop=layer_loop),
                         ops=kernel_ops() if ops == "pallas" else None)
    assert runner.ops.name == ops
    logits, decoded, _ = prefill_then_decode(runner, manager, LAYOUT, TOKENS)
    want_logits, want_tokens = dense
    # Each 16-token piece's last logits: the second piece's history (16) is past the window.
    np.testing.assert_allclose(logits, want_logits[[15, 26]], atol=2e-4, rtol=0)
    assert decoded == want_tokens
