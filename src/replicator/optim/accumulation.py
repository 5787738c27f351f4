"""Gradient accumulation: ``k`` micro-batches make the gradient of one ``k``-times batch. The
first ``k - 1`` backward passes of a cycle run inside ``strategy.no_sync()``, the ``k``-th
synchronises the sum, and each loss is divided by ``k``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch


class GradientAccumulator:
    """Counts micro-batches for ``strategy.accumulate(k)``; use it once per micro-batch::

        accum = strategy.accumulate(4)
        def step_fn(batch):
            with accum:                                   # no_sync() except every 4th time
                accum.backward(F.cross_entropy(model(x), y))      # backward of loss / 4
            accum.step(optimizer)                         # steps and zeroes on the 4th only
    """

    def __init__(self, k: int, no_sync: Callable[[], contextlib.AbstractContextManager[Any]]
                 ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"accumulate(k): k must be an int >= 1, got {k!r}. HINT: k is the "
                             "number of micro-batches whose gradients make one step")
        self.k, self._no_sync = k, no_sync
        self._count, self._ready = 0, False  # micro-batches entered in the current cycle
        self._inside: contextlib.AbstractContextManager[Any] | None = None

    @property
    def micro_step(self) -> int:
        """Index of the current (or next) micro-batch in its cycle, 0 to ``k - 1``."""
        return self._count % self.k

    @property
    def synchronizes(self) -> bool:
        """True if the current (or next) micro-batch is the cycle's last, the one that
        synchronises gradients across replicas."""
        return self._count % self.k == self.k - 1

    @property
    def ready(self) -> bool:
        """True right after the ``k``-th micro-batch of a cycle: step the optimizer now."""
        return self._ready

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / k``: the share of one micro-batch in the mean over the whole cycle."""
        return loss / self.k

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss / k).backward(**kwargs)``."""
        self.scale(loss).backward(**kwargs)

    def __enter__(self) -> GradientAccumulator:
        if self._inside is not None:
            raise RuntimeError("GradientAccumulator entered twice without leaving. HINT: use "
                               "`with accum:` once per micro-batch, not nested")
        self._ready = False
        self._inside = contextlib.nullcontext() if self.synchronizes else self._no_sync()
        self._inside.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        inside, self._inside = self._inside, None
        if inside is None:
            raise RuntimeError("GradientAccumulator left without being entered. HINT: use it "
                               "as `with accum:` around each micro-batch's backward")
        inside.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return  # the cycle's count stays where it was: the failed micro-batch is not counted
        self._count += 1
        self._ready = self._count % self.k == 0

    def step(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> bool:
        """Step and zero ``optimizer`` if :attr:`ready`; returns whether it stepped."""
        if not self._ready:
            return False
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        self._ready = False
        return True

    def reset(self) -> None:
        """Start a new cycle (after an epoch whose length ``k`` does not divide; zero the
        optimizer's gradients too, or they carry into the next cycle)."""
        self._count, self._ready = 0, False
