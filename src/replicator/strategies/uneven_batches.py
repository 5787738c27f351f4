"""Warn once when a step ran on an uneven batch with a loss not built by
``compute_average_loss`` (a per-replica mean then differs from one device's): the distributed
dataset notes such a batch, ``compute_average_loss`` marks its step, and ``strategy.run``
compares the two at the step's end, with no collective.
"""

from __future__ import annotations

import warnings

from replicator.data import uneven
from replicator.data.uneven import UnevenBatch

_USED = [False]


def note_average_loss() -> None:
    """Called by ``compute_average_loss``: this step's loss is exact on uneven batches."""
    _USED[0] = True


def begin_step() -> UnevenBatch | None:
    """At the start of ``strategy.run``: forget the previous step's mark and take the note of
    the batch handed out last (``None``: it was even)."""
    _USED[0] = False
    return uneven.take()


def check_step(note: UnevenBatch | None, replica_id: int, already_warned: bool) -> bool:
    """At the end of ``strategy.run``: warn when the step ran on the uneven batch ``note``
    without ``compute_average_loss``. Returns whether a warning has now been given (a note
    every replica knows is reported by replica 0 only)."""
    if note is None or already_warned or _USED[0]:
        return already_warned
    if note.known_everywhere and replica_id != 0:
        return True
    warnings.warn(
        f"replica {replica_id}: an uneven batch at {note.describe()}, and this step's loss was "
        "not built with rp.compute_average_loss. A loss averaged on each replica and then "
        "across replicas (DDP's semantics) weighs each replica's samples by 1 / its own size, "
        "so it and its gradients differ from one device's mean over the global batch. HINT: "
        "return `rp.compute_average_loss(per_example_loss, sample_weight=mask)` (per-example "
        "losses, e.g. reduction='none'; `mask` from `dist_dataset.mask` or "
        "InputOptions(with_mask=True)), or drop the short batch with drop_remainder=True. "
        "This warning is given once.", UserWarning, stacklevel=3)
    return True
