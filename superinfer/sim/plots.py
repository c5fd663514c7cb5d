"""The attainment-vs-rate figure shared by `sim`, the fidelity study and `bench serve`:
TTFT and TBT SLO attainment side by side (like the paper's Fig. 16)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PANELS = (("ttft_attainment", "TTFT SLO attainment"), ("tbt_attainment", "TBT SLO attainment"))


def attainment_figure(path: str, title: str, draw: Callable[[Any, str], None],
                      legend_size: int = 8) -> None:
    """Two panels; `draw(ax, key)` plots the series of one attainment key into an axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, (key, name) in zip(axes, PANELS, strict=True):
        draw(ax, key)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.set_title(name)
    axes[0].legend(fontsize=legend_size)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rate_plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    # Policies often coincide (no memory pressure: no rotation): vary the line style and
    # marker size so that overlapping curves stay visible.
    styles = ["-", "--", "-.", ":"]

    def draw(ax: Any, key: str) -> None:
        for j, label in enumerate(labels):
            pts = sorted((r["rps"], r[key]) for r in rows if r["policy"] == label)
            xs = [x for x, y in pts if y is not None]
            ys = [100 * y for x, y in pts if y is not None]
            ax.plot(xs, ys, marker="os^Dv<>p"[j % 8], markersize=max(3, 8 - j),
                    linestyle=styles[j % len(styles)], label=label)

    attainment_figure(path, title, draw)
