"""``check_finite=True``: ``strategy.run`` stops every replica on a NaN or infinite result.

Every float in the returned value is checked and the replicas agree in one small collective, so
a NaN on one raises :class:`~replicator.errors.NonFiniteLossError` on all at the same step
(``Trainer.fit`` has its own check; ``rp.BackupAndRestore``'s guard checks before the update).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.errors import NonFiniteLossError
from replicator.strategies.nest import flatten


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
