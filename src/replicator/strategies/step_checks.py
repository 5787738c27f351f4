"""What ``strategy.run`` checks at a step's end.

``check_finite=True``: every float in the result is checked and the replicas agree in one small
collective, so a NaN on one raises :class:`~replicator.errors.NonFiniteLossError` on all at the
same step (``Trainer.fit`` has its own check; ``rp.BackupAndRestore``'s guard checks before the
update). Uneven batches: warn once when a step ran on one with a loss not built by
``compute_average_loss`` (a per-replica mean then differs from one device's); the distributed
dataset notes such a batch, ``compute_average_loss`` marks its step, with no collective.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.data import uneven
from replicator.data.uneven import UnevenBatch
from replicator.errors import NonFiniteLossError
from replicator.strategies.nest import flatten

_USED = [False]


def first_non_finite(value: Any) -> float | None:
    """The first NaN or infinite number among ``value``'s floating-point leaves (``None``:
    all finite)."""
    leaves, _ = flatten(value)
    for leaf in leaves:
        if isinstance(leaf, float):
            if not math.isfinite(leaf):
                return leaf
        elif isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            bad = ~torch.isfinite(leaf.detach())
            if bool(bad.any()):
                return float(leaf.detach()[bad].reshape(-1)[0].real)
    return None


def check_finite_result(value: Any, step: int, rank: int, world_size: int,
                        global_ranks: Sequence[int],
                        reduce: Callable[[ReduceOp, torch.Tensor], torch.Tensor]) -> None:
    """Raise :class:`NonFiniteLossError` on every replica when ``value`` is not finite on any
    of them. ``reduce`` is the strategy's cross-replica max (one collective); ``rank`` and
    ``world_size`` place this replica in it, ``global_ranks`` name them."""
    bad = first_non_finite(value)
    flags = torch.zeros(world_size, dtype=torch.float32)
    flags[rank] = 1.0 if bad is not None else 0.0
    agreed = reduce(ReduceOp.MAX, flags)
    found = {i for i, f in enumerate(agreed.tolist()) if f > 0}
    if bad is not None:
        found.add(rank)  # asynchronous workers do not agree: this one knows its own
    if not found:
        return
    where = ", ".join(str(global_ranks[i]) for i in sorted(found))
    mine = f" (here: {bad})" if bad is not None else ""
    raise NonFiniteLossError(
        f"strategy.run step {step}: step_fn returned a NaN or infinite value on rank(s) "
        f"{where}{mine}; every replica stops here (check_finite=True). The step has already "
        "run: an optimizer update made inside step_fn is applied. HINT: lower the learning "
        "rate, clip gradients, check the input batch of this step, or track the optimizer "
        "with rp.BackupAndRestore, whose guard stops before a non-finite update reaches the "
        "weights.")


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
