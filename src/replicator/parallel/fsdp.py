"""Fully sharded data parallelism (ZeRO-3) with FSDP2 ``fully_shard``, over a ``DeviceMesh``:
each replica keeps ``1/N`` of parameters, gradients and optimizer state; a block's parameters
are gathered before it runs and freed after, gradients reduce-scattered in backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks sharded one by one: every child of a ``ModuleList``/``Sequential`` that
    holds parameters (a transformer's layers, an MLP's Linear layers), innermost lists
    first; the root (``module``) takes whatever parameters are left."""
    units = {id(c): c for sub in module.modules()
             if isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential))
             for c in sub.children() if c is not module and any(True for _ in c.parameters())}
    # a block inside another block: shard the inner one first (fully_shard order: bottom-up)
    return sorted(units.values(), key=lambda m: sum(1 for _ in m.modules()))


def apply_fsdp(module: torch.nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True
               ) -> torch.nn.Module:
    """Shard ``module`` over ``mesh`` (1-D: FSDP; 2-D ``(data, fsdp)``: hybrid, replicated
    across the first dimension and sharded across the second), block by block, then the
    root. Returns the same module (its class becomes ``FSDP<Class>``)."""
    from torch.distributed.fsdp import fully_shard  # imported when used: it imports DTensor

    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return module


def _param_groups(state: object) -> list:
    """An FSDP2 state's parameter groups: a list in torch 2.13, one group (or
    ``None``) named ``_fsdp_param_group`` in 2.11 (where FSDP failed before this)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def is_unsharded_view(module: torch.nn.Module, tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is the gathered (unsharded) parameter FSDP2 put in place of one of
    ``module``'s sharded parameters while a block runs."""
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in _param_groups(get_state()):
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "_unsharded_param", None) is tensor:
                    return True
    return False
