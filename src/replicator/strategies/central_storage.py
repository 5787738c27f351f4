"""CentralStorageStrategy: one copy of the optimizer state, on replica 0.

Gradients are *reduced* onto the central replica during ``backward()``; ``optimizer.step()``
updates there once and broadcasts the parameters. Other replicas' optimizers hold no state:
the memory saved over :class:`MirroredStrategy`. The central ``.grad`` is the average (clipping
works there). Closure optimizers (LBFGS) are refused: ranks would run ``backward()`` unequally.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from replicator.cluster.topology import Topology
from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.options import CommunicationOptions
from replicator.errors import ReplicatorError
from replicator.strategies.mirrored import MirroredStrategy


class CentralStorageStrategy(MirroredStrategy):
    """Synchronous data parallelism with the optimizer state on one replica (see module doc);
    ``devices``/``cross_device_ops`` as Mirrored's (its ``reduce_sum_async`` carries gradients).
    """

    name = "central_storage"

    #: The replica that holds the optimizer state and steps.
    central_replica: int = 0

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 communication_options: CommunicationOptions | None = None,
                 mesh: Topology | None = None, axis: str = "data",
                 buffer_sync: str = "mean", sync_batchnorm: bool = False,
                 check_finite: bool = False) -> None:
        super().__init__(devices, cross_device_ops, communication_options=communication_options,
                         mesh=mesh, axis=axis, buffer_sync=buffer_sync,
                         sync_batchnorm=sync_batchnorm, check_finite=check_finite)
        self._kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stashed: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}

    @property
    def is_central(self) -> bool:
        """True on the replica that holds the optimizer state."""
        return self.replica_id == self.central_replica

    # -- state ---------------------------------------------------------------------------------
    def _on_new_state(self, module: torch.nn.Module,
                      params: list[tuple[str, torch.nn.Parameter]],
                      buffers: list[tuple[str, torch.Tensor]]) -> None:
        self._check_same_structure(module, params, buffers)
        self.collectives.broadcast_([t for _, t in [*params, *buffers]],
                                     src=self.central_replica,
                                     what="broadcast of initial parameters from replica 0")
        self._add_synchronizer(module, params, buffers, destination=self.central_replica)

    # -- the optimizer step ----------------------------------------------------------------------
    @staticmethod
    def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        known = self._kinds.get(optimizer)
        params = self._params_of(optimizer)
        if known is not None and known[1] == len(params):
            return known[0]
        mine = [self.is_distributed(p) for p in params]
        if any(mine) and not all(mine):
            raise ReplicatorError(
                f"{type(optimizer).__name__} holds {sum(mine)} parameters created in "
                f"CentralStorageStrategy.scope() and {len(mine) - sum(mine)} created outside "
                "it. HINT: create the whole model inside strategy.scope() (or pass it to "
                "strategy.distribute_model) before building the optimizer.")
        owned = bool(params) and all(mine)
        self._kinds[optimizer] = (owned, len(params))
        return owned

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                               kwargs: Any) -> None:
        super()._before_optimizer_step(optimizer, args, kwargs)
        if self.num_replicas_in_sync == 1 or not self._owns(optimizer):
            return
        positional = [a for a in args if a is not optimizer] if isinstance(args, tuple) else []
        closure = positional[0] if positional else \
            (kwargs.get("closure") if isinstance(kwargs, dict) else None)
        if closure is not None:
            raise ReplicatorError(
                f"{type(optimizer).__name__}.step(closure) cannot run under "
                "CentralStorageStrategy: the closure would run backward() a different number "
                "of times on each replica. HINT: use an optimizer stepped without a closure, "
                "or MirroredStrategy.")
        if self.is_central:
            return
        # not central: hide the gradients so the optimizer neither updates nor creates state
        stash = [(p, p.grad) for p in self._params_of(optimizer)]
        for p, _ in stash:
            p.grad = None
        self._stashed[id(optimizer)] = stash

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.num_replicas_in_sync == 1 or not self._owns(optimizer):
            return
        params = self._params_of(optimizer)
        if not self.is_central:
            for p, grad in self._stashed.pop(id(optimizer), []):
                p.grad = grad
            for p in params:
                optimizer.state.pop(p, None)
        self.collectives.broadcast_(params, src=self.central_replica,
                                     what="broadcast of updated parameters from the central "
                                          "replica")

