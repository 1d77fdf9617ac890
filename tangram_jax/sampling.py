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
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# Most top log-probs a request may ask for per position (vLLM's default limit).
MAX_TOP_LOGPROBS = 20
# Largest value a per-row int32 sampling array holds (top_k, token ids).
_INT32_MAX = 2**31 - 1
# float32's largest finite value: temperature and top_p travel to the device as float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Below this a temperature overflows the scaled logits (vLLM clamps to the same floor).
MIN_TEMPERATURE = 1e-2


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


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
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_temperature(value) -> float:
    t = _number("temperature", value)
    if t != 0 and not MIN_TEMPERATURE <= t <= _FLOAT32_MAX:
        raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                         f"{_FLOAT32_MAX:.3g}], got {t}")
    return t


def _check_top_p(value) -> float:
    p = _number("top_p", value)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return p


def _check_top_k(value) -> int:
    k = _integer("top_k", value)
    if not -1 <= k <= _INT32_MAX:
        raise ValueError(f"top_k must be -1 or 0 (disabled) or a number of tokens in [1, "
                         f"{_INT32_MAX}] (at most the vocabulary, checked by the engine), got {k}")
    return k


def _check_max_tokens(value) -> int:
    n = _integer("max_tokens", value)
    if n < 1:
        raise ValueError(f"max_tokens must be >= 1, got {n}")
    return n


def _check_seed(value) -> int | None:
    if value is None:
        return None
    s = _integer("seed", value)
    if s < 0:
        raise ValueError(f"seed must be an int >= 0 or None, got {s}")
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
        if not _is_int(t) or not 0 <= t <= _INT32_MAX:
            raise ValueError(f"stop_token_ids must be token ids (ints in [0, vocabulary)), got "
                             f"{t!r} in {list(ids)!r}")
    return tuple(int(t) for t in ids)


def _check_ignore_eos(value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"ignore_eos must be a bool, got {value!r}")
    return bool(value)


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

    temperature: 0 means greedy (argmax); otherwise logits are divided by it (>= 0.01).
    top_p: nucleus mass in (0, 1]; 1 disables.
    top_k: keep the k most likely tokens; -1 or 0 disables (the engine refuses k > vocabulary).
    max_tokens: most tokens to generate (>= 1).
    seed: PRNG seed for this request; None draws a fresh one (see `resolve_seed`).
    stop: string(s) that end generation; the text is cut before the stop string.
    stop_token_ids: token ids that end generation (in addition to EOS unless `ignore_eos`); the
      engine refuses ids outside the model's vocabulary.
    ignore_eos: keep generating past the model's EOS token(s).
    logprobs: None (off); 0..20: the log-probabilities of the top `logprobs` tokens at every
      generated position plus the sampled token's (vLLM's semantics); -1: the whole vocabulary.
      They are the model's raw distribution, ``log_softmax(logits)``, before temperature, top-k
      and top-p (vLLM's default).

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

    def __post_init__(self):
        for name, check in _FIELD_CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))

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


# One entry per field: the check that validates and normalises it (a new field adds its entry).
_FIELD_CHECKS: dict[str, Callable] = {
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "max_tokens": _check_max_tokens,
    "seed": _check_seed,
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
    "ignore_eos": _check_ignore_eos,
    "logprobs": _check_logprobs,
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


@jax.jit
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, keys: jax.Array) -> jax.Array:
    """Choose one token per row.

    logits: [B, V] float32; temperature: [B] f32 (0 = greedy); top_k: [B] int32 (<= 0 disables);
    top_p: [B] f32 in (0, 1]; keys: [B, 2] raw PRNG keys (or [B] typed keys), one per row.
    Returns [B] int32.

    Top-k is applied before top-p (vLLM's order). Both are done on one descending sort of the
    row; the nucleus always keeps the most likely token, so no row ends up empty.
    """
    logits = logits.astype(jnp.float32)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # An all-greedy batch (the common benchmark case) skips the vocabulary sort entirely.
    return jax.lax.cond(jnp.all(temperature <= 0), lambda: greedy_ids,
                        lambda: _sample_rows(logits, greedy_ids, temperature, top_k, top_p, keys))


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


def _sample_rows(logits, greedy_ids, temperature, top_k, top_p, keys):
    vocab = logits.shape[-1]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
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

    def append(self, token_id: int) -> str:
        if self.finished:
            raise RuntimeError("append() after the request finished")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if token_id in self._stop_ids:
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
            return self._finish("stop", flush=True)

        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        checked = len(self._text)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

        cut = find_stop(self._text, self.params.stop, start=checked)
        if cut is not None:
            self.stop_reason = next(s for s in self.params.stop if self._text.startswith(s, cut))
            self._text = self._text[:cut]
            return self._finish("stop", flush=True)
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length", flush=True)
        final = len(self._text) - _held_back(self._text, self.params.stop)
        out = self._text[self._emitted:final]
        self._emitted = max(self._emitted, final)
        return out

    def _finish(self, reason: str, flush: bool) -> str:
        self.finished = True
        self.finish_reason = reason
        out = self._text[self._emitted:] if flush else ""
        self._emitted = len(self._text)
        return out
