"""Sharded checkpoints of model-parallel runs through ``torch.distributed.checkpoint`` (DCP),
each rank's shards as safetensors by the model's own names (DCP's pickled ``.metadata`` is
refused), so a save in one layout loads into any other.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint.atomic import write_durable
from replicator.checkpoint.manager import (
    Channel,
    commit_agreed,
    describe_failures,
    group_collectives,
)
from replicator.checkpoint.manifest import FileEntry
from replicator.checkpoint.storage import LocalStorage, open_storage
from replicator.checkpoint.store import RemoteStore
from replicator.comm.collectives import Collectives
from replicator.errors import CheckpointCorruptError, CheckpointWriteError

GROUPS_FILE = "optimizer_groups.json"

#: One optimizer, several (of one model, e.g. one per parameter group), or none.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
#: A local folder, a URL, or an opened storage (a URL with its fsspec options).
Location = str | os.PathLike[str] | RemoteStore | LocalStorage


def as_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])


def flat_state(msd: dict[str, Any], osd: dict[str, Any], optimizer: bool
               ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """``model.<fqn>`` and ``optim.<fqn>.<key>`` tensors this rank holds (the state dicts'
    own, not other pipeline stages' empty ones) and the optimizers' param groups as JSON."""
    def held(t: Any) -> bool:  # a DTensor's local shard
        return isinstance(t, torch.Tensor) and (
            t.to_local() if hasattr(t, "to_local") else t).numel() > 0

    flat = {f"model.{k}": v for k, v in msd.items() if held(v)}
    groups: list[dict[str, Any]] = []
    if optimizer:
        for fqn, state in osd.get("state", {}).items():
            for key, value in state.items():
                if held(value):
                    flat[f"optim.{fqn}.{key}"] = value
        groups = [{k: v for k, v in g.items() if isinstance(v, (int, float, str, bool, list))
                   or v is None} for g in osd.get("param_groups", [])]
    return flat, groups


@dataclass
class StagedShards:
    """This rank's sharded model and optimizer state at a step boundary: what a sharded save
    writes, in place or in the background."""

    flat: dict[str, Any]
    groups: list[dict[str, Any]]
    optimizers: bool


def _copy(t: Any) -> Any:
    """A CPU copy of ``t``; a DTensor keeps its mesh and placements around a copied shard."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _shards(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
            copy: bool) -> StagedShards:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizers)
    flat, groups = flat_state(msd, osd, bool(optimizers))
    if copy:
        flat = {k: _copy(v) for k, v in flat.items()}
    return StagedShards(flat, groups, bool(optimizers))


def stage_sharded(model: torch.nn.Module, optimizer: Optimizers = None) -> StagedShards:
    """Copy this rank's part of ``model`` (and ``optimizer``) now, for :func:`write_staged`."""
    return _shards(model, as_list(optimizer), copy=True)


def save_sharded(directory: Location, step: int, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, collectives: Collectives | None = None,
                 keep: int = 2) -> Path | str:
    """Save ``model`` (and ``optimizer``, or a list of them, already holding the model's sharded
    parameters: under a strategy use :func:`replicator.resume.save_sharded`) at ``step`` under
    ``directory``; every rank of ``collectives`` (default: the whole job) calls it. Returns the
    committed save; :class:`CheckpointWriteError` on every rank when any rank fails."""
    ch = Channel(collectives if collectives is not None else group_collectives())
    try:
        staged: StagedShards | Exception = _shards(model, as_list(optimizer), copy=False)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks in write_staged
        staged = exc
    return write_staged(directory, step, staged, ch, keep=keep)


def _write_dcp(folder: Path, staged: StagedShards, ch: Channel) -> None:
    import torch.distributed.checkpoint as dcp  # imported when used: about a second

    dcp.save(staged.flat, storage_writer=dcp.HuggingFaceStorageWriter(str(folder),
                                                                      save_distributed=True),
             process_group=ch.collectives.group, no_dist=ch.world_size == 1)
    if ch.is_chief and staged.optimizers:
        write_durable(folder / GROUPS_FILE, [json.dumps(staged.groups).encode()])


def write_staged(directory: Location, step: int, staged: StagedShards | Exception,
                 ch: Channel, *, keep: int = 2) -> Path | str:
    """Write and commit ``staged`` (from :func:`stage_sharded`) as ``step``; every rank of
    ``ch`` calls it (on a background thread, ``ch`` runs over a private group)."""
    storage = open_storage(directory, what="the sharded checkpoint location")
    token = ch.from_chief(uuid.uuid4().hex[:12] if ch.is_chief else None,
                          f"sharded save of step {step} (its name)")
    staging = storage.staging(step, token)
    entries: dict[str, FileEntry] = {}
    local_exc: Exception | None = None
    try:
        if isinstance(staged, Exception):
            raise staged
        storage.begin(staging)
        folder = storage.folder(staging)
        _write_dcp(folder, staged, ch)
        entries = storage.publish(staging, folder, ch.rank)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
        local_exc = OSError(f"{type(exc).__name__}: {exc}")

    def error(failures: dict[int, str], cause: BaseException | None) -> Exception:
        return CheckpointWriteError(
            f"saving the sharded checkpoint of step {step} to {storage.location} failed "
            f"({describe_failures(failures)}). Nothing was committed. HINT: check that every "
            f"rank can write to {storage.location} and has space there.")

    ref = commit_agreed(storage, ch, step, staging, entries, local_exc,
                        {"layout": "dcp-safetensors"}, keep, error)
    return storage.where(ref)  # type: ignore[no-any-return]


def _read_dcp(folder: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
              ch: Channel) -> None:
    """Every rank loads its part of ``model`` and ``optimizers`` from the save in ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizers)
    flat, _ = flat_state(msd, osd, bool(optimizers))
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(folder)),
             process_group=ch.collectives.group, no_dist=ch.world_size == 1)
    if optimizers and (folder / GROUPS_FILE).exists():
        groups = json.loads((folder / GROUPS_FILE).read_text())
        targets: list[dict[str, Any]] = list(osd.get("param_groups", []))  # type: ignore[arg-type]
        for saved, group in zip(groups, targets):
            group.update({k: v for k, v in saved.items() if k != "params"})
    set_state_dict(model, optimizers, model_state_dict=msd, optim_state_dict=osd)


def load_sharded(directory: Location, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, step: int | None = None,
                 collectives: Collectives | None = None) -> int | None:
    """Load the newest verified checkpoint (or ``step``) into ``model`` (and ``optimizer``,
    holding the model's sharded parameters), whatever its layout; every rank of
    ``collectives`` (default: the whole job) calls it. Returns the step loaded (``None``: no
    checkpoint); damaged saves are skipped with a warning, :class:`CheckpointCorruptError`
    when none verifies."""
    optimizers = as_list(optimizer)
    ch = Channel(collectives if collectives is not None else group_collectives())
    storage = open_storage(directory, what="the sharded checkpoint location")
    listed: list[list[Any]] | None = None
    if ch.is_chief:  # the committed saves (of ``step``)
        steps = set(storage.committed())
        listed = [[s, ref] for s, ref in storage.saves() if s in steps and step in (None, s)]
    listed = ch.from_chief(listed, "sharded checkpoint restore (listing)")
    if not listed and step is None:
        return None
    skipped: list[str] = []
    local = isinstance(storage, LocalStorage)
    for saved_step, ref in reversed(listed):
        error, folder = "", None
        try:
            if ch.is_chief or not local:  # a local folder is verified once, by the chief
                folder = storage.fetch_all(ref)
        except CheckpointCorruptError as exc:
            error = str(exc)
        try:
            errors = ch.failures(error, "sharded checkpoint restore (verify)")
            if errors:
                skipped.append(errors[min(errors)])
                continue
            for text in skipped:
                warnings.warn(f"skipping a damaged checkpoint: {text}", RuntimeWarning,
                              stacklevel=2)
            _read_dcp(folder or storage.where(ref), model, optimizers, ch)
            return int(saved_step)
        finally:
            if folder is not None and not local:
                shutil.rmtree(folder, ignore_errors=True)
    raise CheckpointCorruptError(
        f"no valid sharded checkpoint to load in {storage.location}: "
        f"{'; '.join(skipped) or f'no committed checkpoint of step {step}'}. HINT: delete the "
        "damaged saves, or load an older step=.")


def discard_uncommitted(directory: Location, after: int | None = None) -> None:
    """Remove interrupted saves and, with ``after``, every save newer than ``after`` (a run
    resumed from ``after`` writes them again). The chief calls it while no save runs."""
    open_storage(directory, what="the sharded checkpoint location").cleanup(after)


__all__ = ["GROUPS_FILE", "Location", "Optimizers", "StagedShards", "as_list",
           "discard_uncommitted", "flat_state", "load_sharded", "save_sharded",
           "stage_sharded", "write_staged"]
