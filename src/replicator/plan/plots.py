"""The PNG plots of ``bench`` and ``plan`` (matplotlib, optional, drawn off-screen). Each
writes one file and returns the data it drew (``{label: [(x, y), ...]}``) for tests to check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def _figure(path: str | Path, title: str, width: float = 7) -> Iterator[Any]:
    """The axes of a new figure; on leaving, its title and legend, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4.5), dpi=110)
    try:
        yield ax
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _line(ax: Any, pts: list[tuple[float, float]], *style: str, **kwargs: Any) -> Any:
    return ax.plot([x for x, _ in pts], [y for _, y in pts], *style, **kwargs)[0]


def throughput_plot(points: Series, path: str | Path, *, baseline: float | None = None,
                    ceiling: dict[int, float] | None = None, title: str = "") -> Series:
    """Samples/s against replicas per strategy, with linear scaling and the measured ceiling."""
    drawn: Series = {label: sorted(pts) for label, pts in sorted(points.items())}
    xs_all = sorted({x for pts in points.values() for x, _ in pts} | {1})
    with _figure(path, title or "throughput against replicas") as ax:
        for label, pts in drawn.items():
            _line(ax, pts, marker="o", label=label)
        if baseline:
            top = max(xs_all)
            drawn["linear scaling"] = [(1.0, baseline), (float(top), baseline * top)]
            _line(ax, drawn["linear scaling"], "k--", lw=1, label="linear scaling from one process")
        if ceiling:
            drawn["ceiling"] = sorted((float(n), v) for n, v in ceiling.items())
            _line(ax, drawn["ceiling"], ":", color="gray", lw=1.5,
                  label="without exposed communication (measured)")
        ax.set(xlabel="replicas (worker processes)", ylabel="samples / s", xticks=xs_all)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return drawn


def breakdown_plot(rows: Sequence[tuple[str, dict[str, float]]], path: str | Path, *,
                   title: str = "") -> Series:
    """A stacked bar per setting: milliseconds per step in each part."""
    labels = [label for label, _ in rows]
    bottoms = [0.0] * len(rows)
    drawn: Series = {}
    parts = [p for p in COLORS if any(parts.get(p, 0) > 0 for _, parts in rows)]
    with _figure(path, title or "where a step's time goes", max(5.0, 1.3 * len(rows) + 2)) as ax:
        for part in parts:
            heights = [parts.get(part, 0.0) * 1e3 for _, parts in rows]
            ax.bar(labels, heights, bottom=bottoms, color=COLORS[part], label=part)
            drawn[part] = [(float(i), h) for i, h in enumerate(heights)]
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("ms per step")
        ax.grid(axis="y", alpha=0.3)
        for tick in ax.get_xticklabels():
            tick.set(rotation=20, ha="right")
    return drawn


def plan_plot(points: Series, path: str | Path, *, recommended: tuple[float, float] | None,
              misfits: Series | None = None, title: str = "") -> Series:
    """Predicted samples/s against workers; misfits hollow, the recommended one a star."""
    drawn: Series = {label: sorted(pts) for label, pts in sorted(points.items())}
    with _figure(path, title or "predicted throughput (hollow: does not fit in memory)") as ax:
        for label, pts in drawn.items():
            line = _line(ax, pts, marker="o", label=label)
            bad = (misfits or {}).get(label, [])
            if bad:
                ax.scatter([x for x, _ in bad], [y for _, y in bad], s=60, facecolors="white",
                           edgecolors=line.get_color(), zorder=3)
        if recommended is not None:
            ax.scatter([recommended[0]], [recommended[1]], marker="*", s=250, color="gold",
                       edgecolors="black", zorder=4, label="recommended")
            drawn["recommended"] = [recommended]
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="workers", ylabel="predicted samples / s")
        ax.grid(alpha=0.3, which="both")
    return drawn
