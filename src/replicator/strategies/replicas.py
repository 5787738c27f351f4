"""The replica group a strategy keeps in step, written once and composed by every strategy
(docs/topology.md): device, group, identity, ``Collectives`` and the gradient engine, as Lightning
Fabric's ``ParallelStrategy``; its waits take the strategy's own timeout.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from replicator.cluster.process_group import initialize, on_shutdown, open_store_client
from replicator.cluster.timeouts import resolve_timeout, set_group_timeout
from replicator.cluster.topology import Topology
from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce
from replicator.comm.collective_tracker import CollectiveTracker
from replicator.comm.collectives import Collectives
from replicator.comm.gradient_sync import DEFAULT_BUCKET_BYTES, GradientSynchronizer
from replicator.comm.groups import new_private_group


class ReplicaGroup:
    """The replicas of one process group as a strategy sees them: the whole job, the data
    axes (``axis=None``) or one axis of ``topology``; ``chief`` defaults to the group's first
    replica. Not a collective."""

    def __init__(self, device: torch.device, topology: Topology | None = None,
                 axis: str | None = None, *, timeout_seconds: float | None = None,
                 chief: bool | None = None) -> None:
        if topology is None and axis is not None:
            raise ValueError(f"ReplicaGroup(axis={axis!r}) needs the topology the axis belongs "
                             "to. HINT: pass topology=rp.Topology(...), or no axis for the "
                             "whole job")
        seconds = resolve_timeout(timeout_seconds)
        info = initialize(timeout_seconds=seconds, device=device)
        group: dist.ProcessGroup | None = None
        roles = None
        if topology is not None:
            group = topology.data_group() if axis is None else topology.group(axis)
            roles = dict(enumerate(topology.roles))
            set_group_timeout(group, seconds)
        elif seconds != info.timeout_seconds and dist.get_world_size() > 1:
            # the default group waits an earlier strategy's timeout: this one's collectives
            # get a group of every rank that waits its own
            group = new_private_group(list(range(dist.get_world_size())), "replicas", seconds)
        tracker = CollectiveTracker.for_group(group, open_store_client(info), roles=roles)
        on_shutdown(tracker.close)
        self._open(device, topology, axis,
                   Collectives.for_group(group, device, seconds, tracker), chief)

    @classmethod
    def single(cls, device: torch.device, timeout_seconds: float | None = None, *,
               chief: bool = True) -> ReplicaGroup:
        """One replica on its own, with no process group: reductions return the local value."""
        me = cls.__new__(cls)
        me._open(device, None, None, Collectives(0, 1, device, resolve_timeout(timeout_seconds)),
                 chief)
        return me

    def _open(self, device: torch.device, topology: Topology | None, axis: str | None,
              collectives: Collectives, chief: bool | None) -> None:
        self.device = device
        #: True on the one process that prints, logs and writes the replicas' shared files.
        self.is_chief = collectives.rank == 0 if chief is None else chief
        self.topology = topology
        self.axis = axis
        self.collectives = collectives
        self.algorithm: CrossDeviceOps = NativeAllReduce()
        self._synchronizers: list[GradientSynchronizer] = []
        self._paused = 0
        self._closed = False

    # -- identity ------------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None``: the default group, or no group at all)."""
        return self.collectives.group

    @property
    def rank(self) -> int:
        """This process's position in the group (its replica index)."""
        return self.collectives.rank

    @property
    def world_size(self) -> int:
        """How many replicas the group holds."""
        return self.collectives.world_size

    def __repr__(self) -> str:
        where = "job" if self.topology is None else (self.axis or "data axes")
        return (f"ReplicaGroup({where}: rank {self.rank} of {self.world_size}, global ranks "
                f"{self.collectives.global_ranks}, {self.device})")

    # -- the data-parallel gradient engine -----------------------------------------------------
    def use_algorithm(self, algorithm: CrossDeviceOps) -> None:
        """Sum gradients with ``algorithm``, small collectives through its same-host path if any."""
        self.algorithm = algorithm
        self.collectives.use_same_host_path(algorithm)

    @property
    def synchronizers(self) -> list[GradientSynchronizer]:
        """The gradient synchronizers of the modules set up so far, in creation order."""
        return list(self._synchronizers)

    def synchronize_gradients(self, owner: torch.nn.Module,
                              params: Sequence[torch.nn.Parameter],
                              buffers: Sequence[torch.Tensor] = (), *,
                              destination: int | None = None,
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                              buffer_sync: str = "mean", check: bool = True,
                              automatic: bool = True) -> GradientSynchronizer | None:
        """Average ``params``' gradients over the group (reduce onto ``destination`` if given),
        in backward or at ``synchronize()`` (``automatic=False``), until ``owner`` is freed or
        the group closed; ``None`` without parameters."""
        if not params:
            return None
        sync = GradientSynchronizer(list(params), self.collectives, self.algorithm,
                                    bucket_bytes=bucket_bytes, destination=destination,
                                    buffers=list(buffers), buffer_sync=buffer_sync,
                                    check=check, automatic=automatic)
        sync.enabled = self._paused == 0
        self._synchronizers.append(sync)
        me = weakref.ref(self)
        algorithm = self.algorithm

        def forget() -> None:
            sync.remove()
            algorithm.release_buckets(sync.owner)
            group = me()
            if group is not None and sync in group._synchronizers:
                group._synchronizers.remove(sync)

        weakref.finalize(owner, forget)
        return sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; synchronizers made inside start off."""
        before = [(s, s.enabled) for s in self._synchronizers]
        self._paused += 1
        for s, _ in before:
            s.enabled = False
        try:
            yield
        finally:
            self._paused -= 1
            known = {id(s) for s, _ in before}
            for s, was in before:
                s.enabled = was
            if self._paused == 0:
                for s in self._synchronizers:
                    if id(s) not in known:
                        s.enabled = True

    def close(self) -> None:
        """Remove every synchronizer's hooks and stop the tracker; idempotent."""
        if self._closed:
            return
        self._closed = True
        for sync in self._synchronizers:
            sync.remove()
            self.algorithm.release_buckets(sync.owner)
        self._synchronizers = []
        self.collectives.tracker.close()
