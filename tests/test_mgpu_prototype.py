"""The Mosaic GPU decode prototype (benchmarks/prototypes, not used by the engine) still builds:
lowered for an H100 on the CPU, where Mosaic GPU's layout inference and dialect lowering run
(its numerics are checked on the GPU by benchmarks/prototypes/mgpu_ab.py), and it refuses
page formats it does not read."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from tangram_jax import kv_quant

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "prototypes"))
dm = pytest.importorskip("decode_attention_mgpu")

S = jax.ShapeDtypeStruct


def _pool(bits, page_size, width, pages=64):
    return kv_quant.QuantPages(S((pages, 2, page_size, width), jnp.uint8),
                               S((pages, 2, page_size), jnp.float32),
                               S((pages, 2, page_size), jnp.float32), bits,
                               jnp.dtype(jnp.bfloat16))


def _args(page_size=32, key_bits=4, value_bits=2):
    return (S((2, 4, 8, 128), jnp.bfloat16),
            _pool(key_bits, page_size, 128 * key_bits // 8),
            _pool(value_bits, page_size, 128 * value_bits // 8),
            S((2, 4, 16), jnp.int32), S((2, 4), jnp.int32), S((6, 3), jnp.int32))


def test_lowers_for_hopper():
    text = dm.decode_partials_mgpu.trace(*_args()).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=16), "page_size must be 32 or 64"),
    (dict(key_bits=8, value_bits=4), "reads K4V2 pools"),
])
def test_refuses_other_formats(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dm.decode_partials_mgpu.trace(*_args(**kwargs))
