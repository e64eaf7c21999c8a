"""Figures: NIAH heatmap, per-layer/head IoU map, budget-quality curves. matplotlib with the Agg backend; matplotlib
is part of the eval extra (`pip install 'sparsekv[eval]'`), imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path

from sparsekv.eval.common import require_extra


def require_plots() -> None:
    """ConfigError naming the eval extra when matplotlib is not installed (check before a long run that plots)."""
    require_extra("matplotlib")


def _plt():
    require_extra("matplotlib").use("Agg", force=True)
    return require_extra("matplotlib.pyplot")


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _plt().close(fig)
    return path


def _red_to_green():
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list("score", ["#d7263d", "#f4b942", "#2bb673"])


def niah_heatmap(payload: dict, path: Path) -> Path:
    """Depth (rows, 0% at top) x context length (columns); green = needle retrieved."""
    from sparsekv.eval.niah import score_matrix

    plt = _plt()
    matrix = score_matrix(payload)
    lengths, depths = payload["lengths"], payload["depths"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.45 * len(depths)))
    image = ax.imshow(matrix, cmap=_red_to_green(), vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n / 1000:g}K" if n >= 1000 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if matrix[i, j] == matrix[i, j]:
                ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7)
    config = payload["config"]
    budget = "" if config["budget"] is None else f", budget {config['budget']}"
    ax.set_title(f"needle in a haystack: {config['method']}{budget}\n"
                 f"{payload['scorer']}, mean {payload['score']:.3f}", fontsize=9)  # fmt: skip
    fig.colorbar(image, ax=ax, fraction=0.04)
    return _save(fig, path)


def iou_map(payload: dict, path: Path, metric: str = "iou") -> Path:
    """Layers (rows) x selection heads (columns) of the per-head IoU (blank = dense layer)."""
    import numpy as np

    plt = _plt()
    grid = payload[f"{metric}_per_head"]
    heads = max(len(row) for row in grid if row is not None)
    matrix = np.array([[np.nan] * heads if row is None else row for row in grid], float)
    fig, ax = plt.subplots(figsize=(1.6 + 0.5 * matrix.shape[1], 1.0 + 0.22 * matrix.shape[0]))
    image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xlabel("selection head (kv head for gqa=group)")
    ax.set_ylabel("layer")
    ax.set_xticks(range(matrix.shape[1]))
    config = payload["config"]
    ax.set_title(f"{metric} vs oracle top-k: {config['method']}, budget {config['budget']}\n"
                 f"mean {payload[f'mean_{metric}']:.3f} (blank = dense layer)", fontsize=9)  # fmt: skip
    fig.colorbar(image, ax=ax, fraction=0.05)
    return _save(fig, path)


def budget_curve(rows: list[dict], path: Path, metric: str, title: str, lower_is_better: bool = False) -> Path:
    """One line per method over budgets; methods without a budget (dense) are a dashed horizontal line.

    rows: {"method", "budget" (float fraction | int | None), "value"} with value None for failed cells.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    markers = "osD^v<>phX*"
    for i, method in enumerate(methods):
        points = [(r["budget"], r["value"]) for r in rows if r["method"] == method and r["value"] is not None]
        if not points:
            continue
        if all(b is None for b, _ in points):
            ax.axhline(points[0][1], linestyle="--", color="black", linewidth=1, label=method)
            continue
        points = sorted((b, v) for b, v in points if b is not None)
        ax.plot([b for b, _ in points], [v for _, v in points], marker=markers[i % len(markers)], label=method)
    if budgets and all(isinstance(b, float) for b in budgets):
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{100 * b:g}%" for b in budgets])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("token budget (fraction of the context)")
    else:
        ax.set_xlabel("token budget")
    if lower_is_better and metric == "ppl":
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        ax.yaxis.set_minor_formatter(plain if high / low < 10 else NullFormatter())
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better else " (higher is better)"))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)
