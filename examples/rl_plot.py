"""Plot of episode return against environment steps and wall time, for the rl examples."""

from __future__ import annotations

import os
import tempfile


def mean_last(returns: list[float], n: int = 100) -> float:
    """Mean return of the last ``n`` episodes (of all there are, when fewer)."""
    tail = returns[-n:]
    return sum(tail) / len(tail) if tail else float("-inf")


def plot_returns(episodes: list[tuple[float, int, float]], path: str, title: str,
                 reference: float) -> str | None:
    """Write ``path`` (PNG): returns and their 100-episode mean vs env steps and seconds."""
    try:
        os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="mpl-"))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    returns = [e[0] for e in episodes]
    means = [mean_last(returns[:i + 1]) for i in range(len(returns))]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, column, label in ((axes[0], 1, "environment steps"), (axes[1], 2, "seconds")):
        xs = [e[column] for e in episodes]
        ax.plot(xs, returns, ".", alpha=0.3, label="episode return")
        ax.plot(xs, means, "-", label="mean of last 100")
        ax.axhline(reference, color="gray", linestyle="--", label=f"reference {reference:g}")
        ax.set_xlabel(label)
        ax.set_ylabel("return")
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
