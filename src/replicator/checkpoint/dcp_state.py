"""What a sharded (DCP) checkpoint holds and how it is written to and read from a local folder.

A rank's part of the model and optimizers is flattened to ``model.<fqn>`` and
``optim.<fqn>.<key>`` tensors (the shards it holds, by the model's own parameter names), written
by DCP's ``HuggingFaceStorageWriter`` as safetensors (no pickle), with the optimizers' param
groups beside them as JSON. The commit protocols around it (a local folder renamed into place,
or commit objects in a store) are ``distributed_checkpoint.py`` and ``remote_shards.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint.atomic import write_durable
from replicator.checkpoint.exchange import Channel

GROUPS_FILE = "optimizer_groups.json"

#: One optimizer, several (of one model, e.g. one per parameter group), or none.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def as_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _held(t: Any) -> bool:
    """True for a tensor this rank holds (pipeline ranks leave other stages' tensors empty)."""
    if not isinstance(t, torch.Tensor):
        return False
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() > 0


def flat_state(msd: dict[str, Any], osd: dict[str, Any], optimizer: bool
                ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """``model.<fqn>`` and ``optim.<fqn>.<key>`` tensors this rank holds (the same tensor
    objects as in the state dicts); the optimizer's param groups as JSON."""
    flat = {f"model.{k}": v for k, v in msd.items() if _held(v)}
    groups: list[dict[str, Any]] = []
    if optimizer:
        for fqn, state in osd.get("state", {}).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _held(value):
                    flat[f"optim.{fqn}.{key}"] = value
        groups = [{k: v for k, v in g.items() if isinstance(v, (int, float, str, bool, list))
                   or v is None} for g in osd.get("param_groups", [])]
    return flat, groups


class StagedShards:
    """This rank's sharded model and optimizer state copied at a step boundary (see
    :func:`stage_sharded`): what a background sharded save writes while training goes on."""

    def __init__(self, flat: dict[str, Any], groups: list[dict[str, Any]],
                 optimizers: bool) -> None:
        self.flat, self.groups, self.optimizers = flat, groups, optimizers

    @property
    def nbytes(self) -> int:
        return sum(_local(t).numel() * _local(t).element_size() for t in self.flat.values())


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copy(t: Any) -> Any:
    """A CPU copy of ``t``; a DTensor keeps its mesh and placements around a copied shard."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def stage_sharded(model: torch.nn.Module, optimizer: Optimizers = None) -> StagedShards:
    """Copy this rank's part of ``model`` (and ``optimizer``) now, for :func:`write_staged`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = as_list(optimizer)
    msd, osd = get_state_dict(model, optimizers)
    flat, groups = flat_state(msd, osd, bool(optimizers))
    return StagedShards({k: _copy(v) for k, v in flat.items()}, groups, bool(optimizers))


def write_dcp(folder: Path, staged: StagedShards, ch: Channel) -> None:
    """Every rank of ``ch`` writes its shards of ``staged`` into ``folder`` (which exists on
    each rank); the chief adds the optimizers' param groups."""
    import torch.distributed.checkpoint as dcp  # imported when used: about a second

    dcp.save(staged.flat, storage_writer=dcp.HuggingFaceStorageWriter(str(folder),
                                                                      save_distributed=True),
             process_group=ch.collectives.group, no_dist=ch.world_size == 1)
    if ch.is_chief and staged.optimizers:
        write_durable(folder / GROUPS_FILE, json.dumps(staged.groups).encode())


def read_dcp(folder: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             ch: Channel) -> None:
    """Every rank of ``ch`` loads its part of ``model`` and ``optimizers`` from the verified
    save in ``folder``, whatever layout wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizers)
    flat, _ = flat_state(msd, osd, bool(optimizers))
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(folder)),  # in place, into
             process_group=ch.collectives.group,  # the state dicts' own tensors
             no_dist=ch.world_size == 1)
    if optimizers and (folder / GROUPS_FILE).exists():
        groups = json.loads((folder / GROUPS_FILE).read_text())
        targets: list[dict[str, Any]] = list(osd.get("param_groups", []))  # type: ignore[arg-type]
        for saved, group in zip(groups, targets):
            group.update({k: v for k, v in saved.items() if k != "params"})
    set_state_dict(model, optimizers, model_state_dict=msd, optim_state_dict=osd)


__all__ = ["GROUPS_FILE", "Optimizers", "StagedShards", "as_list", "flat_state", "read_dcp",
           "stage_sharded", "write_dcp"]
