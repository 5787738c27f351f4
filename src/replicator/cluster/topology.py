"""The layout of a job: each process's role and host, and the workers' named mesh axes.

Torchtitan's layout: workers are ranks ``0..W-1``, servers the last ``num_ps``; the mesh is
row-major, so the last axis holds neighbouring ranks (one host). Near-misses of
:data:`KNOWN_AXES` (``tensr``) are refused as typos. Building it is a collective.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from replicator.cluster.hosts import HostsSpec, check_hosts_spec, group_by_host, job_host_keys
from replicator.errors import ClusterConfigError

#: The axis names a topology understands, and what each splits.
KNOWN_AXES = {
    "data": "replicas that each see different data (data parallelism)",
    "fsdp": "replicas that see different data and shard parameters (fully sharded)",
    "pipeline": "stages of the model (pipeline parallelism)",
    "tensor": "shards of each layer (tensor parallelism)",
}
#: Axes along which the input is split: their product is the number of replicas.
DATA_AXES = ("data", "fsdp")

Role = Literal["chief", "worker", "ps"]


def _edits(a: str, b: str) -> int:
    """Edit distance of ``a`` and ``b``: insertions, deletions, substitutions and swaps of
    two neighbouring letters each count one (optimal string alignment)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1,
                         rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def likely_typo(name: str, known: Collection[str] = tuple(KNOWN_AXES)) -> str | None:
    """The known axis ``name`` probably misspells (``tensr``, ``Data``, ``fdsp``), or ``None``;
    common names of other axes (``dp``, ``tp``, ``model``) stay free."""
    if name in known:
        return None
    lower = name.lower()
    for axis in known:
        if lower == axis:
            return axis
        if len(axis) > 4:
            if _edits(lower, axis) <= 2:
                return axis
        elif lower[:1] == axis[:1] and _edits(lower, axis) <= 1:
            return axis
    return None


def resolve_axes(axes: Mapping[str, int] | Sequence[tuple[str, int]] | None,
                 num_workers: int) -> dict[str, int]:
    """Validated axis sizes (``-1`` infers one; the product must be the workers)."""
    items = list((axes or {"data": num_workers}).items()) if isinstance(axes, Mapping) or \
        axes is None else list(axes)
    if not items:
        raise ClusterConfigError("a topology needs at least one axis. HINT: Topology({'data': "
                                 f"{num_workers}}}) or Topology() for plain data parallelism.")
    names = [name for name, _ in items]
    for name in names:
        if not isinstance(name, str) or not name:
            raise ClusterConfigError(f"mesh axis names are non-empty strings, got {name!r}")
        typo = likely_typo(name)
        if typo is not None:
            raise ClusterConfigError(
                f"unknown mesh axis {name!r}. Did you mean {typo!r}? Known axes: "
                + "; ".join(f"{k}: {v}" for k, v in KNOWN_AXES.items())
                + f". HINT: to name an axis of your own, pick a name that is not one or two "
                f"letters from {typo!r} (for example 'model' or 'expert').")
    if len(set(names)) != len(names):
        raise ClusterConfigError(f"mesh axes {names} name an axis twice")
    sizes: list[int] = []
    for name, size in items:
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ClusterConfigError(f"mesh axis {name!r} has size {size!r}; sizes are positive "
                                     "integers, or -1 for the one axis to infer")
        sizes.append(size)
    if sizes.count(-1) > 1:
        raise ClusterConfigError(f"mesh axes {dict(items)}: only one axis may be -1 (inferred)")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if known == 0 or num_workers % known:
            raise ClusterConfigError(
                f"mesh axes {dict(items)} cannot be completed for {num_workers} worker "
                f"processes: {num_workers} is not a multiple of {known}. HINT: choose degrees "
                f"whose product divides {num_workers}.")
        sizes[sizes.index(-1)] = num_workers // known
    product = math.prod(sizes)
    if product != num_workers:
        shape = " x ".join(f"{n}={s}" for n, s in zip(names, sizes))
        raise ClusterConfigError(
            f"mesh axes {shape} make {product} processes, but the job has {num_workers} worker "
            f"process(es). HINT: the degrees must multiply to the number of workers; use -1 "
            f"for one axis to infer it, or launch {product} workers "
            f"(`replicator run --nproc {product} ...`).")
    return dict(zip(names, sizes))


def _check_worker_order(order: Sequence[int] | None, num_workers: int) -> list[int]:
    """``order`` if it lists each worker once (``None``: ascending), else an error."""
    if order is None:
        return list(range(num_workers))
    got = list(order)
    if sorted(got) != list(range(num_workers)):
        raise ClusterConfigError(
            f"worker_order={got} must list each of the {num_workers} worker ranks "
            f"0..{num_workers - 1} once. HINT: leave it out for ascending rank order")
    return got


class Topology:
    """Named mesh axes over the workers, the role and host of every process: ``axes`` (name ->
    degree, default ``{"data": <all workers>}``, or keywords ``Topology(data=2, tensor=2)``) and
    ``num_ps`` servers (the last ranks). ``hosts``: how the workers group into hosts where the
    environment does not say (a count of consecutive-rank hosts, or each host's rank list; see
    :mod:`~replicator.cluster.hosts`). ``worker_order``: the workers' ranks in the mesh's
    row-major order (default ascending), for a layout whose last axis must hold one host's
    processes although their ranks are not neighbours. Starts the process group if needed.
    """

    def __init__(self, axes: Mapping[str, int] | Sequence[tuple[str, int]] | None = None, *,
                 num_ps: int = 0, hosts: HostsSpec = None, device_type: str | None = None,
                 worker_order: Sequence[int] | None = None, **axis_sizes: int) -> None:
        from replicator.cluster.process_group import initialize

        check_hosts_spec(hosts)
        if axis_sizes:
            if axes is not None:
                raise ClusterConfigError(
                    f"Topology got axes twice: {axes!r} and the keywords {axis_sizes}. HINT: "
                    "give either a mapping, Topology({'data': 2}), or keywords, "
                    "Topology(data=2).")
            axes = axis_sizes

        initialize()
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
            raise ClusterConfigError(f"num_ps must be a non-negative integer, got {num_ps!r}")
        if num_ps >= self.world_size:
            script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "script.py"
            raise ClusterConfigError(
                f"num_ps={num_ps} leaves no worker in a job of {self.world_size} process(es): "
                "parameter servers and workers are processes of their own. HINT: launch at "
                f"least {num_ps + 1}, e.g. `replicator run --nproc {num_ps + 1} --num-ps "
                f"{num_ps} {script}` (or torchrun --nproc-per-node {num_ps + 1}).")
        self.num_ps = num_ps
        self.num_workers = self.world_size - num_ps
        self.axes = resolve_axes(axes, self.num_workers)
        self.roles: list[Role] = ["chief" if r == 0 else "worker" if r < self.num_workers else "ps"
                                  for r in range(self.world_size)]
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device_type = device_type
        ranks = torch.tensor(_check_worker_order(worker_order, self.num_workers)).reshape(
            tuple(self.axes.values()))
        #: Every process's host key, in rank order (declared hosts are ``host<i>@<key>``).
        self.hosts = job_host_keys(hosts, num_ps)
        self.mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(self.axes))
        self._node_groups = self._make_node_groups()
        self._data_group = self._make_data_group()
        if self.num_ps or self.mesh.ndim > 1 or len(self._node_groups) > 1 \
                or len(self.data_axes) != 1:
            # groups were made here: gloo finishes connecting one side of a pair before the
            # other, and a process that ended at once closed its peer's half-made connection
            # ("connectFullMesh failed ... Connection closed by peer", 3 of 40 under load)
            dist.barrier()

    # -- who am I ------------------------------------------------------------------------------
    @property
    def role(self) -> Role:
        """``chief`` (worker 0), ``worker`` or ``ps``."""
        return self.roles[self.global_rank]

    @property
    def is_worker(self) -> bool:
        """True for the chief and the other workers (processes that run the training loop)."""
        return self.role != "ps"

    @property
    def is_ps(self) -> bool:
        return self.role == "ps"

    @property
    def is_chief(self) -> bool:
        return self.role == "chief"

    @property
    def host(self) -> str:
        """This process's host key (see :mod:`replicator.cluster.hosts`)."""
        return self.hosts[self.global_rank]

    @property
    def coordinate(self) -> dict[str, int]:
        """This worker's index on each axis (empty on a parameter server)."""
        coord = self.mesh.get_coordinate()
        return {} if coord is None else dict(zip(self.axes, coord))

    # -- axes ----------------------------------------------------------------------------------
    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            near = difflib.get_close_matches(axis, list(self.axes), n=1)
            guess = f" Did you mean {near[0]!r}?" if near else ""
            raise ClusterConfigError(f"this topology has no axis {axis!r}.{guess} Its axes: "
                                     + ", ".join(f"{n}={s}" for n, s in self.axes.items()))
        if self.is_ps:
            raise ClusterConfigError(
                f"rank {self.global_rank} is a parameter server, which is on no mesh axis (asked "
                f"for {axis!r}). HINT: only workers ask for axis groups; check topology.is_worker.")

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this worker's neighbours along ``axis``."""
        self._check_axis(axis)
        return self.mesh.get_group(axis)

    def size(self, axis: str) -> int:
        """The degree of ``axis`` (1 for an axis the topology does not have)."""
        return self.axes.get(axis, 1)

    def index(self, axis: str) -> int:
        """This worker's position along ``axis``."""
        self._check_axis(axis)
        return self.coordinate[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this worker's group along ``axis``, in group order."""
        return list(dist.get_process_group_ranks(self.group(axis)))

    # -- replicas (the data axes together) ------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes along which the input is split (``data`` and ``fsdp`` where present)."""
        return tuple(a for a in self.axes if a in DATA_AXES)

    @property
    def num_replicas(self) -> int:
        """How many replicas see different data: the product of the data axes (1 if none)."""
        return math.prod(self.axes[a] for a in self.data_axes)

    @property
    def replica_id(self) -> int:
        """This worker's replica index over the data axes (row-major), 0 without data axes."""
        if self.is_ps:
            raise ClusterConfigError(f"rank {self.global_rank} is a parameter server and has "
                                     "no replica id. HINT: check topology.is_worker first.")
        rid = 0
        for axis in self.data_axes:
            rid = rid * self.axes[axis] + self.coordinate[axis]
        return rid

    def data_group(self) -> dist.ProcessGroup:
        """The group of the replicas this worker exchanges gradients with (all data axes)."""
        if self.is_ps:
            raise ClusterConfigError(f"rank {self.global_rank} is a parameter server and has "
                                     "no data group. HINT: check topology.is_worker first.")
        assert self._data_group is not None  # every worker is in exactly one data group
        return self._data_group

    def _make_data_group(self) -> dist.ProcessGroup | None:
        axes = self.data_axes
        if len(axes) == 1:
            return self.mesh.get_group(axes[0]) if self.is_worker else None
        # no data axis (every worker its own replica) or several (data x fsdp): one group per
        # combination of the other axes' coordinates
        others = [a for a in self.axes if a not in axes]
        order = [list(self.axes).index(a) for a in [*others, *axes]]
        blocks = self.mesh.mesh.permute(*order).reshape(-1, self.num_replicas).tolist()
        mine = None
        for block in blocks:
            group = dist.new_group(block)  # collective: every process creates every group
            if self.global_rank in block:
                mine = group
        return mine

    # -- hosts -----------------------------------------------------------------------------------
    def _make_node_groups(self) -> dict[str, dist.ProcessGroup | None]:
        by_host = self.host_groups
        if len(by_host) == 1:  # the whole job on one host: the default group is the node
            return {self.hosts[0]: None}
        # every process takes part in creating every group (new_group is collective)
        return {self.hosts[members[0]]: dist.new_group(members) for members in by_host}

    @property
    def num_hosts(self) -> int:
        return len(self._node_groups)

    @property
    def host_groups(self) -> list[list[int]]:
        """The global ranks of every host, hosts in order of their first rank."""
        return group_by_host(list(range(self.world_size)), self.hosts)

    def host_ranks(self, host: str | None = None) -> list[int]:
        """Global ranks on ``host`` (default: this process's host), in rank order."""
        host = self.host if host is None else host
        if host not in self._node_groups:
            raise ClusterConfigError(f"no process runs on host {host!r}; hosts: "
                                     + ", ".join(self._node_groups))
        return [r for r, h in enumerate(self.hosts) if h == host]

    def node_group(self) -> dist.ProcessGroup | None:
        """The group of this host's processes (``None``: the default group, one host)."""
        return self._node_groups[self.host]

    def describe(self) -> str:
        """One line: axes, this process's role, coordinates and host."""
        shape = " x ".join(f"{n}={s}" for n, s in self.axes.items())
        where = ", ".join(f"{k}={v}" for k, v in self.coordinate.items()) or "no axis"
        ps = f" + {self.num_ps} ps" if self.num_ps else ""
        return (f"Topology({shape}{ps}; {self.num_hosts} host(s)): rank {self.global_rank} is "
                f"{self.role} at {where} on {self.host}")

    def __repr__(self) -> str:
        return self.describe()
