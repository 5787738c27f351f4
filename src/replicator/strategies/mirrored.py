"""MirroredStrategy: synchronous data parallelism, one process per replica (SPMD), with
``MultiWorkerMirroredStrategy`` (across machines), ``CentralStorageStrategy`` (one copy of the
optimizer state) and the global-batch BatchNorm of ``sync_batchnorm=True``
(docs/strategies/mirrored.md).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from functools import cached_property
from itertools import zip_longest
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from replicator.cluster.devices import default_device_for, parse_devices
from replicator.cluster.environment import resolve_cluster, use_cluster
from replicator.cluster.ports import choose_gloo_interface
from replicator.cluster.resolvers import ClusterResolver, as_spec
from replicator.cluster.topology import Topology
from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.gradient_sync import BUFFER_SYNC_MODES, DEFAULT_BUCKET_BYTES
from replicator.comm.options import CommunicationOptions
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.selection import algorithm_for
from replicator.errors import ClusterConfigError, ReplicaMismatchError, ReplicatorError
from replicator.strategies.base import Strategy
from replicator.strategies.replicas import ReplicaGroup
from replicator.strategies.scope_capture import describe_state, named_state


class MirroredStrategy(Strategy):
    """Synchronous data parallel training on the replicas of this job.

    ``devices``: one per local process (``None``: a GPU each if enough, else the CPU);
    ``cross_device_ops``: the gradient all-reduce; ``mesh``/``axis``: replicate along a
    topology axis; ``buffer_sync``: ``"mean"``, ``"broadcast"`` or ``"none"``;
    ``sync_batchnorm=True``: global-batch BatchNorm; ``check_finite``: see ``Strategy``.
    """

    name = "mirrored"
    _guards_undistributed = True
    _supports_live = True

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 communication_options: CommunicationOptions | None = None,
                 mesh: Topology | None = None, axis: str = "data",
                 buffer_sync: str = "mean", sync_batchnorm: bool = False,
                 check_finite: bool = False) -> None:
        spec = resolve_cluster()
        parsed = parse_devices(devices)
        if parsed is not None:
            if parsed[0].type == "cpu" and len(parsed) == 1:
                parsed = parsed * spec.local_world_size
            if len(parsed) != spec.local_world_size:
                raise ClusterConfigError(
                    f"{type(self).__name__} was given {len(parsed)} devices "
                    f"({', '.join(map(str, parsed))}) but this machine runs "
                    f"{spec.local_world_size} replica process(es). HINT: launch one process per "
                    f"device: `replicator run --nproc {len(parsed)} script.py`, or "
                    f"rp.launch(fn, num_replicas={len(parsed)}).")
            device = parsed[spec.local_rank]
        else:
            device = default_device_for(spec.local_rank, spec.local_world_size)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps such as "
                            f"rp.comm.NativeAllReduce(), got {type(cross_device_ops).__name__}")
        if communication_options is not None and \
                not isinstance(communication_options, CommunicationOptions):
            raise TypeError(f"communication_options must be rp.CommunicationOptions(...), got "
                            f"{type(communication_options).__name__}")
        if buffer_sync not in BUFFER_SYNC_MODES:
            raise ValueError(f"buffer_sync must be one of {', '.join(BUFFER_SYNC_MODES)}, got "
                             f"{buffer_sync!r}")
        if mesh is not None and not isinstance(mesh, Topology):
            raise TypeError(f"mesh must be an rp.cluster.Topology, got {type(mesh).__name__}")
        self._buffer_sync = buffer_sync
        self._sync_batchnorm = bool(sync_batchnorm)
        self._options = communication_options or CommunicationOptions()
        if cross_device_ops is not None and self._options.implementation != "auto":
            raise ValueError(
                f"both cross_device_ops={cross_device_ops!r} and CommunicationOptions("
                f"implementation={self._options.implementation!r}) choose the all-reduce "
                "algorithm. HINT: give only one of them.")
        self._replica_group = ReplicaGroup(device, mesh, axis if mesh is not None else None,
                                           timeout_seconds=self._options.timeout_seconds)
        self._replica_group.use_algorithm(
            cross_device_ops or algorithm_for(self._options, device, self._replica_group.group))
        super().__init__(check_finite=check_finite)

    # -- identity ------------------------------------------------------------------------------
    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._replica_group.algorithm

    @property
    def mesh(self) -> Topology | None:
        """The topology this strategy replicates along (``None``: the whole job)."""
        return self._replica_group.topology

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the replicas (``None``: the default group)."""
        return self._replica_group.group

    @property
    def _reduce_to(self) -> int | None:
        """The replica gradients are reduced onto (``None``: averaged on every replica)."""
        return None

    # -- state ---------------------------------------------------------------------------------
    def _setup_module(self, module: torch.nn.Module) -> None:
        """Check the replicas built the same, broadcast replica 0's values of the new parameters
        and buffers, add gradient sync."""
        if self._sync_batchnorm:
            convert_batchnorm(module, self.group)
        params, buffers = named_state(module)
        params = [(n, p) for n, p in params if p not in self._distributed]
        buffers = [(n, b) for n, b in buffers if b not in self._distributed]
        if not params and not buffers and self.num_replicas_in_sync == 1:
            return
        self._check_same_structure(module, params, buffers)
        self.collectives.broadcast_([t for _, t in [*params, *buffers]], src=self._reduce_to or 0,
                                    what="broadcast of initial parameters from replica 0")
        self._replica_group.synchronize_gradients(
            module, [p for _, p in params], [b for _, b in buffers], destination=self._reduce_to,
            bucket_bytes=self._options.bytes_per_pack or DEFAULT_BUCKET_BYTES,
            buffer_sync=self._buffer_sync, check=self._options.check_collectives)

    def _check_same_structure(self, module: torch.nn.Module,
                              params: list[tuple[str, torch.nn.Parameter]],
                              buffers: list[tuple[str, torch.Tensor]]) -> None:
        desc = describe_state(params, buffers)
        digest = hashlib.sha256("\n".join(desc).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        low = self.collectives.all_reduce(mine, ReduceOp.MIN, "model structure check")
        high = self.collectives.all_reduce(mine, ReduceOp.MAX, "model structure check")
        if bool(low == high):
            return
        texts = self.collectives.all_gather_bytes(json.dumps(desc).encode(),
                                                   "model structure exchange")
        descs = [json.loads(t) for t in texts]
        first = next(("; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
                      for entries in zip_longest(*descs, fillvalue="(missing)")
                      if len(set(entries)) > 1), "(no entry differs)")
        counts = ", ".join(f"rank {r}: {sum(e.startswith('parameter') for e in d)} parameters"
                           for r, d in enumerate(descs))
        raise ReplicaMismatchError(
            f"the replicas built different models in scope() ({type(module).__name__}; "
            f"{counts}). First difference: {first}. HINT: every replica must "
            "create the same modules in the same order; look for code that depends on the rank "
            "or on local data.")


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy across several machines (``replicator run --nnodes``, ``torchrun``,
    ``TF_CONFIG``, SLURM, or an explicit ``rp.cluster.ClusterSpec``), the same engine under
    tf.distribute's name. ``cluster_resolver``: a ``ClusterSpec`` or a resolver such as
    :class:`~replicator.cluster.TFConfigResolver` (``None``: the environment). A first argument
    that is ``CommunicationOptions`` or an all-reduce algorithm is taken as such.
    """

    name = "multi_worker_mirrored"

    def __init__(self, cluster_resolver: ClusterResolver | CommunicationOptions | CrossDeviceOps
                 | None = None,
                 communication_options: CommunicationOptions | CrossDeviceOps | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 mesh: Topology | None = None, axis: str = "data",
                 buffer_sync: str = "mean", sync_batchnorm: bool = False,
                 check_finite: bool = False) -> None:
        if isinstance(cluster_resolver, (CommunicationOptions, CrossDeviceOps)):
            if communication_options is not None:
                raise TypeError("MultiWorkerMirroredStrategy got communication options twice. "
                                "HINT: pass cluster_resolver=..., communication_options=...")
            cluster_resolver, communication_options = None, cluster_resolver
        if isinstance(communication_options, CrossDeviceOps):
            if cross_device_ops is not None:
                raise TypeError("MultiWorkerMirroredStrategy got two all-reduce algorithms "
                                f"({communication_options!r} and {cross_device_ops!r}). HINT: "
                                "pass one, as cross_device_ops=...")
            communication_options, cross_device_ops = None, communication_options
        if cluster_resolver is not None:
            if not isinstance(cluster_resolver, ClusterResolver):
                raise TypeError(
                    f"MultiWorkerMirroredStrategy's first argument must be a cluster resolver "
                    f"(rp.cluster.ClusterSpec, rp.cluster.TFConfigResolver()), "
                    f"rp.CommunicationOptions(...) or an all-reduce algorithm, got "
                    f"{type(cluster_resolver).__name__}")
            spec = as_spec(cluster_resolver)
            if dist.is_initialized() and (dist.get_world_size(), dist.get_rank()) != \
                    (spec.world_size, spec.rank):
                raise ClusterConfigError(
                    f"the cluster resolver says rank {spec.rank} of {spec.world_size}, but this "
                    f"process is already rank {dist.get_rank()} of {dist.get_world_size()} in a "
                    "running process group. HINT: create MultiWorkerMirroredStrategy before any "
                    "other strategy, or drop cluster_resolver.")
            use_cluster(spec)
        if not dist.is_initialized():
            spec = resolve_cluster()
            if spec.world_size > 1:
                choose_gloo_interface(spec.master_addr)
        super().__init__(devices=None, cross_device_ops=cross_device_ops,
                         communication_options=communication_options, mesh=mesh, axis=axis,
                         buffer_sync=buffer_sync, sync_batchnorm=sync_batchnorm,
                         check_finite=check_finite)


class CentralStorageStrategy(MirroredStrategy):
    """Synchronous data parallelism with one copy of the optimizer state, on replica 0:
    gradients are reduced there in ``backward()``, ``optimizer.step()`` updates there once and
    broadcasts the parameters (docs/strategies/central_storage.md). Arguments as Mirrored's;
    closure optimizers (LBFGS) are refused.
    """

    name = "central_storage"
    #: The replica that holds the optimizer state and steps.
    central_replica: int = 0

    @cached_property
    def _kinds(self) -> weakref.WeakKeyDictionary:
        """Optimizer -> (whether it steps this strategy's parameters, how many it holds)."""
        return weakref.WeakKeyDictionary()

    @cached_property
    def _stashed(self) -> dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """The gradients hidden from a non-central replica's optimizer during its step."""
        return {}

    @property
    def is_central(self) -> bool:
        """True on the replica that holds the optimizer state."""
        return self.replica_id == self.central_replica

    @property
    def _reduce_to(self) -> int | None:
        return self.central_replica

    # -- the optimizer step ----------------------------------------------------------------------
    @staticmethod
    def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())

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


# -- BatchNorm over the global batch ---------------------------------------------------------
_CLASSES: dict[type, type] = {}


class _CrossReplicaMixin:
    """The forward of a BatchNorm layer normalising with statistics over every replica: the
    per-channel sums and counts in one differentiable all-reduce (float64 sums)."""

    replica_group: dist.ProcessGroup | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        bn: Any = self
        bn._check_input_dim(x)
        group = self.replica_group
        if not (bn.training and dist.is_initialized() and dist.get_world_size(group) > 1):
            return super().forward(x)  # type: ignore[misc]
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           x.new_full((1,), x.numel() // max(channels, 1))])
        total = dist_nn.all_reduce(local.to(torch.float64), group=group)
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        if bn.track_running_stats and bn.running_mean is not None:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
                momentum = bn.momentum if bn.momentum is not None else \
                    1.0 / float(bn.num_batches_tracked)
                unbiased = var * count / (count - 1).clamp_min(1)
                bn.running_mean.mul_(1 - momentum).add_(mean.to(x.dtype), alpha=momentum)
                bn.running_var.mul_(1 - momentum).add_(unbiased.to(x.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.to(x.dtype).view(shape)) * \
            torch.rsqrt(var.to(x.dtype).view(shape) + bn.eps)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        return y


def convert_batchnorm(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Make every BatchNorm layer in ``module`` (itself included) normalise across the
    replicas of ``group``, in place; returns how many layers were converted."""
    converted = 0
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, _CrossReplicaMixin) \
                and not isinstance(layer, nn.SyncBatchNorm):
            cls = type(layer)  # its cross-replica subclass is made once per class
            if cls not in _CLASSES:
                _CLASSES[cls] = type(f"CrossReplica{cls.__name__}", (_CrossReplicaMixin, cls), {})
            layer.__class__ = _CLASSES[cls]
            setattr(layer, "replica_group", group)  # noqa: B010 - the class changed in place
            converted += 1
    return converted
