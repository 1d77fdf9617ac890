"""Dense reference generation: prefill + decode over a contiguous KV cache, no compression.

This is the ground truth the paged/compressed engine is compared with, so it stays small:

  1. Right-pad the prompts to one bucketed length (padding has position -1, see
     `Decoder.hidden`), run one prefill, take each row's logits at its last real token.
  2. Sample, then feed each row's new token at position = its length, one decode step at a time.
     A finished row keeps riding along with position -1, so its cache length stops growing.

Both steps are jitted once per (model graph, batch, bucketed lengths) and reused across calls.
Stop strings are the text side's job: pass `on_token` (e.g. a `sampling.StopChecker`) to end a row
early. Here: max_tokens, EOS (unless ignore_eos) and stop_token_ids; the stop token itself is
included in the returned ids, as transformers' `generate` and vLLM's token_ids do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder, DenseKVCache
from tangram_jax.sampling import SamplingParams, batch_sampling_arrays, resolve_seed, sample_tokens, step_keys


def _bucket(n: int, minimum: int = 32) -> int:
    """Next power of two >= n: bounds the number of distinct compiled shapes."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


# Sampling stays outside these two (its own jit, `sample_tokens`): compiled once per batch size
# and vocabulary, whichever model produced the logits.
@partial(jax.jit, static_argnums=0, donate_argnums=4)
def _prefill(graphdef, state, tokens, positions, cache, last_index):
    """tokens, positions `[B, T]`; last_index `[B]`: each row's last real token -> (logits `[B, V]`, cache)."""
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden(tokens, positions, cache)
    last_h = jnp.take_along_axis(h, last_index[:, None, None], axis=1)  # [B, 1, D]
    return model.logits(last_h)[:, 0], cache


@partial(jax.jit, static_argnums=0, donate_argnums=4)
def _decode(graphdef, state, tokens, positions, cache):
    """tokens, positions `[B, 1]` -> (logits `[B, V]`, cache)."""
    logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
    return logits[:, 0], cache


def _check_prompts(prompt_ids, config: ModelConfig) -> list[list[int]]:
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise TypeError("prompt_ids must be a non-empty list of token-id lists")
    prompts = []
    for i, prompt in enumerate(prompt_ids):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt_ids[{i}] must be a list of token ids, got {type(prompt).__name__}")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"prompt_ids[{i}] must hold ints, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"prompt_ids[{i}] has token ids outside [0, {config.vocab_size})")
        if ids.size >= config.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {ids.size} tokens; the model's context is {config.max_position_embeddings} "
                f"tokens, so at most {config.max_position_embeddings - 1} prompt tokens leave room to generate"
            )
        prompts.append([int(t) for t in ids])
    return prompts


def generate_dense(
    model: Decoder,
    config: ModelConfig,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    eos_token_ids: Sequence[int] | None = None,
    on_token: Callable[[int, int], bool] | None = None,
) -> list[list[int]]:
    """Generates for a batch of prompts of any lengths; returns each row's generated token ids.

    params: one SamplingParams for every prompt, or one per prompt.
    eos_token_ids: None means `config.eos_token_ids`.
    on_token(row, token_id) -> bool: called for every token appended to a row, its last one included;
    returning True ends that row (stop strings, streaming).
    A row stops after max_tokens, at an EOS/stop token, or when the model's context is full.
    """
    prompts = _check_prompts(prompt_ids, config)
    batch = len(prompts)
    if isinstance(params, SamplingParams):
        params = [params] * batch
    params = list(params)
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for {batch} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, (int, np.integer)) or p.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {p.max_tokens!r} (params[{i}])")
        if p.adjusts_logits or p.n > 1:
            raise ValueError(f"params[{i}]: the dense reference samples with temperature, top-k "
                             f"and top-p only; penalties, min_p, min_tokens and n > 1 are the "
                             f"engine's (got {p})")
    eos = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)) for p in params]

    lengths = np.array([len(p) for p in prompts])
    # Never generate past the model's context: a row's budget is capped by the room left.
    budgets = np.minimum([p.max_tokens for p in params], config.max_position_embeddings - lengths)
    prompt_len = _bucket(lengths.max())
    cache_len = _bucket(int((lengths + budgets).max()))

    tokens = np.zeros((batch, prompt_len), np.int32)
    positions = np.full((batch, prompt_len), -1, np.int32)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = prompt
        positions[b, : len(prompt)] = np.arange(len(prompt))

    temperature, top_k, top_p = (jnp.asarray(a) for a in batch_sampling_arrays(params))
    seeds = jnp.asarray(np.array([resolve_seed(p) for p in params], np.uint32))
    graphdef, state = nnx.split(model)
    cache = DenseKVCache.create(config, batch, cache_len, model.dtype)

    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = np.zeros(batch, bool)
    steps = np.zeros(batch, np.int32)
    logits, cache = _prefill(
        graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache, jnp.asarray(lengths - 1, jnp.int32)
    )
    while True:
        new = np.asarray(sample_tokens(logits, temperature, top_k, top_p, step_keys(seeds, jnp.asarray(steps))))
        for b in np.flatnonzero(~finished):
            token = int(new[b])
            outputs[b].append(token)
            steps[b] += 1
            done = token in stop_ids[b] or steps[b] >= budgets[b]
            if on_token is not None and on_token(int(b), token):
                done = True
            finished[b] = done
        if finished.all():
            return outputs
        # An unfinished row's new token sits at position = prompt length + tokens generated - 1.
        decode_positions = np.where(finished, -1, lengths + steps - 1).astype(np.int32)[:, None]
        logits, cache = _decode(graphdef, state, jnp.asarray(new[:, None]), jnp.asarray(decode_positions), cache)
