"""What local layers and attention sinks change in attention, for every attention path.

Window (`ModelConfig.layer_windows`): in a local layer a query at slot t sees key slots
> t - window. Slots are positions in a local layer because a local layer keeps every token
(budget 1, `tangram_jax.kv_layout`), so the mask is by slot. The window is a per-layer int32
scalar, traced (the engine's loops over layers compile one body), 0 for a global layer; the
attention functions take ``window=None`` (statically: the model has no local layer, nothing
changes) or that scalar.

Sinks (GPT-OSS): a learned logit s_h per query head joins every softmax's denominator, as a key
whose value is zero. Given a query's output o and log-sum-exp L over its real keys, the sink
only rescales: ``o' = o * exp(L) / (exp(L) + exp(s)) = o * sigmoid(L - s)`` and
``L' = logaddexp(L, s)``, so the kernels run unchanged and `apply_sinks` follows them (the
decode merge, which has no L outside it, takes the sink in its denominator instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A window of "no window": larger than any slot.
NO_WINDOW = 1 << 30


def effective_window(window) -> jax.Array:
    """int32 scalar: `window` where > 0, else `NO_WINDOW` (a global layer)."""
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, window, NO_WINDOW)


def first_visible_slot(query_slot, window) -> jax.Array:
    """The first key slot a query at `query_slot` sees (0 without a window); any shape."""
    return jnp.maximum(query_slot - effective_window(window) + 1, 0)


def apply_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array | None):
    """out `[N, Hq, d]` and lse `[Hq, N]` (natural log; -inf where a query saw no key) of an
    attention without sinks -> the same with sink logits `sinks` `[Hq]` (None: unchanged).
    A query with no key (padding) keeps output 0 and lse -inf."""
    if sinks is None:
        return out, lse
    sinks = sinks.astype(jnp.float32)[:, None]                         # [Hq, 1]
    keep = jax.nn.sigmoid(lse - sinks)                                 # 0 where lse = -inf
    out = (out.astype(jnp.float32) * jnp.swapaxes(keep, 0, 1)[..., None]).astype(out.dtype)
    return out, jnp.where(jnp.isfinite(lse), jnp.logaddexp(lse, sinks), lse)
