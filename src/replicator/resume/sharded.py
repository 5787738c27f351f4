"""Checkpoints under a strategy: which ranks checkpoint together, and sharded saves, with
optimizers pointed at the parameters the strategy replaced (FSDP shards, tensor-parallel
slices, pipeline stages), asked through its public API: the storage room knows no strategy."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import distributed_checkpoint as storage
from replicator.checkpoint.distributed_checkpoint import Optimizers, as_list
from replicator.checkpoint.manager import group_collectives
from replicator.comm.collectives import Collectives
from replicator.strategies.base import Strategy
from replicator.strategies.replica_context import current_strategy

__all__ = ["checkpoint_collectives", "load_sharded", "prepare_optimizers", "save_sharded",
           "sharded_objects"]


def prepare_optimizers(strategy: Strategy | None, optimizers: Iterable[Any]) -> list[Any]:
    """``optimizers`` as a list, pointed by ``strategy`` (if any) at the parameters it made."""
    optimizers = list(optimizers)
    if strategy is not None:
        strategy.prepare_optimizers(*optimizers)
    return optimizers


def sharded_objects(objects: dict[str, Any], strategy: Strategy | None
                    ) -> tuple[str, torch.nn.Module, dict[str, Any]] | None:
    """``(module name, module, {optimizer name: optimizer})`` of ``objects`` when ``strategy``
    splits the model (each rank saves its part), else ``None``."""
    if strategy is None or not strategy.shards_model:
        return None
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    if len(modules) != 1:
        raise ValueError(
            f"under {type(strategy).__name__} the model is split across "
            f"ranks and is backed up sharded, which needs exactly one tracked module; got "
            f"{', '.join(modules) or 'none'}. HINT: track(model=...) the one model "
            "(wrap several in an nn.ModuleDict).")
    (name, module), = modules.items()
    optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    return name, module, optimizers


def checkpoint_collectives(strategy: Strategy | None) -> Collectives:
    """The ranks that checkpoint together: ``strategy``'s replicas when each holds the whole
    model; else every rank of the job (a strategy's collectives span only its data axis)."""
    if strategy is None or strategy.shards_model:
        return group_collectives()
    return strategy.collectives


def save_sharded(directory: str | os.PathLike[str], step: int, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, strategy: Strategy | None = None,
                 keep: int = 2) -> Path | str:
    """Save ``model`` (and ``optimizer``, or a list of them) at ``step`` under ``directory``
    (a path or a URL), each rank its own shards; every rank calls it. ``strategy``: the one
    the model was built under (default: the active one). Returns the committed save; see
    :func:`replicator.checkpoint.distributed_checkpoint.save_sharded`."""
    strategy = strategy if strategy is not None else current_strategy()
    optimizers = prepare_optimizers(strategy, as_list(optimizer))
    return storage.save_sharded(directory, step, model, optimizers,
                                collectives=checkpoint_collectives(strategy), keep=keep)


def load_sharded(directory: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: Optimizers = None, *, step: int | None = None,
                 strategy: Strategy | None = None) -> int | None:
    """Load the newest verified sharded checkpoint (or ``step``) into ``model`` (and
    ``optimizer``), whatever layout saved it; every rank calls it. Returns the step loaded
    (``None``: none); see :func:`replicator.checkpoint.distributed_checkpoint.load_sharded`."""
    strategy = strategy if strategy is not None else current_strategy()
    optimizers = prepare_optimizers(strategy, as_list(optimizer))
    return storage.load_sharded(directory, model, optimizers, step=step,
                                collectives=checkpoint_collectives(strategy))
