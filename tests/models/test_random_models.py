"""The benchmarks' random-weight models (`benchmarking.models`): made by one compiled generator
per weight shape, so the 8B shape's load is a few compiles and a few hundred calls."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from compile_events import compiles_on_this_thread
from tangram_jax.benchmarking.models import (
    RANDOM_TINY, family_config, random_decoder, random_model_config)


def _params(model) -> dict:
    return {"/".join(map(str, path)): np.asarray(var.get_value(), np.float32)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_layers_share_their_generators_and_get_their_own_weights():
    compiles = compiles_on_this_thread()
    counts = []
    for layers in (1, 2, 4):   # the first also compiles what every build shares
        before = len(compiles)
        model = random_decoder(random_model_config(RANDOM_TINY, num_layers=layers),
                               jnp.float32, seed=3)
        counts.append(len(compiles) - before)
    assert counts[1] == counts[2] <= 6, f"compiles by depth 1, 2, 4: {counts}"

    params = _params(model)
    assert not np.array_equal(params["layers/0/q_proj/kernel"], params["layers/1/q_proj/kernel"])
    assert not np.array_equal(params["layers/0/q_proj/kernel"], params["layers/0/k_proj/kernel"])
    np.testing.assert_allclose(params["layers/2/q_proj/kernel"].std(), 1024 ** -0.5, rtol=0.02)
    np.testing.assert_allclose(params["embed_tokens"].std(), 0.02, rtol=0.02)
    assert np.all(params["layers/3/input_norm/weight"] == 1.0)
    again = _params(random_decoder(random_model_config(RANDOM_TINY, num_layers=4),
                                   jnp.float32, seed=3))
    assert all(np.array_equal(params[k], again[k]) for k in params), "a seed must repeat"


def test_gemma_norms_are_at_identity_and_moe_biases_zero():
    gemma = _params(random_decoder(family_config("gemma3-tiny"), jnp.bfloat16))
    assert np.all(gemma["layers/0/q_norm/weight"] == 0.0)     # scaled by 1 + w
    assert gemma["layers/0/q_proj/kernel"].dtype == np.float32   # (read back as float32)
    moe = random_decoder(family_config("qwen3-moe-tiny"), jnp.float32)
    tokens = jnp.arange(6, dtype=jnp.int32)[None]
    logits = moe.logits(moe.embed(tokens))
    assert logits.shape == (1, 6, moe.config.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
