"""The model cut into fragments, and when each fragment is exchanged and applied.

Streaming DiLoCo (Douillard et al. 2025) synchronises the model in ``F`` fragments, in turns,
so a round's traffic is spread over the round instead of arriving at once. Each fragment is
still synchronised every ``H`` inner steps; fragment ``f`` is applied at the steps ``t`` with
``t % H == ((f + 1) * H // F) % H`` (``F = 1``: every ``H``-th step), and its exchange starts
``sync_delay`` steps earlier, overlapped with those inner steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split_fragments(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indices of ``params`` in ``fragments`` contiguous groups of about equal size (by
    number of values); every group holds at least one tensor."""
    if fragments > len(params):
        raise ValueError(
            f"fragments={fragments} but the model has only {len(params)} parameter tensor(s); "
            "a fragment is one or more whole tensors. HINT: use fragments <= "
            f"{max(1, len(params))}, or fragments=1 to synchronise the whole model at once")
    n = len(params)
    cumulative = [0]
    for p in params:
        cumulative.append(cumulative[-1] + p.numel())
    total = cumulative[-1]
    bounds = [0]
    for k in range(1, fragments):
        target = min(range(n + 1), key=lambda i: abs(cumulative[i] * fragments - k * total))
        bounds.append(min(max(target, bounds[-1] + 1), n - (fragments - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(fragments)]


class Schedule:
    """Which fragment starts its exchange, and which is applied, after inner step ``t``."""

    def __init__(self, inner_steps: int, fragments: int, sync_delay: int) -> None:
        self.inner_steps = inner_steps
        self.fragments = fragments
        self.sync_delay = sync_delay
        self._apply = [((f + 1) * inner_steps // fragments) % inner_steps
                       for f in range(fragments)]

    def starting(self, step: int) -> list[int]:
        """Fragments whose exchange starts after inner step ``step`` (counted from 1)."""
        return [f for f, offset in enumerate(self._apply)
                if step >= 1 and (step + self.sync_delay) % self.inner_steps == offset]

    def applied(self, step: int) -> list[int]:
        """Fragments whose exchanged update is applied after inner step ``step``."""
        return [f for f, offset in enumerate(self._apply)
                if step > self.sync_delay and step % self.inner_steps == offset]
