"""Hierarchical all-reduce: sum inside each host, all-reduce among host leaders, share back, so
the slow network carries the tensor once per host."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.cluster.hosts import exchange_host_keys, group_by_host
from replicator.cluster.timeouts import resolve_timeout
from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce
from replicator.comm.comm_thread import lane
from replicator.comm.compression import Compression
from replicator.comm.groups import (
    check_member,
    collective_device,
    global_rank,
    group_ranks,
    new_private_group,
)
from replicator.comm.shared_memory import SharedMemoryAllReduce
from replicator.comm.shm_segment import host_id, shared_memory_problem, shm_dir

_INTRA_HOST = ("auto", "shared_memory", "native")


@dataclass
class HostTopology:
    """One group split into hosts (global ranks, ordered by first rank), as this process sees it."""

    hosts: list[list[int]]
    leaders: list[int]
    host: list[int]
    intra: dist.ProcessGroup | None
    leader_group: dist.ProcessGroup | None
    shared_memory: bool


class HierarchicalAllReduce(CrossDeviceOps):
    """Hierarchical all-reduce; ``ranks_per_node``: hosts as runs of group ranks (tests);
    ``inter_node``: the leaders' algorithm; ``intra_host``: "auto", "shared_memory", "native"."""

    name = "hierarchical"

    def __init__(self, ranks_per_node: int | None = None,
                 inter_node: CrossDeviceOps | None = None, *, intra_host: str = "auto",
                 compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        super().__init__(compression=compression, timeout_seconds=timeout_seconds)
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                           or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if inter_node is not None and not isinstance(inter_node, CrossDeviceOps):
            raise TypeError(f"inter_node must be a CrossDeviceOps such as "
                            f"rp.comm.RingAllReduce(), got {type(inter_node).__name__}")
        if isinstance(inter_node, HierarchicalAllReduce):
            raise TypeError("inter_node cannot itself be hierarchical: the leaders are one per "
                            "host already. HINT: use rp.comm.NativeAllReduce() or "
                            "rp.comm.RingAllReduce()")
        if inter_node is not None and inter_node.compression is not None:
            raise ValueError("give compression to HierarchicalAllReduce itself, not to its "
                             "inter_node algorithm")
        if intra_host not in _INTRA_HOST:
            raise ValueError(f"intra_host must be one of {', '.join(_INTRA_HOST)}, got "
                             f"{intra_host!r}")
        self.ranks_per_node = ranks_per_node
        self.inter_node = inter_node or NativeAllReduce()
        self.intra_host = intra_host
        self._shared = SharedMemoryAllReduce(timeout_seconds=timeout_seconds)
        # keyed by the lane's private copy of the group (weakly: a new group gets a new entry)
        self._topologies: weakref.WeakKeyDictionary[dist.ProcessGroup, HostTopology] = \
            weakref.WeakKeyDictionary()

    def topology_for(self, group: dist.ProcessGroup | None = None) -> HostTopology:
        """The hosts, leaders and groups used on ``group`` (a collective before its first use)."""
        check_member(group, "topology_for")
        private = lane(group).group
        self._prepare(group, private)
        return self._topologies[private]

    def _prepare(self, group: dist.ProcessGroup | None, private: dist.ProcessGroup) -> None:
        """Find the hosts of ``group`` and create their groups, on the caller's thread."""
        if private in self._topologies:
            return
        ranks = group_ranks(group)
        keys = exchange_host_keys(group)
        n = self.ranks_per_node
        hosts = [ranks[i:i + n] for i in range(0, len(ranks), n)] if n else \
            group_by_host(ranks, keys)
        me = global_rank()
        host = next(h for h in hosts if me in h)
        shared_hosts = self._shared_memory_hosts(group, ranks, hosts, keys)
        bad = [h for h, ok in zip(hosts, shared_hosts) if not ok and len(h) > 1]
        if self.intra_host == "shared_memory" and bad:
            raise ValueError(f"HierarchicalAllReduce(intra_host='shared_memory') on rank {me}: "
                             f"shared memory is not usable inside host(s) {bad} (needs {shm_dir()}"
                             " on every member, all on one machine). HINT: use intra_host='auto'")
        shared = shared_hosts[hosts.index(host)]
        timeout = resolve_timeout(self.timeout_seconds, group=group)
        backend = str(dist.get_backend(group))
        intra = new_private_group(host, "host", timeout, backend) if len(host) > 1 else None
        leaders = [h[0] for h in hosts]
        leader_group = new_private_group(leaders, "leaders", timeout, backend) \
            if len(hosts) > 1 and me == host[0] else None
        self._topologies[private] = HostTopology(hosts, leaders, host, intra, leader_group, shared)

    def _shared_memory_hosts(self, group: dist.ProcessGroup | None, ranks: list[int],
                             hosts: list[list[int]], keys: list[str]) -> list[bool]:
        """For each host, may its steps use shared memory (the same answer on every rank)?"""
        if self.intra_host == "native":
            return [False] * len(hosts)
        mine = torch.tensor([host_id(), 0 if shared_memory_problem() else 1], dtype=torch.int64,
                            device=collective_device(group))
        parts = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(parts, mine, group=group)
        facts = {r: (int(p[0]), keys[i], int(p[1])) for i, (r, p) in enumerate(zip(ranks, parts))}
        # one machine, one declared host key, and every member able to use shared memory
        return [len(h) > 1 and len({facts[r][:2] for r in h}) == 1 and all(facts[r][2] for r in h)
                for h in hosts]

    def forget_groups(self) -> None:  # the inner algorithms forget theirs themselves
        self._topologies.clear()

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        topo = self._topologies.get(group) if group is not None else None
        if topo is None:  # only the lane calls this, after _prepare
            raise RuntimeError("HierarchicalAllReduce ran on a group it has not prepared. "
                               "HINT: call all_reduce_sum_async(tensor, group), not _sum_now")
        intra, leader = topo.intra, topo.host[0]
        # in shared memory a sum lands on every member: the host's sum, then the leader's
        # result plus zeros from the others is a broadcast
        shm = intra is not None and topo.shared_memory and tensor.device.type == "cpu"
        if shm:
            self._shared._sum_now(tensor, intra)
        elif intra is not None:
            dist.reduce(tensor, dst=leader, group=intra)
        if shm and len(topo.hosts) == 1:
            return
        if topo.leader_group is not None:
            self.inter_node._sum_now(tensor, topo.leader_group)
        elif shm:
            tensor.zero_()
        if shm:
            self._shared._sum_now(tensor, intra)
        elif intra is not None:
            dist.broadcast(tensor, src=leader, group=intra)

    def _fields(self) -> dict[str, object]:
        return {"ranks_per_node": self.ranks_per_node, "inter_node": self.inter_node,
                "intra_host": self.intra_host}
