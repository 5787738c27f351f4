"""What the rl examples share: training to a reference return, and a plot of episode return
against environment steps and wall time."""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from typing import Any


def mean_last(returns: list[float], n: int = 100) -> float:
    """Mean return of the last ``n`` episodes (of all there are, when fewer)."""
    tail = returns[-n:]
    return sum(tail) / len(tail) if tail else float("-inf")


def running_means(returns: list[float], n: int = 100) -> list[float]:
    """The mean of the last ``n`` returns at every episode, in one pass (a run at many
    thousand episodes a minute must not wait minutes for its plot)."""
    means, total = [], 0.0
    for i, value in enumerate(returns):
        total += value - (returns[i - n] if i >= n else 0.0)
        means.append(total / min(i + 1, n))
    return means


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
    means = running_means(returns)
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


def train_to_reference(al: Any, step_fn: Any, batches: Iterable[Any], *, reference: float,
                       seconds: float, plot: str, title: str) -> dict:
    """Run ``step_fn`` on the learner's ``batches`` until the mean return of the last 100
    episodes reaches ``reference`` or ``seconds`` pass; the figures and, on the chief, the plot."""
    start = time.monotonic()
    last: deque[float] = deque(maxlen=100)
    seen = 0
    with al:
        for batch in batches:
            al.strategy.run(step_fn, args=(batch,))
            new = al.episodes(seen)
            seen += len(new)
            last.extend(e[0] for e in new)
            if seen >= 100 and sum(last) / len(last) >= reference:
                break
            if time.monotonic() - start > seconds:
                break
        elapsed = time.monotonic() - start
        stats = al.stats()
        episodes = al.episodes()
    returns = [e[0] for e in episodes]
    result = {"mean_return_last_100": round(mean_last(returns), 1), "episodes": len(returns),
              "env_steps": stats["env_steps"], "learner_steps": stats["learner_steps"],
              "seconds": round(elapsed, 1), "max_policy_lag": stats["max_policy_lag"],
              "median_policy_lag": stats["median_policy_lag"],
              "reached": len(returns) >= 100 and mean_last(returns) >= reference}
    if al.strategy.is_chief:
        result["plot"] = plot_returns(episodes, plot, title, reference)
        print(result, flush=True)
    return result
