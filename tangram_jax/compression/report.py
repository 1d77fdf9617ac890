"""Regularity report of a calibration: is head-wise retention a property of the model?

- Spearman rank correlation of the heads' retention between every pair of samples (mean over
  pairs), both over all (layer, head) pairs of the model and within each layer, and between the
  mean retention of every pair of task types;
- overflow rate: the fraction of (sample, layer, head) whose implicit retention exceeded the
  static budget (inputs that wanted more than the budget gives them);
- a box plot PNG of per-head retention across samples, heads ordered by budget, one panel per
  chosen layer, the budget marked on every box.
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy.stats import rankdata

from tangram_jax.compression.calibration import CalibrationRun
from tangram_jax.compression.clustering import compare_groupings


def _mean_pairwise_rank_corr(values: np.ndarray) -> float:
    """values [items, n]: mean Spearman correlation over all pairs of rows (rows with no variation
    have no ranking and are left out)."""
    ranks = rankdata(values, axis=-1)
    centered = ranks - ranks.mean(axis=-1, keepdims=True)
    norm = np.linalg.norm(centered, axis=-1)
    ok = norm > 0
    z = centered[ok] / norm[ok, None]
    if len(z) < 2:
        return float("nan")
    corr = z @ z.T
    upper = np.triu_indices(len(z), k=1)
    return float(corr[upper].mean())


def spearman_across_samples(retention: np.ndarray) -> dict:
    """retention [samples, layers, heads] -> mean pairwise Spearman: 'global' ranks all layer-heads
    together; 'within_layer' ranks the heads of each layer (mean over layers)."""
    n, layers, heads = retention.shape
    within = np.array([_mean_pairwise_rank_corr(retention[:, l, :]) for l in range(layers)])
    defined = within[np.isfinite(within)]
    return dict(global_=_mean_pairwise_rank_corr(retention.reshape(n, layers * heads)),
                within_layer=float(defined.mean()) if defined.size else float("nan"))


def spearman_across_tasks(retention: np.ndarray, tasks) -> dict:
    """The same between the mean retention of each task type (mean over task pairs)."""
    tasks = np.asarray(tasks)
    names = sorted(set(tasks.tolist()))
    means = np.stack([retention[tasks == t].mean(axis=0) for t in names])
    result = spearman_across_samples(means)
    result["tasks"] = names
    return result


def overflow_rate(retention: np.ndarray, budgets: np.ndarray) -> float:
    """Fraction of (sample, layer, head) with implicit retention above the static budget."""
    return float((retention > budgets[None] + 1e-9).mean())


def leave_one_out_overflow_rate(retention: np.ndarray, lambda_: float) -> float:
    """Overflow of each sample against budgets calibrated on the other samples (held out), averaged:
    what a new input sees, not the in-sample figure."""
    from tangram_jax.compression.calibration import static_budgets
    n = retention.shape[0]
    if n < 2:
        return float("nan")
    rates = []
    for i in range(n):
        rest = np.delete(retention, i, axis=0)
        rates.append(overflow_rate(retention[i:i + 1],
                                   static_budgets(rest.mean(axis=0), rest.std(axis=0), lambda_)))
    return float(np.mean(rates))


def summarize(run: CalibrationRun, rho: float, budgets: np.ndarray,
              group_sizes: tuple[int, ...], lambda_: float | None = None) -> dict:
    """Spearman (samples, tasks), overflow and grouping memory at `rho` for the given budgets.

    With `lambda_` (budgets not rescaled) the held-out (leave-one-out) overflow is added.
    """
    retention = run.retention[rho]
    heads = budgets.shape[1]
    return dict(
        held_out_overflow_rate=(leave_one_out_overflow_rate(retention, lambda_)
                                if lambda_ is not None else None),
        rho=rho,
        samples=retention.shape[0],
        spearman_samples=spearman_across_samples(retention),
        spearman_tasks=spearman_across_tasks(retention, run.tasks),
        overflow_rate=overflow_rate(retention, budgets),
        mean_budget=float(budgets.mean()),
        groupings=[compare_groupings(budgets, g) for g in group_sizes if heads % g == 0],
    )


def format_summary(summary: dict) -> str:
    s = summary
    lines = [
        f"rho={s['rho']}  samples={s['samples']}  mean static budget={s['mean_budget']:.3f}",
        f"Spearman across samples: all layer-heads {s['spearman_samples']['global_']:.3f}, "
        f"within layer {s['spearman_samples']['within_layer']:.3f} (mean over sample pairs)",
        f"Spearman across task types ({', '.join(s['spearman_tasks']['tasks'])}): all layer-heads "
        f"{s['spearman_tasks']['global_']:.3f}, within layer {s['spearman_tasks']['within_layer']:.3f}",
        f"overflow rate (retention > static budget): {100 * s['overflow_rate']:.2f}% of "
        "(sample, layer, head)" + ("" if s.get("held_out_overflow_rate") is None else
                                   f"; held out (leave-one-out): {100 * s['held_out_overflow_rate']:.2f}%"),
    ]
    for g in s["groupings"]:
        lines.append(
            f"G={g['group_size']}: allocated / sum of head budgets: budget-aware "
            f"{g['budget_aware_relative_to_budgets']:.3f}, adjacent {g['adjacent_relative_to_budgets']:.3f}; "
            f"of full cache: {100 * g['budget_aware_of_full']:.1f}% vs {100 * g['adjacent_of_full']:.1f}% "
            f"(clustering reclaims {100 * g['reclaimed_vs_adjacent_of_full']:.1f}% of the full cache more)")
    return "\n".join(lines)


def default_layers(num_layers: int, panels: int = 6) -> list[int]:
    return sorted(set(np.linspace(0, num_layers - 1, min(panels, num_layers)).round().astype(int).tolist()))


def retention_boxplot(retention: np.ndarray, budgets: np.ndarray, rho: float, path,
                      layers: list[int] | None = None, title: str = "") -> None:
    """Box plot PNG: retention [samples, layers, heads] of each chosen layer's heads, ordered by
    budget (descending), the static budget drawn as a red tick and rho as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = default_layers(retention.shape[1]) if layers is None else list(layers)
    cols = min(3, len(layers))
    rows = -(-len(layers) // cols)
    heads = retention.shape[2]
    top = min(1.02, 1.15 * max(float(retention[:, layers].max()), float(budgets[layers].max())))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 0.4 * heads, 2.8 * rows),
                             sharey=True, squeeze=False)
    for ax, layer in itertools.zip_longest(axes.flat, layers):
        if layer is None:
            ax.axis("off")
            continue
        order = np.argsort(-budgets[layer], kind="stable")
        ax.boxplot([retention[:, layer, h] for h in order], widths=0.5, showfliers=True,
                   flierprops=dict(markersize=3))
        x = np.arange(1, heads + 1)
        ax.scatter(x, budgets[layer, order], marker="_", s=400, color="tab:red", zorder=3,
                   label="static budget")
        ax.axhline(rho, color="gray", linestyle="--", linewidth=0.8, label=f"rho={rho}")
        ax.set_xticks(x, [f"h{h}" for h in order])
        ax.set_title(f"layer {layer}", fontsize=10)
        ax.set_ylim(0, top)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("implicit retention")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle(title or f"Per-head implicit retention across {retention.shape[0]} samples "
                 f"(heads by budget)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.92, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
