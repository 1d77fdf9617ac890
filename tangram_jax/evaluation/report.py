"""The accuracy table as text (markdown) and as a plot of accuracy vs keep ratio per task.

Both read the harness JSON (`benchmarks/results/accuracy.json`) and, when given, the kvpress
script's JSON of the same shape, so one table and one figure hold both libraries.
"""

from __future__ import annotations

from pathlib import Path


def served_rows(report: dict) -> list[dict]:
    """The report's rows, each compressing mode of this library labelled with what its engine
    served beyond the defaults: a scoring rule other than the window (``tangram
    (window+keydiff)``), a profile calibrated with another method than SnapKV (``tangram
    (keydiff profile)``), retention "chunk" and the held-turn view "whole" (``tangram (retention
    chunk)``, ``tangram (whole view)``). The engine's rule, method, retention and view come from
    the report's `engines` (recorded since "auto"; the view, where the engines lack it, from the
    part's `--turn-view`), else the rule from the part's `--scoring-rule`. A merged report's
    rows are labelled already (it has no `engines`)."""
    asked = (report.get("config") or {}).get("scoring_rule")
    asked_view = (report.get("config") or {}).get("turn_view")
    engines = report.get("engines")
    if engines is None and "parts" in report:
        return [dict(r) for r in report["results"]]
    out = []
    for row in report["results"]:
        row = dict(row)
        if row["mode"] != "full" and row.get("library", "tangram-jax") == "tangram-jax":
            served = (engines or {}).get(f"{row['mode']}@{row['ratio']:g}") or {}
            notes = []
            method = served.get("method")
            if method and method != "snapkv" and row["mode"].startswith("tangram"):
                notes.append(f"{method} profile")
            rule = served.get("scoring_rule") or asked or "window"
            if rule != "window":
                notes.append(rule)
            if served.get("retention") == "chunk":
                notes.append("retention chunk")
            elif (served.get("turn_view") or asked_view) == "whole":
                notes.append("whole view")
            if notes:
                row["mode"] = f"{row['mode']} ({', '.join(notes)})"
        out.append(row)
    return out


def merge_reports(*parts: dict, mixed_revisions: bool = False) -> dict:
    """One report from the parts of one table (one process a part, each serving full KV beside its
    modes, e.g. `benchmarks/accuracy_gpu_all.sh`). Parts must share the git revision, device and
    task file; full KV's rows must be equal in every part (greedy serving is deterministic, so a
    difference means the parts did not serve the same thing) and are kept once. A part served with
    a scoring rule other than the default labels its compressed rows ``mode (rule)``, so rules
    sit beside each other in one table.

    `mixed_revisions` admits parts of different git revisions (each part's is recorded, and
    full KV's rows must still be equal): for a column added later to a table whose other
    columns' code did not change.

    Raises ValueError naming the field and the parts' values when they disagree."""
    if not parts:
        raise ValueError("merge_reports needs at least one report, got none")
    for key in ("device", "tasks_file") + (() if mixed_revisions else ("git_revision",)):
        values = sorted({str(p.get(key)) for p in parts})
        if len(values) > 1:
            raise ValueError(f"parts disagree on {key}: {values}; merge parts of one run only"
                             + (" (or pass mixed_revisions)" if key == "git_revision" else ""))
    rows: dict[tuple, dict] = {}
    for part in parts:
        for row in served_rows(part):
            key = (row.get("library", "tangram-jax"), row["task"], row["mode"], row["ratio"])
            seen = rows.get(key)
            if seen is None:
                rows[key] = row
            elif (seen["n"], seen["correct"]) != (row["n"], row["correct"]):
                raise ValueError(
                    f"parts disagree on {key}: {seen['correct']}/{seen['n']} vs "
                    f"{row['correct']}/{row['n']} correct")
    first = parts[0]
    return {
        "benchmark": first.get("benchmark", "accuracy"),
        "device": first.get("device"),
        "git_revision": ",".join(dict.fromkeys(str(p.get("git_revision")) for p in parts)),
        "tasks_file": first.get("tasks_file"),
        "max_model_len": first.get("max_model_len"),
        "parts": [{"command": p.get("command"), "git_revision": p.get("git_revision"),
                   "seconds": p.get("seconds"),
                   "kl_status": p.get("kl_status"), "complete": p.get("complete"),
                   "scoring_rule": (p.get("config") or {}).get("scoring_rule")}
                  for p in parts],
        "complete": all(p.get("complete", False) for p in parts),
        "seconds": round(sum(p.get("seconds") or 0 for p in parts), 1),
        "results": list(rows.values()),
        "checks": first.get("checks"),
    }


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def _row_label(r: dict) -> str:
    lib = "" if r.get("library", "tangram-jax") == "tangram-jax" else f"{r['library']} "
    return f"{lib}{r['mode']}"


def markdown_table(*reports: dict) -> str:
    """One line per (library, mode, ratio), one column group per task: accuracy % [95% CI],
    then agreement and KL with full KV (of the report's own library)."""
    rows = [r for rep in reports for r in served_rows(rep)]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    header = ["method", "ratio"] + [f"{t} acc % [CI]" for t in tasks] + \
        ["follow-up acc %", "agreement %", "KL (nats/token)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = list(dict.fromkeys((r.get("library", "tangram-jax"), r["mode"], r["ratio"])
                              for r in rows))
    for lib, mode, ratio in keys:
        mine = {r["task"]: r for r in rows if (r.get("library", "tangram-jax"), r["mode"],
                                               r["ratio"]) == (lib, mode, ratio)}
        cells = []
        for t in tasks:
            r = mine.get(t)
            cells.append("-" if r is None else
                         f"{_pct(r['accuracy'])} [{_pct(r['ci95'][0])}-{_pct(r['ci95'][1])}]")
        follow = next((r["followup"]["accuracy"] for r in mine.values() if "followup" in r), None)
        all_rows = list(mine.values())
        n_agree = [(r["agreement"], r["n"]) for r in all_rows if r.get("agreement") is not None]
        agree = (sum(a * n for a, n in n_agree) / sum(n for _, n in n_agree)) if n_agree else None
        kl_pos = sum(r.get("kl_positions") or 0 for r in all_rows)
        kl = (sum((r.get("kl") or 0) * (r.get("kl_positions") or 0) for r in all_rows) / kl_pos
              if kl_pos else None)
        label = _row_label(next(iter(mine.values())))
        lines.append("| " + " | ".join([label, f"{ratio:g}"] + cells + [
            _pct(follow), _pct(agree), "-" if kl is None else f"{kl:.3f}"]) + " |")
    return "\n".join(lines)


def plot_accuracy(out: str | Path, *reports: dict) -> None:
    """Accuracy (with 95% CI bars) vs keep ratio, one panel per task, one line per method; full
    KV is the point at ratio 1 of every line of its library."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for rep in reports for r in served_rows(rep)]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False,
                             sharey=True)
    for ax, task in zip(axes[0], tasks):
        task_rows = [r for r in rows if r["task"] == task]
        for lib in dict.fromkeys(r.get("library", "tangram-jax") for r in task_rows):
            lib_rows = [r for r in task_rows if r.get("library", "tangram-jax") == lib]
            full = next((r for r in lib_rows if r["mode"] == "full"), None)
            style = "-" if lib == "tangram-jax" else "--"
            for mode in dict.fromkeys(r["mode"] for r in lib_rows if r["mode"] != "full"):
                pts = sorted((r for r in lib_rows if r["mode"] == mode), key=lambda r: r["ratio"])
                if full is not None and all(p["ratio"] < 1 for p in pts):
                    pts = pts + [full]
                xs = [p["ratio"] for p in pts]
                ys = [p["accuracy"] for p in pts]
                err = [[p["accuracy"] - p["ci95"][0] for p in pts],
                       [p["ci95"][1] - p["accuracy"] for p in pts]]
                label = mode if lib == "tangram-jax" else f"{lib}: {mode}"
                ax.errorbar(xs, ys, yerr=err, fmt=style + "o", capsize=3, markersize=4,
                            label=label, alpha=0.85)
            if full is not None:
                ax.axhline(full["accuracy"], color="gray", linestyle=":" if lib == "tangram-jax"
                           else "-.", linewidth=1,
                           label="full KV" if lib == "tangram-jax" else f"{lib}: full KV")
        n = max(r["n"] for r in task_rows)
        ax.set_title(f"{task} (n={n})")
        ax.set_xlabel("keep ratio")
        ax.set_xscale("log", base=2)
        ax.set_xticks([0.25, 0.5, 1.0], ["0.25", "0.5", "1"])
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (95% Wilson CI)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
