"""The one workload module of the benchmarks: SCBench-shaped multi-turn sessions, their arrival
process, and the skewed per-head budget profile of the random models.

A session (SCBench's shape) is a long shared context with its first question in turn 1, then
`followups` short questions in the same session; every turn answers `answer_tokens` tokens
(greedy, EOS ignored, so every engine does the same work). Context classes follow the paper's
split: Short (< 20k tokens), Mid (20k-100k), Long (> 100k); their default lengths are below and
any length can be given instead. Token ids are random over the vocabulary's ordinary range
(throughput does not depend on the text; every engine gets the same ids).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Default context length of each class (tokens): inside the paper's ranges.
CONTEXT_CLASSES = {"short": 8192, "mid": 32768, "long": 102400}
ARRIVALS = ("closed", "poisson")


@dataclasses.dataclass(frozen=True)
class Session:
    """One session: ``turns[0]`` the context with its first question, ``turns[1:]`` the
    follow-up questions (token ids); `arrival` seconds after the start when turn 1 is sent;
    `think_times` seconds between an answer and the next follow-up (one per follow-up; empty:
    each follow-up is sent the moment the answer ends)."""

    session_id: str
    turns: tuple[tuple[int, ...], ...]
    answer_tokens: int
    arrival: float = 0.0
    think_times: tuple[float, ...] = ()

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclasses.dataclass(frozen=True)
class SessionSpec:
    """How to make the sessions of one run (see `make_sessions`)."""

    num_sessions: int
    context_tokens: int
    followups: int = 2
    question_tokens: int = 64
    answer_tokens: int = 128
    arrival: str = "closed"
    session_rate: float | None = None     # sessions per second, for poisson arrivals
    seed: int = 0
    # Mean think time, seconds: each follow-up is sent an exponential time (of this mean) after
    # the previous answer ended (a user reading it); 0: at once.
    think_time: float = 0.0

    def __post_init__(self):
        for name in ("num_sessions", "context_tokens", "question_tokens", "answer_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.followups, (int, np.integer)) or self.followups < 0:
            raise ValueError(f"followups must be an int >= 0, got {self.followups!r}")
        if isinstance(self.think_time, bool) or not isinstance(
                self.think_time, (int, float, np.integer, np.floating)) \
                or not 0 <= self.think_time < float("inf"):
            raise ValueError(f"think_time must be a number of seconds >= 0, got "
                             f"{self.think_time!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "poisson" and not (self.session_rate and self.session_rate > 0):
            raise ValueError(f"poisson arrivals need session_rate > 0 (sessions per second), got "
                             f"{self.session_rate!r}")

    @property
    def num_turns(self) -> int:
        return self.num_sessions * (1 + self.followups)

    def session_tokens(self) -> int:
        """Tokens one session holds at its end (every prompt and answer)."""
        return (self.context_tokens + self.followups * self.question_tokens
                + (1 + self.followups) * self.answer_tokens)


def context_tokens_of(context_class: str | None, context_tokens: int | None) -> int:
    """The context length: `context_tokens` when given, else the class's default."""
    if context_tokens is not None:
        return int(context_tokens)
    if context_class not in CONTEXT_CLASSES:
        raise ValueError(f"context class must be one of {tuple(CONTEXT_CLASSES)}, got "
                         f"{context_class!r}")
    return CONTEXT_CLASSES[context_class]


def context_class_of(tokens: int) -> str:
    """The paper's class of a context length: short < 20k <= mid <= 100k < long."""
    return "short" if tokens < 20_000 else "mid" if tokens <= 100_000 else "long"


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Start times [n] of a Poisson process of `rate` per second (the first at 0)."""
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def make_sessions(spec: SessionSpec, vocab_size: int) -> list[Session]:
    """The sessions of `spec`, token ids drawn from ``[100, vocab_size - 100)`` (clear of the
    special tokens at both ends of the usual vocabularies)."""
    rng = np.random.default_rng(spec.seed)
    low, high = 100, max(101, vocab_size - 100)
    arrivals = (poisson_arrivals(spec.num_sessions, spec.session_rate, rng)
                if spec.arrival == "poisson" else np.zeros(spec.num_sessions))
    # Think times from a generator of their own: the tokens and arrivals of a seed stay the same
    # with and without them.
    think = (np.random.default_rng([spec.seed, 1]).exponential(
        spec.think_time, (spec.num_sessions, spec.followups)) if spec.think_time > 0 else None)
    sessions = []
    for i in range(spec.num_sessions):
        turns = [tuple(int(t) for t in rng.integers(low, high, spec.context_tokens))]
        turns += [tuple(int(t) for t in rng.integers(low, high, spec.question_tokens))
                  for _ in range(spec.followups)]
        sessions.append(Session(f"s{i}", tuple(turns), spec.answer_tokens, float(arrivals[i]),
                                tuple(float(x) for x in think[i]) if think is not None else ()))
    return sessions


def sessions_to_json(sessions: list[Session]) -> list[dict]:
    """Plain dicts (for a driver in another process, e.g. `vllm_driver`)."""
    return [{"session_id": s.session_id, "turns": [list(t) for t in s.turns],
             "answer_tokens": s.answer_tokens, "arrival": s.arrival,
             "think_times": list(s.think_times)} for s in sessions]


# ----- budget profiles of random models ------------------------------------------------------

def skewed_head_budgets(num_layers: int, num_kv_heads: int, rho: float,
                        rng: np.random.Generator) -> np.ndarray:
    """[layers, kv_heads] budgets with a calibrated profile's long tail (a few heads keep most
    of the context, most keep little), mean `rho`, each in [0.02, 1] (clipping at 1 lowers the
    mean; the unclipped part is rescaled until it holds)."""
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho!r}")
    raw = rng.lognormal(mean=0.0, sigma=1.0, size=(num_layers, num_kv_heads))
    b = raw / raw.mean() * rho
    for _ in range(20):
        b = np.clip(b, 0.02, 1.0)
        b *= rho / b.mean()
    return np.clip(b, 0.02, 1.0)


# The high tier's share of every head's kept tokens in a random model's tiered profile (no
# calibration exists for random weights): half, LeanKV's K8V4-K4V2 middle setting.
SYNTHETIC_HIGH_SHARE = 0.5


def skewed_profile(model_config, group_size: int, rho: float, seed: int = 0, *,
                   name: str = "random-llama", tiers: str | None = None):
    """A `BudgetProfile` of `skewed_head_budgets` for `model_config`, heads clustered by budget
    into groups of `group_size`; with `tiers` (a `kv_layout.PRECISION_TIERS` name) also tier
    budgets giving every head's high tier `SYNTHETIC_HIGH_SHARE` of its kept tokens."""
    import dataclasses

    from tangram_jax.compression.profile import BudgetProfile, TierBudgets
    budget = skewed_head_budgets(model_config.num_layers, model_config.num_kv_heads, rho,
                                 np.random.default_rng(seed))
    profile = BudgetProfile.from_budgets(model=dict(model_config.fingerprint(), name=name),
                                         method="snapkv", rho=rho, lambda_=2.0, mean=budget,
                                         std=0 * budget, budget=budget, group_size=group_size)
    if tiers is None:
        return profile
    share = np.full(budget.shape, SYNTHETIC_HIGH_SHARE)
    return dataclasses.replace(profile, tiers=TierBudgets(
        precision=tiers, mass=1.0, lambda_=0.0, mean=share, std=np.zeros_like(share),
        high_share=share))
