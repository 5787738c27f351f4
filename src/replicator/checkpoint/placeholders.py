"""Placeholders: empty stand-ins for state another rank holds, which must never be saved.

A pipeline rank frees the parameters of the stages other ranks run; its ``model.state_dict()``
then holds a 0-element :class:`Placeholder` for each of them (the strategy marks them), so a
file written from one rank's state dict cannot silently miss most of the model:

- the library's own save paths (safetensors files, ``CheckpointManager`` and so
  ``BackupAndRestore``, ``ModelCheckpoint``) refuse a state with placeholders, naming
  ``strategy.full_state_dict(model)``, which gathers the whole model on the chief;
- ``torch.save`` of a placeholder warns (the tensor's own pickling hook, no change to torch);
  a file written anyway does not load with ``torch.load(weights_only=True)`` (the placeholder
  class is not an allowed global) and its shapes do not match the one-device model.
  ``safetensors.torch.save_file`` cannot be hooked and writes 0-element tensors: use
  ``full_state_dict`` there too.

Operations on a placeholder keep the marker (``.cpu()``, ``.clone()``, ``.detach()``), and
loading a state dict with placeholders into the same split model copies nothing, as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from replicator.errors import CheckpointError

FIX = ("HINT: call `state = strategy.full_state_dict(model)` on every rank (a collective: it "
       "gathers the stages on the chief) and save `state` on the chief; sharded checkpoints "
       "(rp.BackupAndRestore, replicator.resume.save_sharded) save each rank's part")


class Placeholder(torch.Tensor):
    """A 0-element tensor standing for a parameter or buffer held by another rank."""

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save pickles tensors through this
        warnings.warn(
            "torch.save of a placeholder: this state dict holds a 0-element stand-in for a "
            "tensor another rank holds (a pipeline stage's parameter), so the file does not "
            f"hold the model and will not load into the one-device model. {FIX}.",
            UserWarning, stacklevel=2)
        return super().__reduce_ex__(proto)


def placeholder(like: torch.Tensor) -> Placeholder:
    """A placeholder with ``like``'s dtype and device (and 0 elements)."""
    empty = torch.empty(0, dtype=like.dtype, device=like.device)
    return torch.Tensor._make_subclass(Placeholder, empty)  # type: ignore[return-value]


def find_placeholders(state: Any, prefix: str = "") -> list[str]:
    """The keys (dotted, through nested dicts and lists) of the placeholders in ``state``."""
    if isinstance(state, Placeholder):
        return [prefix or "(value)"]
    found: list[str] = []
    if isinstance(state, Mapping):
        for key, value in state.items():
            found += find_placeholders(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        for i, value in enumerate(state):
            found += find_placeholders(value, f"{prefix}.{i}" if prefix else str(i))
    return found


def refuse_placeholders(state: Any, where: str) -> None:
    """Raise :class:`~replicator.errors.CheckpointError` when ``state`` holds placeholders:
    ``where`` (e.g. ``"ModelCheckpoint"``) would save a part of the model as if it were all."""
    found = find_placeholders(state)
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise CheckpointError(
        f"{where}: the state holds {len(found)} placeholder(s) ({shown}): tensors this rank "
        "does not hold (other pipeline stages), so the file would not hold the model and "
        f"would not load into the one-device model. {FIX}.")
