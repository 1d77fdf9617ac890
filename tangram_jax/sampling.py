"""Sampling: request parameters (vLLM-shaped), a jittable batched sampler, and stop handling.

Three pieces, used by the dense reference generation and by the engine alike:

- `SamplingParams`: one request's knobs, validated on construction.
- `sample_tokens`: one decode step's token choice for a batch, every row with its own
  temperature / top-k / top-p / PRNG key, so a seeded request draws the same tokens whatever
  else is in its batch.
- `StopChecker`: host-side incremental detokenization plus stop tokens, stop strings, EOS and
  `max_tokens`; it never emits half of a multi-byte UTF-8 character.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

# Most top log-probs a request may ask for per position (vLLM's default limit).
MAX_TOP_LOGPROBS = 20
# Largest value a per-row int32 sampling array holds (top_k, token ids).
_INT32_MAX = 2**31 - 1
# float32's largest finite value: temperature and top_p travel to the device as float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Below this a temperature overflows the scaled logits: a smaller positive one is raised to it
# with a warning (vLLM's _MAX_TEMP rule).
MIN_TEMPERATURE = 1e-2
# The largest temperature (vLLM's and OpenAI's range is [0, 2]).
MAX_TEMPERATURE = 2.0


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (the one integer check of the settings)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return is_int(value) or isinstance(value, (float, np.floating))


def _number(name: str, value) -> float:
    """A real number (Python or numpy scalar, not bool), as a Python float."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _integer(name: str, value) -> int:
    """An integer (Python or numpy scalar, not bool), as a Python int."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_temperature(value) -> float:
    """vLLM's rule: in [0, 2]; 0 is greedy; a positive one below `MIN_TEMPERATURE` is raised to
    it with a warning (dividing the logits by it would overflow)."""
    t = _number("temperature", value)
    if t < 0:
        raise ValueError(f"temperature must be non-negative, got {t}")
    if t > MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}")
    if 0 < t < MIN_TEMPERATURE:
        log.warning("temperature %s is less than %s, which may cause numerical errors nan or "
                    "inf in tensors; raised to %s", t, MIN_TEMPERATURE, MIN_TEMPERATURE)
        t = MIN_TEMPERATURE
    return t


def _check_top_p(value) -> float:
    p = _number("top_p", value)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return p


def _check_top_k(value) -> int:
    """vLLM's rule: 0 or -1 disable it, any k >= 1 keeps the k likeliest tokens (k at least the
    vocabulary: no limit). A k beyond int32 is stored as 2**31 - 1 (the device's row value;
    no limit either way)."""
    k = _integer("top_k", value)
    if k < -1:
        raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {k}")
    return min(k, _INT32_MAX)


def _check_max_tokens(value) -> int:
    n = _integer("max_tokens", value)
    if n < 1:
        raise ValueError(f"max_tokens must be >= 1, got {n}")
    return n


def _check_seed(value) -> int | None:
    """None or an int >= 0; -1 means None (vLLM's meaning)."""
    if value is None:
        return None
    s = _integer("seed", value)
    if s == -1:
        return None
    if s < 0:
        raise ValueError(f"seed must be an int >= 0, or -1 or None (a fresh seed), got {s}")
    return s


def _check_stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got "
                        f"{type(value).__name__}")
    stop = tuple(value)
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a string or a list of strings, got {s!r} in it")
        if s == "":
            raise ValueError("stop strings must be non-empty, got ''")
        _check_unicode(f"stop string {s!r}", s)
    return stop


def _check_stop_token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"stop_token_ids must be a list of token ids, got {type(value).__name__}")
    ids = tuple(value)
    for t in ids:
        if not is_int(t) or not 0 <= t <= _INT32_MAX:
            raise ValueError(f"stop_token_ids must be token ids (ints in [0, vocabulary)), got "
                             f"{t!r} in {list(ids)!r}")
    return tuple(int(t) for t in ids)


def _check_bool(name: str):
    def check(value) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
        return bool(value)
    return check


def _check_unicode(what: str, text: str) -> None:
    """Refuse lone surrogates (text no tokenizer can encode and no UTF-8 stream can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.object[e.start:e.end]!r} at index "
                         f"{e.start} is a lone surrogate") from None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (same names and meanings as vLLM's).

    temperature: in [0, 2]; 0 means greedy (argmax); otherwise logits are divided by it (a
      positive one below 0.01 is raised to 0.01 with a warning, as vLLM does).
    top_p: nucleus mass in (0, 1]; 1 disables.
    top_k: keep the k most likely tokens; -1 or 0 disables, as does k >= the vocabulary.
    max_tokens: most tokens to generate (>= 1).
    seed: PRNG seed for this request; None (or -1, vLLM's spelling) draws a fresh one (see
      `resolve_seed`).
    stop: string(s) that end generation; the text is cut before the stop string.
    stop_token_ids: token ids that end generation (in addition to EOS unless `ignore_eos`); the
      engine refuses ids outside the model's vocabulary.
    ignore_eos: keep generating past the model's EOS token(s).
    logprobs: None (off); 0..20: the log-probabilities of the top `logprobs` tokens at every
      generated position plus the sampled token's (vLLM's semantics); -1: the whole vocabulary.
      They are the model's raw distribution, ``log_softmax(logits)``, before penalties,
      temperature, min-p, top-k and top-p (vLLM's default).
    n: how many completions to sample for the prompt (each with its own random stream: with a
      `seed`, sample i uses ``seed + i``, as vLLM does).
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logit of every token
      the completion has generated so far, once (presence) or once per occurrence (frequency).
    repetition_penalty: > 0; every token seen in the prompt or the completion has its logit
      divided by it where positive and multiplied by it where negative (1 disables).
    min_p: in [0, 1]; drop tokens whose probability (after temperature) is below `min_p` times
      the most likely token's.
    min_tokens: generate at least this many tokens (<= max_tokens) before EOS, stop tokens or
      stop strings may end the completion (EOS and stop tokens are masked on the device).
    include_stop_str_in_output: keep the stop string that ended the completion in its text.
    prompt_logprobs: None (off) or 0..20: the prompt tokens' log-probabilities (with the top
      `prompt_logprobs` alternatives) at every prompt position after the first.

    Order on the device (vLLM's): min_tokens mask and penalties on the logits, then greedy
    argmax or temperature, min-p, top-k, top-p and the draw.

    Validated once, on construction (each field by its entry in `_FIELD_CHECKS`, which also
    normalises: numpy scalars become Python numbers, `stop` and `stop_token_ids` tuples), and
    immutable afterwards: `dataclasses.replace(params, max_tokens=32)` makes a validated copy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self):
        for name, check in _FIELD_CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the device must change this request's logits before choosing (penalties,
        min_p or min_tokens); rows that do not skip that work."""
        return self.counts_tokens or self.min_p > 0 or self.min_tokens > 0

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty counts tokens (presence, frequency: the completion's; repetition:
        the prompt's too)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_logprobs(value) -> int | None:
    if value is None:
        return None
    k = _integer("logprobs", value)
    if not -1 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be None, -1 (whole vocabulary) or 0..{MAX_TOP_LOGPROBS}, "
                         f"got {k}")
    return k


# Most completions one request may ask for (`n`).
MAX_N = 128


def _check_n(value) -> int:
    n = _integer("n", value)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
    return n


def _check_penalty(name: str):
    def check(value) -> float:
        x = _number(name, value)
        if not -2.0 <= x <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {x}")
        return x
    return check


def _check_repetition_penalty(value) -> float:
    x = _number("repetition_penalty", value)
    if not 0.0 < x <= _FLOAT32_MAX:
        raise ValueError(f"repetition_penalty must be > 0 (1 disables), got {x}")
    return x


def _check_min_p(value) -> float:
    x = _number("min_p", value)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {x}")
    return x


def _check_min_tokens(value) -> int:
    n = _integer("min_tokens", value)
    if n < 0:
        raise ValueError(f"min_tokens must be >= 0, got {n}")
    return n


def _check_prompt_logprobs(value) -> int | None:
    if value is None:
        return None
    k = _integer("prompt_logprobs", value)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be None or 0..{MAX_TOP_LOGPROBS}, got {k}")
    return k


# One entry per field: the check that validates and normalises it (a new field adds its entry).
_FIELD_CHECKS: dict[str, Callable] = {
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "max_tokens": _check_max_tokens,
    "seed": _check_seed,
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
    "ignore_eos": _check_bool("ignore_eos"),
    "logprobs": _check_logprobs,
    "n": _check_n,
    "presence_penalty": _check_penalty("presence_penalty"),
    "frequency_penalty": _check_penalty("frequency_penalty"),
    "repetition_penalty": _check_repetition_penalty,
    "min_p": _check_min_p,
    "min_tokens": _check_min_tokens,
    "include_stop_str_in_output": _check_bool("include_stop_str_in_output"),
    "prompt_logprobs": _check_prompt_logprobs,
}


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed: its own, or a fresh random one. Call once per request."""
    if params.seed is not None:
        return int(params.seed) % (1 << 32)
    return secrets.randbits(32)


def batch_sampling_arrays(params: Sequence[SamplingParams]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row arrays for `sample_tokens`: temperature [B] f32, top_k [B] i32, top_p [B] f32."""
    temperature = np.array([p.temperature for p in params], np.float32)
    top_k = np.array([p.top_k for p in params], np.int32)
    top_p = np.array([p.top_p for p in params], np.float32)
    return temperature, top_k, top_p


@jax.jit
def step_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """PRNG keys for one decode step: row i's key depends only on (seeds[i], steps[i]).

    seeds: [B] uint32 (from `resolve_seed`); steps: [B] int32, the index of the token being
    generated within its request. Returns raw keys [B, 2] uint32.
    """
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
        seeds.astype(jnp.uint32), steps.astype(jnp.int32))


# A slot's penalty row (`SlotState.penalties`, int32 [vocab]): how many times the completion
# holds each token (low bits), and two flags: the token is in the prompt (the repetition
# penalty counts it) or is EOS / a stop token (masked while the completion is under min_tokens).
COUNT_MASK = (1 << 29) - 1
STOP_BIT = 1 << 29
PROMPT_BIT = 1 << 30


class SlotState(NamedTuple):
    """What the device keeps per block-table row (slot) between steps, so the host can schedule
    the next step before it has seen this one's tokens.

    tokens: int32 [slots] each slot's last sampled token (a decode step's input);
    penalties: int32 [slots, vocab] each slot's penalty row (`penalty_row`): every sampled
    token is counted in the graph (`record_tokens`); a request that adjusts its logits has its
    row written from its host ids when it first samples in a slot (`write_penalty_row`)."""

    tokens: jax.Array
    penalties: jax.Array


def record_tokens(state: SlotState, slots: jax.Array, tokens: jax.Array) -> SlotState:
    """`state` after the rows in `slots` [B] sampled `tokens` [B] (padding rows: a slot never
    read)."""
    return SlotState(state.tokens.at[slots].set(tokens),
                     state.penalties.at[slots, tokens].add(1, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def write_penalty_row(state: SlotState, slot, row, pending) -> SlotState:
    """`state` with slot `slot`'s penalty row set to `row` (int32 [vocab], from the host ids),
    plus `pending` (0 or 1) counts of the slot's last sampled token: the completion's token the
    host has not fetched yet, already counted on the device in the row it replaces."""
    row = row.at[state.tokens[slot]].add(pending)
    return state._replace(penalties=state.penalties.at[slot].set(row))


def penalty_row(vocab: int, prompt_ids: Sequence[int], output_ids: Sequence[int],
                stop_ids: Sequence[int]) -> np.ndarray:
    """int32 [vocab]: the penalty row of a completion (counts of `output_ids`, `PROMPT_BIT` of
    `prompt_ids`, `STOP_BIT` of `stop_ids`); ids outside the vocabulary are ignored."""
    ids = lambda x: (lambda a: a[(a >= 0) & (a < vocab)])(np.asarray(x, np.int64).reshape(-1))
    row = np.minimum(np.bincount(ids(output_ids), minlength=vocab), COUNT_MASK).astype(np.int32)
    row[ids(prompt_ids)] |= PROMPT_BIT
    row[ids(stop_ids)] |= STOP_BIT
    return row


class LogitsAdjust(NamedTuple):
    """Per-row changes to the logits before a token is chosen (penalties, min_tokens, min_p),
    built on the host by `logits_adjust_arrays`; the tokens they count are the rows' penalty
    rows on the device (`SlotState.penalties`).

    presence, frequency, repetition, min_p: float32 [B] (0, 0, 1, 0 change nothing);
    suppress_stop: bool [B] the completion is shorter than min_tokens (EOS and stop tokens
    masked).
    """

    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_p: jax.Array
    suppress_stop: jax.Array


def logits_adjust_arrays(params: Sequence[SamplingParams], output_lengths: Sequence[int],
                         rows: int) -> LogitsAdjust:
    """Host arrays of a `LogitsAdjust` for `rows` rows, the first ``len(params)`` of them these
    requests' (whose completions hold `output_lengths` tokens; padding rows change nothing)."""
    n = len(params)
    adjust = neutral_adjust(rows)
    adjust.presence[:n] = [p.presence_penalty for p in params]
    adjust.frequency[:n] = [p.frequency_penalty for p in params]
    adjust.repetition[:n] = [p.repetition_penalty for p in params]
    adjust.min_p[:n] = [p.min_p for p in params]
    adjust.suppress_stop[:n] = [p.min_tokens > k for p, k in zip(params, output_lengths)]
    return adjust


# A step's sampling inputs by row (temperature, top_k, top_p, seeds, steps, forced tokens, then
# `LogitsAdjust`'s fields), each a row of one int32 array on its way to the device.
_ROW_DTYPES = (np.float32, np.int32, np.float32, np.uint32, np.int32, np.int32,
               np.float32, np.float32, np.float32, np.float32, np.bool_)


def pack_rows(temperature, top_k, top_p, seeds, steps, forced, adjust: LogitsAdjust
              ) -> np.ndarray:
    """int32 [11, B]: the rows' sampling arrays ([B] each, `sample_tokens`' and
    `force_tokens`' inputs) as bit patterns, one array for one host-to-device copy (eleven
    copies were ~0.3 ms of a GPU decode step's host time, 1.5 ms with each array put to two
    devices). `unpack_rows` reads them back inside a step."""
    fields = [np.asarray(x, dtype) for x, dtype in
              zip((temperature, top_k, top_p, seeds, steps, forced, *adjust), _ROW_DTYPES)]
    return np.stack([x.astype(np.int32) if x.dtype == np.bool_ else x.view(np.int32)
                     for x in fields])


def unpack_rows(rows: jax.Array) -> tuple:
    """`pack_rows`' arrays from its int32 [11, B]: (temperature, top_k, top_p, seeds, steps,
    forced, adjust)."""
    fields = [rows[i] != 0 if dtype == np.bool_ else
              rows[i] if dtype == np.int32 else jax.lax.bitcast_convert_type(rows[i], dtype)
              for i, dtype in enumerate(_ROW_DTYPES)]
    return (*fields[:6], LogitsAdjust(*fields[6:]))


def adjusting_rows(adjust: LogitsAdjust):
    """bool [B]: the rows whose logits `adjust_logits` changes (a penalty, or min_tokens'
    mask); numpy or jax arrays alike. min_p filters sampled rows only, so it is not one."""
    return ((adjust.presence != 0) | (adjust.frequency != 0) | (adjust.repetition != 1)
            | adjust.suppress_stop)


def neutral_adjust(rows: int) -> LogitsAdjust:
    """A `LogitsAdjust` of `rows` rows that changes nothing (host arrays)."""
    return LogitsAdjust(np.zeros(rows, np.float32), np.zeros(rows, np.float32),
                        np.ones(rows, np.float32), np.zeros(rows, np.float32),
                        np.zeros(rows, bool))


def adjust_logits(logits: jax.Array, adjust: LogitsAdjust, penalties: jax.Array) -> jax.Array:
    """The logits [B, V] after min_tokens' mask and the three penalties (vLLM's rules):
    repetition divides positive / multiplies negative logits of every token in the prompt or the
    output; frequency subtracts ``penalty * count`` and presence ``penalty`` for every token the
    output holds; EOS and stop tokens are -inf while a row is under min_tokens.
    penalties: int32 [B, V] the rows' penalty rows (`penalty_row`)."""
    counts = penalties & COUNT_MASK
    seen = ((penalties & PROMPT_BIT) != 0) | (counts > 0)
    rep = adjust.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = (logits - adjust.frequency[:, None] * counts
              - adjust.presence[:, None] * (counts > 0).astype(logits.dtype))
    stop = (penalties & STOP_BIT) != 0
    return jnp.where(stop & adjust.suppress_stop[:, None], -jnp.inf, logits)


@functools.partial(jax.jit, static_argnames=("adjusts", "samples"))
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, keys: jax.Array, adjust: LogitsAdjust | None = None,
                  penalties: jax.Array | None = None, *, adjusts: bool | None = None,
                  samples: bool | None = None) -> jax.Array:
    """Choose one token per row.

    logits: [B, V] float32; temperature: [B] f32 (0 = greedy); top_k: [B] int32 (<= 0 disables);
    top_p: [B] f32 in (0, 1]; keys: [B, 2] raw PRNG keys (or [B] typed keys), one per row;
    adjust: penalties, min_tokens and min_p of the rows (None: none asked for); penalties:
    int32 [B, V] the rows' penalty rows (`adjust_logits`; needed with `adjust`), or (table
    [slots, V], slots [B]) to gather them only when a row adjusts. The engine's steps always
    pass both. adjusts / samples: whether any row adjusts its logits (`adjusting_rows`) / any
    row samples (temperature > 0), as the caller knows it (static: the program holds only
    that path); None: decided on the device, a conditional whose predicate an accelerator's
    host waits for before it launches the rest of the program (the engine decides on the
    host: `decode_step._sampling_rows`). Returns [B] int32.

    vLLM's order: the penalties and min_tokens change the logits (greedy rows take their
    argmax), then temperature, min-p, top-k and top-p. All filters work on one descending sort
    of the row; the most likely token always survives, so no row ends up empty.
    """
    logits = logits.astype(jnp.float32)
    if adjust is not None:
        rows = lambda: penalties[0][penalties[1]] if isinstance(penalties, tuple) else penalties
        adjusted = lambda: adjust_logits(logits, adjust, rows())
        if adjusts is None:
            logits = jax.lax.cond(jnp.any(adjusting_rows(adjust)), adjusted, lambda: logits)
        elif adjusts:
            logits = adjusted()
        min_p = adjust.min_p
    else:
        min_p = jnp.zeros_like(temperature)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = lambda: _sample_rows(logits, greedy_ids, temperature, top_k, top_p, min_p, keys)
    if samples is None:
        # An all-greedy batch (the common benchmark case) skips the vocabulary sort entirely.
        return jax.lax.cond(jnp.all(temperature <= 0), lambda: greedy_ids, sampled)
    return sampled() if samples else greedy_ids


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one step's rows (device arrays), of the raw model distribution
    ``log_softmax(logits)``.

    token_logprob: float32 [B] of the chosen token; token_rank: int32 [B] its rank (1 = most
    likely; ties share the better rank); top_ids / top_logprobs: int32 / float32
    [B, MAX_TOP_LOGPROBS], best first; full: float32 [B, V] (only when asked for, else None).
    """

    token_logprob: jax.Array
    token_rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    full: jax.Array | None


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, full: bool) -> TokenLogprobs:
    """Log-probabilities of `tokens` [B] under `logits` [B, V], with the top entries (and the
    whole [B, V] log-softmax when `full`). Jittable; `full` is static."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    rank = (logprobs > chosen[:, None]).sum(axis=-1, dtype=jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    return TokenLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_logprobs,
                         logprobs if full else None)


def force_tokens(sampled: jax.Array, forced: jax.Array) -> jax.Array:
    """Teacher forcing: row i takes ``forced[i]`` where it is >= 0, its sample otherwise."""
    return jnp.where(forced >= 0, forced.astype(jnp.int32), sampled)


def _sample_rows(logits, greedy_ids, temperature, top_k, top_p, min_p, keys):
    vocab = logits.shape[-1]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    # min-p: p < min_p * p_max  <=>  logit < logit_max + log(min_p) (log 0 = -inf keeps all).
    floor = sorted_logits[:, :1] + jnp.log(min_p)[:, None]
    sorted_logits = jnp.where(sorted_logits < floor, -jnp.inf, sorted_logits)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    sorted_logits = jnp.where(rank < k[:, None], sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative probability
    keep = (mass_before < top_p[:, None]) | (rank == 0)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)

    choice = jax.vmap(jax.random.categorical)(keys, sorted_logits)  # index into the sorted row
    sampled_ids = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled_ids, greedy_ids)


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in `text`, or None.

    Only matches that end after `start` are looked for (text before `start` was already checked),
    so a caller can pass the old length and search just the new tail.
    """
    best = None
    for s in stop_strings:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    hold = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class StopChecker:
    """Incremental detokenization and stop conditions for one request.

    Feed generated tokens one at a time with `append`; it returns the text that became final
    (safe to show) with that token, and sets `finished` / `finish_reason` ("stop" or "length").

    Detokenization follows vLLM's offsets: the new text is `decode(ids[prefix:])` minus
    `decode(ids[prefix:read])`, so the tokenizer sees enough left context to place spaces right,
    and a trailing U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until
    the following token completes it. Text that could still become a stop string is also held
    back. Stop/EOS tokens end generation and contribute no text; they stay in `token_ids`.
    """

    def __init__(self, decode: Callable[[list[int]], str], params: SamplingParams,
                 eos_token_ids: Sequence[int] = (), prompt_ids: Sequence[int] = ()):
        self._decode = decode
        self.params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= {int(t) for t in eos_token_ids}
        # Decoding context: a few prompt tokens so the first generated token's leading space
        # is rendered as it would be mid-text.
        self._ids: list[int] = list(prompt_ids)[-6:]
        self._prefix = 0
        self._read = len(self._ids)
        self.token_ids: list[int] = []
        self._text = ""  # all decoded generated text so far (may include a held-back tail)
        self._emitted = 0  # how much of _text was returned by append
        self.finished = False
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string or stop token id that ended the request (None for
        # EOS or max_tokens).
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """The output text so far (final once `finished`)."""
        return self._text if not self.finished else self._text[:self._emitted]

    @property
    def final_text(self) -> str:
        """The text `append` has returned so far: what can no longer be taken back (a tail that
        could still turn into a stop string, or half a UTF-8 character, is not in it). Streaming
        this only ever grows."""
        return self._text[:self._emitted]

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end the request (its stop tokens, and EOS unless ignored): what
        min_tokens masks on the device."""
        return frozenset(self._stop_ids)

    def append(self, token_id: int) -> str:
        if self.finished:
            raise RuntimeError("append() after the request finished")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        params = self.params
        # vLLM: nothing ends a completion shorter than min_tokens (its EOS and stop tokens are
        # masked on the device; a forced one is text like any other).
        may_stop = len(self.token_ids) >= params.min_tokens
        if may_stop and token_id in self._stop_ids:
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                if params.include_stop_str_in_output:   # its text too (vLLM); EOS never
                    self._decode_next(token_id)
            return self._finish("stop", flush=True)

        checked = len(self._text)
        self._decode_next(token_id)
        cut = find_stop(self._text, params.stop, start=checked) if may_stop else None
        if cut is not None:
            self.stop_reason = next(s for s in params.stop if self._text.startswith(s, cut))
            if params.include_stop_str_in_output:
                cut += len(self.stop_reason)
            self._text = self._text[:cut]
            return self._finish("stop", flush=True)
        if len(self.token_ids) >= params.max_tokens:
            return self._finish("length", flush=True)
        # A tail that may still become a stop string is held back, unless the stop string is
        # kept in the output anyway.
        hold = 0 if params.include_stop_str_in_output else _held_back(self._text, params.stop)
        final = len(self._text) - hold
        out = self._text[self._emitted:final]
        self._emitted = max(self._emitted, final)
        return out

    def _decode_next(self, token_id: int) -> None:
        """Append the token's text to `_text` (none yet if it ends in half a character)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

    def _finish(self, reason: str, flush: bool) -> str:
        self.finished = True
        self.finish_reason = reason
        out = self._text[self._emitted:] if flush else ""
        self._emitted = len(self._text)
        return out
