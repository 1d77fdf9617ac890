"""Flow retention: which tokens of a turn a chunk displaces (`kv_layout`, retention ``"flow"``).

Budget Reservation fixes how many tokens each head keeps of a turn (``ceil(r * u)`` of its u
unprotected tokens, plus the protected tail); flow retention decides *which* as the turn is
prefilled. A turn's kept tokens (its *held* tokens) occupy slots ``turn_start .. hist - 1`` of each
head's pages. A chunk may append ``append`` new slots (every token while the reservation is not
full, then none; the protected tail always); beyond those, a chunk token is written only by
displacing a held token of the same head that scores lower, into that token's slot. The held set
after the last chunk is therefore the turn's top by score, not a fixed share of every chunk:
a chunk that holds the only fact keeps it however much filler came before.

`flow_destinations` computes where each chunk token goes (a slot, or nowhere) from the held
tokens' scores and the chunk's, with static shapes (jnp, one sequence's row; the Pallas and XLA
paths share it). Ties keep the held token. Scores must be comparable across the chunks of a
turn; the protected tokens carry `chunk_scoring.PROTECTED_SCORE`, above everything, so they are
never displaced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def flow_destinations(held_scores: jax.Array, held: jax.Array, chunk_scores: jax.Array,
                      chunk_len: jax.Array, append: jax.Array, hist: jax.Array) -> jax.Array:
    """Slots of the chunk's kept tokens, per head.

    held_scores: float32 [heads, S], the score of the token in each slot 0..S-1 of the head's
      pages (only slots where `held` is True count); held: bool [heads, S], the turn's held
      slots (``turn_start <= slot < hist``); chunk_scores: float32 [heads, T], the chunk's
      tokens (positions >= chunk_len are padding); chunk_len: int32 scalar; append: int32
      [heads], new slots the chunk may take (``hist .. hist + append - 1``; at most chunk_len);
      hist: int32 [heads], the first free slot.

    Returns int32 [heads, T]: each chunk token's slot, or -1 where it is not kept. The chunk's
    best ``append`` tokens take the new slots in rank order; each further one, in rank order,
    takes the slot of the lowest-scoring held token not yet displaced while it scores strictly
    higher (so at most T held tokens move, and exactly ``append`` slots are added).
    """
    heads, t = chunk_scores.shape
    s = held_scores.shape[1]
    valid = jnp.arange(t) < chunk_len
    new = jnp.where(valid[None, :], chunk_scores.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(-new, axis=1, stable=True)                  # rank -> chunk token
    new_sorted = jnp.take_along_axis(new, order, axis=1)             # best first
    k = min(t, s)
    low, low_slot = lax.top_k(jnp.where(held, -held_scores.astype(jnp.float32), -jnp.inf), k)
    low = -low                                                       # weakest held first
    rank = jnp.arange(t)[None, :]
    evict = rank - append[:, None]                                   # which weakest, per rank
    weakest = jnp.take_along_axis(low, jnp.clip(evict, 0, k - 1), axis=1)
    kept = (rank < chunk_len) & ((evict < 0) | ((evict < k) & (new_sorted > weakest)))
    slot_by_rank = jnp.where(
        evict < 0, hist[:, None] + rank,
        jnp.take_along_axis(low_slot, jnp.clip(evict, 0, k - 1), axis=1))
    slot_by_rank = jnp.where(kept, slot_by_rank, -1).astype(jnp.int32)
    # Back from rank order to chunk order.
    return jnp.zeros((heads, t), jnp.int32).at[jnp.arange(heads)[:, None], order].set(
        slot_by_rank)
