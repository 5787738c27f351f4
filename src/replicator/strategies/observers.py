"""What ``strategy.run`` does around each step beside the step itself: step observers (how
``replicator bench`` and ``plan`` time steps), the ``check_finite=True`` check and the warning,
once, on an uneven batch without ``compute_average_loss`` (docs/strategies/index.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.data import uneven
from replicator.data.uneven import UnevenBatch
from replicator.errors import NonFiniteLossError
from replicator.strategies.nest import flatten

__all__ = ["StepObserver", "add_step_observer", "called", "run_finished", "run_started"]


class StepObserver:
    """The calls an observer receives (each a no-op here; override what you need)."""

    def run_started(self, strategy: Any, args: tuple) -> tuple:
        """At the start of ``strategy.run``: return the step's arguments (as given, or
        changed: a profile cuts the batch). May raise to stop the loop before the step."""
        return args

    def run_finished(self, strategy: Any) -> None:
        """At the end of ``strategy.run`` (also when the step raised)."""

    def called(self, strategy: Any, name: str) -> None:
        """The loop called ``strategy.<name>`` (``reduce``, ``gather``, ``forward_backward``)."""


_observers: list[StepObserver] = []


def add_step_observer(observer: StepObserver) -> Callable[[], None]:
    """Observe every strategy's steps in this process; returns the function that stops it."""
    if not isinstance(observer, StepObserver):
        raise TypeError(f"add_step_observer needs a StepObserver, got {type(observer).__name__}")
    _observers.append(observer)

    def remove() -> None:
        if observer in _observers:
            _observers.remove(observer)

    return remove


def run_started(strategy: Any, args: tuple) -> tuple:
    for observer in tuple(_observers):
        args = observer.run_started(strategy, args)
    return args


def run_finished(strategy: Any) -> None:
    for observer in tuple(_observers):
        observer.run_finished(strategy)


def called(strategy: Any, name: str) -> None:
    for observer in tuple(_observers):
        observer.called(strategy, name)


# -- checks at the step's end ----------------------------------------------------------------
_USED = [False]


def first_non_finite(value: Any) -> float | None:
    """The first NaN or infinite number among ``value``'s floating-point leaves, or ``None``."""
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


def check_finite_result(value: Any, strategy: Any) -> None:
    """Raise :class:`NonFiniteLossError` on every replica of ``strategy`` when ``value`` is not
    finite on any of them (the replicas agree in one cross-replica max)."""
    bad = first_non_finite(value)
    rank = strategy.replica_id
    flags = torch.zeros(strategy.num_replicas_in_sync, dtype=torch.float32)
    flags[rank] = 1.0 if bad is not None else 0.0
    agreed = strategy._reduce(ReduceOp.MAX, flags)
    found = {i for i, f in enumerate(agreed.tolist()) if f > 0}
    if bad is not None:
        found.add(rank)  # asynchronous workers do not agree: this one knows its own
    if not found:
        return
    where = ", ".join(str(strategy.collectives.global_ranks[i]) for i in sorted(found))
    mine = f" (here: {bad})" if bad is not None else ""
    raise NonFiniteLossError(
        f"strategy.run step {strategy._runs}: step_fn returned a NaN or infinite value on rank(s) "
        f"{where}{mine}; every replica stops here (check_finite=True). The step has already "
        "run: an optimizer update made inside step_fn is applied. HINT: lower the learning "
        "rate, clip gradients, check the input batch of this step, or track the optimizer "
        "with rp.BackupAndRestore, whose guard stops before a non-finite update reaches the "
        "weights.")


def note_average_loss() -> None:
    """Called by ``compute_average_loss``: this step's loss is exact on uneven batches."""
    _USED[0] = True


def begin_step() -> UnevenBatch | None:
    """At ``strategy.run``'s start: forget the last mark; the last batch's note (``None``: even)."""
    _USED[0] = False
    return uneven.take()


def check_step(note: UnevenBatch | None, strategy: Any) -> None:
    """At the end of ``strategy.run``: warn once when the step ran on the uneven batch ``note``
    without ``compute_average_loss`` (a note every replica knows: on replica 0 only)."""
    if note is None or strategy._warned_uneven or _USED[0]:
        return
    strategy._warned_uneven = True
    replica_id = strategy.replica_id
    if note.known_everywhere and replica_id != 0:
        return
    warnings.warn(
        f"replica {replica_id}: an uneven batch at {note.describe()}, and this step's loss was "
        "not built with rp.compute_average_loss. A loss averaged on each replica and then "
        "across replicas (DDP's semantics) weighs each replica's samples by 1 / its own size, "
        "so it and its gradients differ from one device's mean over the global batch. HINT: "
        "return `rp.compute_average_loss(per_example_loss, sample_weight=mask)` (per-example "
        "losses, e.g. reduction='none'; `mask` from `dist_dataset.mask` or "
        "InputOptions(with_mask=True)), or drop the short batch with drop_remainder=True. "
        "This warning is given once.", UserWarning, stacklevel=3)
