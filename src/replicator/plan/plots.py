"""The PNG plots of ``bench`` and ``plan`` (matplotlib, drawn off-screen).

Each function writes one file and returns the data it drew (``{label: [(x, y), ...]}``), so a
caller or a test can check that the axes carry data without reading pixels. matplotlib is an
optional dependency: :func:`available` says whether it is installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["available", "breakdown_plot", "plan_plot", "throughput_plot"]

Series = dict[str, list[tuple[float, float]]]
COLORS = {"compute": "#4477aa", "communication": "#ee6677", "input": "#ccbb44",
          "optimizer": "#228833", "checkpoint": "#aa3377"}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def throughput_plot(points: Series, path: str | Path, *, baseline: float | None = None,
                    ceiling: dict[int, float] | None = None, title: str = "") -> Series:
    """Samples/s against replicas, one line per strategy, with linear scaling from
    ``baseline`` (one process) and the ``ceiling`` each count would reach without its exposed
    communication."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    drawn: Series = {}
    xs_all = sorted({x for pts in points.values() for x, _ in pts} | {1})
    for label, pts in sorted(points.items()):
        pts = sorted(pts)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        drawn[label] = pts
    if baseline:
        top = max(xs_all)
        line = [(1.0, baseline), (float(top), baseline * top)]
        ax.plot([x for x, _ in line], [y for _, y in line], "k--", lw=1,
                label="linear scaling from one process")
        drawn["linear scaling"] = line
    if ceiling:
        pts = sorted((float(n), v) for n, v in ceiling.items())
        ax.plot([x for x, _ in pts], [y for _, y in pts], ":", color="gray", lw=1.5,
                label="without exposed communication (measured)")
        drawn["ceiling"] = pts
    ax.set_xlabel("replicas (worker processes)")
    ax.set_ylabel("samples / s")
    ax.set_xticks(xs_all)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title or "throughput against replicas")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


def breakdown_plot(rows: Sequence[tuple[str, dict[str, float]]], path: str | Path, *,
                   title: str = "") -> Series:
    """A stacked bar per setting: milliseconds per step in each part."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2), 4.5), dpi=110)
    labels = [label for label, _ in rows]
    bottoms = [0.0] * len(rows)
    drawn: Series = {}
    parts = [p for p in COLORS if any(parts.get(p, 0) > 0 for _, parts in rows)]
    for part in parts:
        heights = [parts.get(part, 0.0) * 1e3 for _, parts in rows]
        ax.bar(labels, heights, bottom=bottoms, color=COLORS[part], label=part)
        drawn[part] = [(float(i), h) for i, h in enumerate(heights)]
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms per step")
    ax.set_title(title or "where a step's time goes")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


def plan_plot(points: Series, path: str | Path, *, recommended: tuple[float, float] | None,
              misfits: Series | None = None, title: str = "") -> Series:
    """Predicted samples/s against workers (log-log), one line per strategy; settings that do
    not fit are drawn hollow, the recommended one as a star."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    drawn: Series = {}
    for label, pts in sorted(points.items()):
        pts = sorted(pts)
        line = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)[0]
        drawn[label] = pts
        bad = (misfits or {}).get(label, [])
        if bad:
            ax.scatter([x for x, _ in bad], [y for _, y in bad], s=60, facecolors="white",
                       edgecolors=line.get_color(), zorder=3)
    if recommended is not None:
        ax.scatter([recommended[0]], [recommended[1]], marker="*", s=250, color="gold",
                   edgecolors="black", zorder=4, label="recommended")
        drawn["recommended"] = [recommended]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted samples / s")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title or "predicted throughput (hollow: does not fit in memory)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn
