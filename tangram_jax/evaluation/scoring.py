"""Judging answers and comparing a compressed run with full KV.

- `is_correct`: the expected value occurs in the answer, both normalised (case, punctuation,
  spacing), as a whole token of the answer (so "482" is not found in "4821").
- `wilson_interval`: 95% confidence interval of a proportion (Wilson score; sensible at 0 or n
  successes and small n, unlike the normal approximation).
- `token_agreement`: how much of full KV's greedy answer a mode reproduces, position by position.
- KL of next-token distributions under teacher forcing: the reference (full KV) distribution at
  each position is kept as its `top_k` most likely tokens plus one bucket for the rest of the
  vocabulary (`TopKDistribution`), so hundreds of sessions' references fit in memory; the mode's
  distribution is coarse-grained the same way before the KL is taken. Coarse-graining never
  increases a KL (data-processing inequality), so this is a lower bound of the full-vocabulary
  KL, equal to it up to the reference mass outside the top-k, which is reported alongside.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata

import numpy as np

_NON_WORD = re.compile(r"[^0-9a-z]+")
_LOG_TINY = math.log(1e-30)


def normalise(text: str) -> str:
    """Lower case, accents folded, every run of non-alphanumerics one space, stripped."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    return _NON_WORD.sub(" ", text).strip()


def is_correct(expected: str, answer: str) -> bool:
    """Whether the normalised `expected` occurs in the normalised `answer` on token boundaries."""
    want = normalise(expected)
    if not want:
        raise ValueError(f"expected answer {expected!r} is empty after normalisation")
    return f" {want} " in f" {normalise(answer)} "


def wilson_interval(correct: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of `correct` successes in `n` trials (95% for the default z)."""
    if n < 0 or not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The exact bounds at 0 and n (rounding would leave 1 - 1e-16).
    lo = 0.0 if correct == 0 else max(0.0, centre - half)
    hi = 1.0 if correct == n else min(1.0, centre + half)
    return (lo, hi)


def token_agreement(reference: list[int], tokens: list[int]) -> float:
    """Fraction of the reference's positions where `tokens` has the same token (1.0: identical
    answers; positions past the end of `tokens` count as disagreement)."""
    if not reference:
        return 1.0 if not tokens else 0.0
    same = sum(a == b for a, b in zip(reference, tokens))
    return same / len(reference)


@dataclasses.dataclass
class TopKDistribution:
    """A next-token distribution per position, kept as its top-k tokens and the rest's mass.

    token_ids: int32 [T, k]; logprobs: float32 [T, k] (descending); rest_logprob: float64 [T],
    log of the probability mass outside the top k (-inf when there is none).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    rest_logprob: np.ndarray

    @classmethod
    def from_logprobs(cls, logprobs: np.ndarray, k: int) -> "TopKDistribution":
        """From full log-probabilities [T, V] (log_softmax rows)."""
        lp = np.asarray(logprobs, np.float64)
        if lp.ndim != 2:
            raise ValueError(f"logprobs must be [num_tokens, vocab], got shape {lp.shape}")
        k = min(int(k), lp.shape[1])
        # argpartition then a sort of the k: O(V) per row instead of sorting the vocabulary.
        top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(lp, top, axis=1), axis=1, kind="stable")
        top = np.take_along_axis(top, order, axis=1)
        top_lp = np.take_along_axis(lp, top, axis=1)
        rest = _log1mexp(_logsumexp(top_lp, axis=1))
        return cls(top.astype(np.int32), top_lp.astype(np.float32), rest)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def uncovered_mass(self) -> np.ndarray:
        """[T] reference probability outside the kept top k."""
        return np.exp(self.rest_logprob)


def kl_from_reference(reference: TopKDistribution, logprobs: np.ndarray) -> np.ndarray:
    """KL(reference || mode) per position, both coarse-grained to the reference's top-k tokens
    plus one bucket for the rest. logprobs: the mode's log-probabilities [T, V] at the same
    positions (same forced tokens). Returns float64 [T], >= 0."""
    lp = np.asarray(logprobs, np.float64)
    if lp.ndim != 2 or lp.shape[0] != reference.num_tokens:
        raise ValueError(f"mode logprobs shape {lp.shape} does not match the reference's "
                         f"{reference.num_tokens} positions")
    ref_lp = reference.logprobs.astype(np.float64)
    mode_lp = np.take_along_axis(lp, reference.token_ids.astype(np.int64), axis=1)
    # The mode's rest mass is positive for any finite logits; floor it so float rounding of a
    # near-complete top-k cannot turn a tiny reference rest into an infinite term.
    mode_rest = np.maximum(_log1mexp(_logsumexp(mode_lp, axis=1)), _LOG_TINY)
    ref_p = np.exp(ref_lp)
    kl = (ref_p * (ref_lp - mode_lp)).sum(axis=1)
    rest_p = np.exp(reference.rest_logprob)
    with np.errstate(invalid="ignore"):
        rest_term = np.where(rest_p > 0, rest_p * (reference.rest_logprob - mode_rest), 0.0)
    return np.maximum(kl + rest_term, 0.0)


def kl_full_vocabulary(ref_logprobs: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """Exact KL(ref || mode) per position over the whole vocabulary ([T, V] each) -> [T]."""
    ref = np.asarray(ref_logprobs, np.float64)
    mode = np.asarray(logprobs, np.float64)
    if ref.shape != mode.shape:
        raise ValueError(f"shapes differ: {ref.shape} vs {mode.shape}")
    p = np.exp(ref)
    return np.maximum((p * (ref - mode)).sum(axis=1), 0.0)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def _log1mexp(log_mass: np.ndarray) -> np.ndarray:
    """log(1 - exp(log_mass)) for log_mass <= 0, clamped: -inf when the mass is (about) 1."""
    mass = np.exp(np.minimum(log_mass, 0.0))
    with np.errstate(divide="ignore"):
        # Float rounding can leave 1 - mass slightly negative or ~1e-16 for a complete top-k.
        return np.where(mass < 1 - 1e-12, np.log1p(-mass), -np.inf)
