"""The policy lag of received experience (learner steps since the weights that made it), kept
the same way wherever experience arrives: from actor processes or from the learner's own
environments."""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["PolicyLags"]

#: Policy lags kept for the median (the maximum is kept over the whole run).
LAGS_KEPT = 10_000


class PolicyLags:
    """The last ``LAGS_KEPT`` lags for the median, and the largest of the whole run."""

    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=LAGS_KEPT)
        self.max = 0

    def add(self, lag: int) -> None:
        self._recent.append(lag)
        self.max = max(self.max, lag)

    def median(self) -> float:
        return statistics.median(self._recent) if self._recent else 0

    def figures(self) -> dict[str, float]:
        """The lags as the learner's ``stats()`` report them."""
        return {"max_policy_lag": self.max, "median_policy_lag": self.median()}
