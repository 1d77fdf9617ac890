"""Reorders each layer's KV heads at weight-load time so every head group is a contiguous slice.

Attention is invariant under a permutation of its KV heads as long as each KV head keeps its own
query heads and the output projection reads the heads' outputs in the new order. So for new KV
head j = old head perm[j], per layer:

  * W_k, W_v (and biases): head blocks of output columns reordered by perm;
  * W_q (and bias): query-head blocks reordered the same way, each KV head's q_per_kv query heads
    moving together (query head i reads KV head i // q_per_kv before and after);
  * W_o: the input rows (HF: input columns) reordered to match the new query-head order.

Qwen3's q/k norms share one weight across heads and need no change; GPT-OSS's attention sinks
(one per query head) move with their query heads. The model's outputs are
unchanged; only the head index order inside every layer moves.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tangram_jax.models.decoder import Decoder


def validate_head_permutation(head_perm, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """`[layers, kv_heads]` int array with every row a permutation of range(kv_heads), else ValueError."""
    perm = np.asarray(head_perm)
    if perm.shape != (num_layers, num_kv_heads):
        raise ValueError(f"head_perm must have shape (layers, kv_heads) = {(num_layers, num_kv_heads)}, got {perm.shape}")
    if not np.issubdtype(perm.dtype, np.integer):
        raise ValueError(f"head_perm must hold integers, got dtype {perm.dtype}")
    expected = np.arange(num_kv_heads)
    for layer, row in enumerate(perm):
        if not np.array_equal(np.sort(row), expected):
            raise ValueError(f"head_perm[{layer}] = {row.tolist()} is not a permutation of 0..{num_kv_heads - 1}")
    return perm.astype(np.int64)


def permute_kv_heads(model: Decoder, head_perm: np.ndarray) -> None:
    """In place: per layer l, new KV head j = old KV head head_perm[l, j] (with its query heads)."""
    config = model.config
    perm = validate_head_permutation(head_perm, config.num_layers, config.num_kv_heads)
    hkv, qpk, dh = config.num_kv_heads, config.q_per_kv, config.head_dim

    def reorder_columns(param, heads_shape):
        # Kernel [in, heads * dh] or bias [heads * dh]: the head axis follows the leading dims.
        value = param[...]
        lead = value.shape[:-1]
        blocks = value.reshape(*lead, *heads_shape, dh)
        param.set_value(jnp.take(blocks, perm_l, axis=len(lead)).reshape(value.shape))

    for layer, perm_l in zip(model.layers, perm):
        perm_l = jnp.asarray(perm_l)
        for proj in (layer.k_proj, layer.v_proj):
            reorder_columns(proj.kernel, (hkv,))
            if proj.bias is not None:
                reorder_columns(proj.bias, (hkv,))
        reorder_columns(layer.q_proj.kernel, (hkv, qpk))
        if layer.q_proj.bias is not None:
            reorder_columns(layer.q_proj.bias, (hkv, qpk))
        if layer.sinks is not None:   # [Hq]: one per query head, moved with it
            sinks = layer.sinks[...].reshape(hkv, qpk)
            layer.sinks.set_value(jnp.take(sinks, perm_l, axis=0).reshape(-1))
        w_o = layer.o_proj.kernel[...]  # [Hq * dh, D]
        w_o = jnp.take(w_o.reshape(hkv, qpk * dh, w_o.shape[-1]), perm_l, axis=0).reshape(w_o.shape)
        layer.o_proj.kernel.set_value(w_o)
