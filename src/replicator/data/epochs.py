"""``distribute_dataset(..., epochs=E)``: one loop over ``E`` epochs, counted by the library.

A process that joins a running job mid-way (a replica group healed from a live peer) learns the
committed step, hence the epoch, but not the script's own loop counters; a loop the library
counts is right in every process. Without replica groups this is plain iteration over the
distributed dataset's epochs, resumable through its ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Epochs:
    """Iterate ``dataset`` (a distributed dataset, a cursor over epochs) until ``epochs``
    epochs are done; a dataset restored mid-epoch continues there."""

    def __init__(self, dataset: Any, epochs: int) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        self.dataset = dataset
        self.epochs = epochs

    def __iter__(self) -> Iterator[Any]:
        while self.dataset.epoch < self.epochs:
            before = self.dataset.epoch
            yield from self.dataset
            if self.dataset.epoch == before:  # a pass that did not finish its epoch
                return

    def __len__(self) -> int:
        return len(self.dataset) * self.epochs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"Epochs({self.dataset!r}, epochs={self.epochs})"
