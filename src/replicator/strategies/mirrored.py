"""MirroredStrategy: synchronous data parallelism, one process per replica (SPMD).

Every replica holds a full copy of the model. Modules created in ``scope()`` get identical
initial values (broadcast from replica 0) and their gradients are averaged across replicas
during ``backward()``, bucket by bucket, overlapping communication with the rest of backward.
The same step with global batch ``B`` on ``N`` replicas therefore equals one device with ``B``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from replicator.cluster.devices import default_device_for, parse_devices
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.process_group import initialize, on_shutdown, open_store_client
from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.collectives import Collectives
from replicator.comm.gradient_sync import DEFAULT_BUCKET_BYTES, GradientSynchronizer
from replicator.comm.options import CommunicationOptions
from replicator.comm.progress import CollectiveTracker
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.selection import algorithm_for
from replicator.errors import ClusterConfigError, ReplicaMismatchError
from replicator.strategies.base import Strategy


def _signature(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> list[str]:
    return ([f"parameter {i}: shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
             for i, p in enumerate(params)]
            + [f"buffer {i}: shape {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
               for i, b in enumerate(buffers)])


def _first_difference(descs: list[list[str]]) -> str:
    for i in range(max(len(d) for d in descs)):
        entries = [d[i] if i < len(d) else "(missing)" for d in descs]
        if len(set(entries)) > 1:
            return "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
    return "(no entry differs)"


class MirroredStrategy(Strategy):
    """Synchronous data parallel training on the replicas of this job.

    ``devices``: the devices of this machine's replicas, one per local process (``None``: one
    GPU per process when there are enough, else the CPU). ``cross_device_ops``: the all-reduce
    algorithm for gradients (default :class:`~replicator.NativeAllReduce`).
    """

    name = "mirrored"

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 communication_options: CommunicationOptions | None = None) -> None:
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
            self._device = parsed[spec.local_rank]
        else:
            self._device = default_device_for(spec.local_rank)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps such as "
                            f"rp.NativeAllReduce(), got {type(cross_device_ops).__name__}")
        self._options = communication_options or CommunicationOptions()
        if cross_device_ops is not None and self._options.implementation != "auto":
            raise ValueError(
                f"both cross_device_ops={cross_device_ops!r} and CommunicationOptions("
                f"implementation={self._options.implementation!r}) choose the all-reduce "
                "algorithm. HINT: give only one of them.")
        self._algorithm = cross_device_ops or algorithm_for(self._options, self._device)
        info = initialize(timeout_seconds=self._options.timeout_seconds, device=self._device)
        self._rank = dist.get_rank()
        self._world = dist.get_world_size()
        self._tracker = CollectiveTracker(self._rank, self._world, open_store_client(info))
        on_shutdown(self._tracker.close)
        self._collectives = Collectives(self._rank, self._world, self._device,
                                        info.timeout_seconds, self._tracker)
        self._synchronizers: list[GradientSynchronizer] = []
        super().__init__()

    # -- identity ------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._world

    @property
    def replica_id(self) -> int:
        return self._rank

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._algorithm

    @property
    def collectives(self) -> Collectives:
        """The collectives this strategy uses (for other rooms built on the public API)."""
        return self._collectives

    # -- state ---------------------------------------------------------------------------------
    def _on_new_state(self, params: list[torch.nn.Parameter],
                      buffers: list[torch.Tensor]) -> None:
        self._check_same_structure(params, buffers)
        self._collectives.broadcast_([*params, *buffers], src=0,
                                     what="broadcast of initial parameters from replica 0")
        if params:
            bucket = self._options.bytes_per_pack or DEFAULT_BUCKET_BYTES
            self._synchronizers.append(GradientSynchronizer(
                params, self._collectives, self._algorithm, bucket_bytes=bucket,
                buffers=buffers))

    def _check_same_structure(self, params: list[torch.nn.Parameter],
                              buffers: list[torch.Tensor]) -> None:
        desc = _signature(params, buffers)
        digest = hashlib.sha256("\n".join(desc).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        low = self._collectives.all_reduce(mine, ReduceOp.MIN, "model structure check")
        high = self._collectives.all_reduce(mine, ReduceOp.MAX, "model structure check")
        if bool(low == high):
            return
        texts = self._collectives.all_gather_bytes(json.dumps(desc).encode(),
                                                   "model structure exchange")
        descs = [json.loads(t) for t in texts]
        counts = ", ".join(f"rank {r}: {sum(e.startswith('parameter') for e in d)} parameters"
                           for r, d in enumerate(descs))
        raise ReplicaMismatchError(
            f"the replicas built different models in scope() ({counts}). First difference: "
            f"{_first_difference(descs)}. HINT: every replica must create the same modules in "
            "the same order; look for code that depends on the rank or on local data.")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward averages
        the accumulated sum (gradient accumulation without extra communication)."""
        before = [s.enabled for s in self._synchronizers]
        for s in self._synchronizers:
            s.enabled = False
        try:
            yield
        finally:
            for s, was in zip(self._synchronizers, before):
                s.enabled = was

    # -- cross-replica values -------------------------------------------------------------------
    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        return self._collectives.all_reduce(tensor, op, f"reduce({op.value})")

    def _reduce_many(self, op: ReduceOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._collectives.all_reduce_many(tensors, op, f"reduce({op.value})")

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self._collectives.all_gather_uneven(tensor, axis, "gather")

    def barrier(self) -> None:
        self._collectives.barrier()


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy across several machines (launched with ``torchrun`` or ``TF_CONFIG``).

    In replicator's one-process-per-replica model this is the same engine as
    :class:`MirroredStrategy`; the name and ``communication_options`` follow tf.distribute.
    """

    name = "multi_worker_mirrored"

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 cross_device_ops: CrossDeviceOps | None = None) -> None:
        super().__init__(devices=None, cross_device_ops=cross_device_ops,
                         communication_options=communication_options)
