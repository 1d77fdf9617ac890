"""Offline budget calibration: the implicit retention of each KV head under the dynamic method.

For every pilot sample the model runs its prompt layer by layer (dense causal attention); each
layer's q/k/v go through the scorer, and the dynamic selection (`selection.dynamic_select`,
Ada-SnapKV) at each target ratio rho decides how many tokens each KV head keeps. A head's implicit
retention is count / T. Scores are computed once per sample and every requested rho is evaluated
from them. Over the samples this gives per (layer, head) a mean m and std s, and the static budget

    b = min(1, m + lambda * s)                         (Tangram, lambda = 2 by default)

optionally rescaled per layer so the layer's budgets average rho (`rescale_to_ratio`).

Local (sliding-window) layers (Gemma-3, GPT-OSS) run with their window (and GPT-OSS's sinks)
as the model does, but are not scored: their retention is 1 (a local layer keeps its window
whole, `kv_layout`, "Local layers"), so their budgets are 1, the per-layer rescale leaves them
there, and the target ratio is what the global layers keep.

Precision tiers (hetero-precision KV, `kv_layout.TieredLayout`): with `tier_mass` set, the same
pass also measures, per head, the share of its retained tokens that must stay in the high tier
(`high_tier_share`: importance ranks within the retained set decide), and `profile_from_run`
turns its mean and std into the profile's static tier budgets the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tangram_jax.compression.pilot_data import PilotSample
from tangram_jax.compression.scorers import get_scorer
from tangram_jax.compression.selection import dynamic_select
from tangram_jax.models.decoder import causal_mask, dense_attention


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """Implicit retention of every pilot sample.

    retention: {rho: float64 [samples, layers, kv_heads]}; tasks, lengths: per sample.
    """

    method: str
    safeguard: float
    retention: dict[float, np.ndarray]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    high_share: dict[float, np.ndarray] | None = None   # {rho: [samples, layers, kv_heads]}
    tier_mass: float | None = None

    def stats(self, rho: float) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) [layers, kv_heads] of the retention at `rho` over the samples."""
        r = self.retention[rho]
        return r.mean(axis=0), r.std(axis=0)

    def save(self, path) -> None:
        """Raw per-sample retention as .npz (for reports without re-running the model)."""
        rhos = sorted(self.retention)
        tiers = {} if self.high_share is None else dict(
            tier_mass=self.tier_mass, high_share=np.stack([self.high_share[r] for r in rhos]))
        np.savez_compressed(path, method=self.method, safeguard=self.safeguard,
                            rhos=np.array(rhos), tasks=np.array(self.tasks),
                            lengths=np.array(self.lengths),
                            retention=np.stack([self.retention[r] for r in rhos]), **tiers)

    @classmethod
    def load(cls, path) -> "CalibrationRun":
        with np.load(path) as f:
            tiers = {} if "high_share" not in f else dict(
                tier_mass=float(f["tier_mass"]),
                high_share={float(r): f["high_share"][i] for i, r in enumerate(f["rhos"])})
            return cls(method=str(f["method"]), safeguard=float(f["safeguard"]),
                       retention={float(r): f["retention"][i] for i, r in enumerate(f["rhos"])},
                       tasks=tuple(str(t) for t in f["tasks"]),
                       lengths=tuple(int(n) for n in f["lengths"]), **tiers)


def static_budgets(mean: np.ndarray, std: np.ndarray, lambda_: float = 2.0) -> np.ndarray:
    """b = min(1, mean + lambda * std), floored at a tiny positive value so b lies in (0, 1]."""
    if lambda_ < 0:
        raise ValueError(f"lambda must be >= 0, got {lambda_}")
    b = np.minimum(1.0, np.asarray(mean, np.float64) + lambda_ * np.asarray(std, np.float64))
    return np.maximum(b, 1e-6)


def rescale_to_ratio(budgets: np.ndarray, rho: float, iterations: int = 50) -> np.ndarray:
    """Scales each layer's budgets [layers, heads] so they average `rho`, clipped to (0, 1].

    Heads clipped at 1 cannot grow; the others are scaled again until the layer average is rho
    (water filling), so the average is exact whenever rho <= 1.
    """
    if not 0 < rho <= 1:
        raise ValueError(f"rho must lie in (0, 1], got {rho}")
    b = np.asarray(budgets, np.float64).copy()
    heads = b.shape[-1]
    for _ in range(iterations):
        clipped = b >= 1.0
        free_sum = np.where(clipped, 0.0, b).sum(axis=-1, keepdims=True)
        target_free = rho * heads - clipped.sum(axis=-1, keepdims=True)
        scale = np.where(free_sum > 0, target_free / np.maximum(free_sum, 1e-300), 1.0)
        new = np.where(clipped, b, np.minimum(1.0, b * scale))
        if np.allclose(new, b, rtol=0, atol=1e-12):
            break
        b = new
    return np.clip(b, 1e-6, 1.0)


def high_tier_share(scores: jax.Array, counts: jax.Array, mass: float) -> jax.Array:
    """Share of each head's retained tokens the high-precision tier must hold.

    scores: float [heads, T] importance; counts: int [heads], each head keeps its top counts[h]
    tokens. Within that retained set, ranked by score, the high tier is the shortest top run
    that carries `mass` of the set's importance, a token's importance being its score minus the
    set's lowest (so the scorer's scale and sign do not matter; the least important retained
    token carries none). Returns float32 [heads] in [0, 1]: run length / counts (1 where the
    set is empty or all its scores are equal: nothing tells the tokens apart).
    """
    heads, t = scores.shape
    ranked = -jnp.sort(-scores.astype(jnp.float32), axis=1)             # best first
    in_set = jnp.arange(t)[None, :] < counts[:, None]
    floor = jnp.take_along_axis(ranked, jnp.maximum(counts - 1, 0)[:, None], axis=1)
    weight = jnp.where(in_set, ranked - floor, 0.0)
    total = weight.sum(axis=1, keepdims=True)
    # Tokens needed: those before the cumulative weight first reaches mass * total, plus it.
    needed = (jnp.cumsum(weight, axis=1) < mass * total * (1 - 1e-6)).sum(axis=1) + 1
    share = jnp.minimum(needed, counts) / jnp.maximum(counts, 1)
    return jnp.where((total[:, 0] > 0) & (counts > 0), share, 1.0)


def padded_length(t: int) -> int:
    """The sequence length a `t`-token pilot sample is padded to: the smallest 2^k or 3 x 2^k at
    least t (and 16). Samples of the same padded length share one compiled layer program (an 8B
    layer's compile on a GPU costs seconds, pilot samples have ~50 distinct lengths); padding
    adds at most half, and sits after the sample, where causal attention hides it."""
    n = 16
    while n < t:
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return n


def _layer_step_fn(graphdef, scorer, q_per_kv: int, rhos: tuple[float, ...], safeguard: float,
                   tier_mass: float | None = None):
    """jit(state, h [1, T, D], num_valid) -> (h, counts [len(rhos), kv_heads], high-tier shares
    [len(rhos), kv_heads] (zeros without `tier_mass`)): one decoder layer plus scoring of the
    first `num_valid` positions (the rest is padding, `padded_length`).

    Every layer of the decoder has the same structure, so one graphdef and one compilation per
    padded length serve all of them; only the layer's state (weights) changes.
    """
    @jax.jit
    def step(state, h, num_valid):
        layer = nnx.merge(graphdef, state)
        t = h.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        q, k, v = layer.qkv(h, positions)
        window = layer.attention_window()
        mask = causal_mask(positions, positions[0], window)
        h_out = layer.finish(h, dense_attention(q, k, v, mask, layer.attention_sinks()))
        scores = scorer(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                        q_per_kv=q_per_kv, num_valid=num_valid)
        scores = jnp.where(jnp.arange(t) < num_valid, scores, -jnp.inf)
        counts = jnp.stack([dynamic_select(scores, rho, safeguard=safeguard,
                                           num_valid=num_valid).counts for rho in rhos])
        counts = jnp.where(window > 0, num_valid, counts)   # a local layer keeps its window whole
        shares = (jnp.stack([high_tier_share(scores, c, tier_mass) for c in counts])
                  if tier_mass is not None else jnp.zeros(counts.shape, jnp.float32))
        return h_out, counts, shares
    return step


def run_calibration(model, config, samples: Sequence[PilotSample], rhos: Iterable[float], *,
                    method: str = "snapkv", safeguard: float = 0.2, scorer_options: dict | None = None,
                    progress: Callable[[Iterable], Iterable] | None = None,
                    tier_mass: float | None = None, pad: bool = True) -> CalibrationRun:
    """Runs the dynamic method over `samples` and records each head's implicit retention (and,
    with `tier_mass` in (0, 1], its high-tier share, `high_tier_share`).

    pad: run each sample padded to `padded_length` (a few compiled programs); False compiles one
    per distinct length. The counts are the same either way.

    model: a `tangram_jax.models.decoder.Decoder` (layers expose `qkv` and `finish`);
    config: its `ModelConfig`. `progress` wraps the sample iterator (e.g. tqdm).
    """
    rhos = tuple(float(r) for r in rhos)
    for r in rhos:
        if not 0 < r <= 1:
            raise ValueError(f"target ratio rho must lie in (0, 1], got {r}")
    if not samples:
        raise ValueError("calibration needs at least one pilot sample")
    for sample in samples:   # the embedding would clamp an id past the vocabulary silently
        bad = [t for t in sample.tokens if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"pilot sample ({sample.task}, {len(sample.tokens)} tokens) has "
                             f"token ids {bad[:5]} outside the model's vocabulary [0, "
                             f"{config.vocab_size}): the tokenizer does not match the model")
    options = dict(scorer_options or {})
    if method == "expected_attention" and "inv_freq" not in options:
        from tangram_jax.models.rope import inverse_frequencies
        options["inv_freq"] = inverse_frequencies(config)
    if tier_mass is not None and not 0 < tier_mass <= 1:
        raise ValueError(f"tier_mass must lie in (0, 1], got {tier_mass}")
    scorer = get_scorer(method, **options)
    graphdef, _ = nnx.split(model.layers[0])
    states = [nnx.split(layer)[1] for layer in model.layers]
    step = _layer_step_fn(graphdef, scorer, config.q_per_kv, rhos, safeguard, tier_mass)
    embed = jax.jit(lambda tokens: model.embed(tokens))

    counts = np.zeros((len(samples), len(rhos), config.num_layers, config.num_kv_heads), np.int64)
    shares = np.zeros(counts.shape, np.float64)
    iterator = progress(list(enumerate(samples))) if progress else enumerate(samples)
    for i, sample in iterator:
        n = len(sample.tokens)
        tokens = np.zeros(padded_length(n) if pad else n, np.int32)
        tokens[:n] = sample.tokens
        h = embed(jnp.asarray(tokens)[None])
        num_valid = jnp.int32(n)
        per_layer, per_layer_shares = [], []
        for state in states:
            h, layer_counts, layer_shares = step(state, h, num_valid)
            per_layer.append(layer_counts)
            per_layer_shares.append(layer_shares)
        counts[i] = np.asarray(jnp.stack(per_layer, axis=1))
        shares[i] = np.asarray(jnp.stack(per_layer_shares, axis=1))
    lengths = np.array([len(s.tokens) for s in samples], np.float64)
    retention = {rho: counts[:, j] / lengths[:, None, None] for j, rho in enumerate(rhos)}
    tiers = {} if tier_mass is None else dict(
        tier_mass=float(tier_mass), high_share={rho: shares[:, j] for j, rho in enumerate(rhos)})
    return CalibrationRun(method=method, safeguard=safeguard, retention=retention,
                          tasks=tuple(s.task for s in samples),
                          lengths=tuple(len(s.tokens) for s in samples), **tiers)


def chat_tokenizer(tokenizer) -> Callable[[list[dict]], list[int]]:
    """messages -> token ids with the model's chat template (a generation prompt after a user turn)."""
    def tokenize(messages):
        return tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=messages[-1]["role"] == "user")
    return tokenize


def profile_from_run(run: CalibrationRun, rho: float, *, model: dict, lambda_: float = 2.0,
                     group_size: int = 1, grouping: str = "budget", rescale: bool = False,
                     metadata: dict | None = None, tiers: str | None = None):
    """The `BudgetProfile` of a calibration run at `rho` (budgets, optional rescale, grouping;
    with `tiers`, a `kv_layout.PRECISION_TIERS` name, also the static high-tier shares
    ``min(1, mean + lambda * std)`` of a run made with `tier_mass`)."""
    from tangram_jax.compression.profile import BudgetProfile, creation_metadata
    if rho not in run.retention:
        raise ValueError(f"the calibration run has no ratio {rho}; it has {sorted(run.retention)}")
    mean, std = run.stats(rho)
    budget = static_budgets(mean, std, lambda_)
    if rescale:
        budget = rescale_to_ratio(budget, rho)
    meta = creation_metadata(len(run.tasks), tasks=sorted(set(run.tasks)),
                             task_counts={t: run.tasks.count(t) for t in sorted(set(run.tasks))},
                             min_tokens=min(run.lengths), max_tokens=max(run.lengths),
                             mean_tokens=float(np.mean(run.lengths)))
    meta.update(metadata or {})
    return BudgetProfile.from_budgets(model=model, method=run.method, rho=rho, lambda_=lambda_,
                                      mean=mean, std=std, budget=budget, group_size=group_size,
                                      grouping=grouping, safeguard=run.safeguard, rescaled=rescale,
                                      metadata=meta, tiers=_tier_budgets(run, rho, tiers, lambda_))


def _tier_budgets(run: CalibrationRun, rho: float, precision: str | None, lambda_: float):
    from tangram_jax.compression.profile import TierBudgets
    if precision is None:
        return None
    if run.high_share is None:
        raise ValueError("tiers need a calibration run made with tier_mass (high-tier shares)")
    shares = run.high_share[rho]
    mean, std = shares.mean(axis=0), shares.std(axis=0)
    return TierBudgets(precision=precision, mass=float(run.tier_mass), lambda_=float(lambda_),
                       mean=mean, std=std, high_share=np.minimum(1.0, mean + lambda_ * std))
