"""MirroredStrategy: synchronous data parallelism, one process per replica (SPMD).

Modules created in ``scope()`` get replica 0's initial values and their gradients are averaged
during ``backward()``, bucket by bucket, so a step with global batch ``B`` on ``N`` replicas
equals one device with ``B``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from replicator.cluster.devices import default_device_for, parse_devices
from replicator.cluster.environment import resolve_cluster, use_cluster
from replicator.cluster.resolvers import ClusterResolver, as_spec
from replicator.cluster.topology import Topology
from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.gradient_sync import BUFFER_SYNC_MODES, DEFAULT_BUCKET_BYTES
from replicator.comm.options import CommunicationOptions
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.selection import algorithm_for
from replicator.errors import ClusterConfigError, ReplicaMismatchError
from replicator.strategies.base import Strategy
from replicator.strategies.cross_replica_batchnorm import convert_batchnorm
from replicator.strategies.replicas import ReplicaGroup
from replicator.strategies.scope_capture import describe_state


def _first_difference(descs: list[list[str]]) -> str:
    for i in range(max(len(d) for d in descs)):
        entries = [d[i] if i < len(d) else "(missing)" for d in descs]
        if len(set(entries)) > 1:
            return "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
    return "(no entry differs)"


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

    # -- state ---------------------------------------------------------------------------------
    def _setup_module(self, module: torch.nn.Module) -> None:
        if self._sync_batchnorm:
            convert_batchnorm(module, self.group)
        super()._setup_module(module)

    def _on_new_state(self, module: torch.nn.Module,
                      params: list[tuple[str, torch.nn.Parameter]],
                      buffers: list[tuple[str, torch.Tensor]]) -> None:
        self._check_same_structure(module, params, buffers)
        self.collectives.broadcast_([t for _, t in [*params, *buffers]], src=0,
                                    what="broadcast of initial parameters from replica 0")
        self._add_synchronizer(module, params, buffers)

    def _add_synchronizer(self, module: torch.nn.Module,
                          params: list[tuple[str, torch.nn.Parameter]],
                          buffers: list[tuple[str, torch.Tensor]],
                          destination: int | None = None) -> None:
        """Average (or, with ``destination``, reduce) ``module``'s gradients in backward, with
        this strategy's bucket size, buffer sync and integrity check."""
        self._replica_group.synchronize_gradients(
            module, [p for _, p in params], [b for _, b in buffers], destination=destination,
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
        counts = ", ".join(f"rank {r}: {sum(e.startswith('parameter') for e in d)} parameters"
                           for r, d in enumerate(descs))
        raise ReplicaMismatchError(
            f"the replicas built different models in scope() ({type(module).__name__}; "
            f"{counts}). First difference: {_first_difference(descs)}. HINT: every replica must "
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
            from replicator.cluster.ports import choose_gloo_interface

            spec = resolve_cluster()
            if spec.world_size > 1:
                choose_gloo_interface(spec.master_addr)
        super().__init__(devices=None, cross_device_ops=cross_device_ops,
                         communication_options=communication_options, mesh=mesh, axis=axis,
                         buffer_sync=buffer_sync, sync_batchnorm=sync_batchnorm,
                         check_finite=check_finite)
