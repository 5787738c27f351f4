"""Which batch was uneven across replicas: the note a distributed dataset leaves for the step.

With a short last global batch of ``L`` rows over ``N`` replicas that ``N`` does not divide
(or padded with masked rows), replicas hold different numbers of real samples. A loss
averaged per replica and then across replicas (DDP's semantics, and what a plain
``F.cross_entropy(...)`` gives) then weighs each replica's samples by ``1 / its own size``,
not ``1 / L`` as one device does. ``rp.compute_average_loss`` is exact.

The dataset knows this without any communication: a global batch is split by a fixed rule
(:func:`~replicator.data.batching.slice_bounds`), so every replica knows every replica's size;
an ``input_fn`` pipeline knows its own short or padded batch. Each batch handed out replaces
the note (:func:`record`), and the strategy takes it at the start of ``strategy.run``
(:func:`take`).
"""

from __future__ import annotations

from dataclasses import dataclass

from replicator.data.batching import LocalBatch, slice_bounds


@dataclass(frozen=True)
class UnevenBatch:
    """A batch whose replicas hold different numbers of real samples (or padding)."""

    epoch: int
    step: int            # 1-based, within the epoch
    replica: int         # this replica
    rows: int            # rows of this replica's batch (real + padding)
    real: int            # its real samples
    sizes: tuple[int, ...] | None  # every replica's real samples (None: per-replica input)
    length: int          # rows of the global batch (0: not known)
    known_everywhere: bool  # every replica knows it (a split global batch)

    def describe(self) -> str:
        if self.sizes is not None:
            where = (f"the global batch of {self.length} samples is split "
                     f"{' + '.join(str(s) for s in self.sizes)} over the replicas")
        else:
            where = f"this replica's batch has {self.real} real samples"
        if self.rows > self.real:
            where += f" (replica {self.replica}: {self.rows - self.real} of its {self.rows} rows " \
                     "are masked padding)"
        return f"step {self.step} of epoch {self.epoch}: {where}"


_LAST: list[UnevenBatch] = []


def check(item: LocalBatch, rank: int, world: int, epoch: int, step: int) -> UnevenBatch | None:
    """The note for ``item`` (this replica's batch at ``step``), or ``None`` when every
    replica holds the same number of real samples and no padding."""
    if world <= 1:
        return None
    rows = int(item.mask.numel()) if not isinstance(item.mask, int) else int(item.mask)
    if item.length > 0:
        sizes = tuple(b - a for a, b in (slice_bounds(item.length, r, world)
                                          for r in range(world)))
        if len(set(sizes)) == 1 and rows == item.real:
            return None
        return UnevenBatch(epoch, step, rank, rows, item.real, sizes, item.length, True)
    if item.full and rows == item.real:
        return None
    return UnevenBatch(epoch, step, rank, rows, item.real, None, 0, False)


def record(note: UnevenBatch | None) -> None:
    """The note of the batch just handed out (``None``: an even one)."""
    _LAST[:] = [] if note is None else [note]


def take() -> UnevenBatch | None:
    """The note of the last batch handed out, once."""
    return _LAST.pop() if _LAST else None
