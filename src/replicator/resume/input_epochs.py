"""How a backup's loop driver moves an input from epoch to epoch: its length, ``set_epoch``,
and the warning when resuming must replay batches of an input without saved state."""

from __future__ import annotations

import warnings
from typing import Any


def epoch_length(dataset: Any) -> int | None:
    """Batches in one epoch of ``dataset``, or ``None`` for an input without ``len()``."""
    try:
        return len(dataset)
    except TypeError:
        return None


def set_epoch_of(ds: Any, epoch: int) -> None:
    """Tell an input (or its sampler) which epoch starts, when it can be told."""
    if callable(getattr(ds, "set_epoch", None)):
        ds.set_epoch(epoch)
    elif callable(getattr(getattr(ds, "sampler", None), "set_epoch", None)):
        ds.sampler.set_epoch(epoch)


def warn_replay(ds: Any, skip: int) -> None:
    """Warn that resuming replays ``skip`` batches of an input whose order may not repeat."""
    if callable(getattr(ds, "set_epoch", None)) or callable(
            getattr(getattr(ds, "sampler", None), "set_epoch", None)):
        return  # the order depends on the epoch only: replaying it is exact, only slower
    warnings.warn(
        f"the input has no state_dict(); resuming replays {skip} batches of this epoch, which "
        "gives the same samples only if its order does not depend on the random state. HINT: "
        "use strategy.distribute_dataset(...), whose input position is saved exactly.",
        RuntimeWarning, stacklevel=3)
