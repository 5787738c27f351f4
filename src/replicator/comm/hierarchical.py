"""Hierarchical all-reduce: sum inside each node, all-reduce among node leaders, broadcast back.

Only one replica per node talks across nodes, so the slow network carries the tensor once per
node instead of once per replica. A node is ``ranks_per_node`` consecutive ranks (the
launcher's ``LOCAL_WORLD_SIZE``); with a single node the leader step is skipped and the
algorithm is a reduce followed by a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator.cluster.environment import resolve_cluster
from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce
from replicator.comm.compression import Compression
from replicator.comm.groups import (
    default_timeout_seconds,
    global_rank,
    group_ranks,
    is_world,
    split_into_nodes,
)


@dataclass
class _Topology:
    node: list[int]                       # global ranks of this rank's node, leader first
    intra: dist.ProcessGroup | None       # the node's group (None for a one-rank node)
    leaders: dist.ProcessGroup | None     # the leaders' group (None unless leader and >1 node)


class HierarchicalAllReduce(CrossDeviceOps):
    """Reduce inside each node, all-reduce among one leader per node, broadcast inside the node.

    ``ranks_per_node``: replicas per node (``None``: ``LOCAL_WORLD_SIZE``). ``inter_node``: the
    algorithm the leaders use among themselves (default :class:`NativeAllReduce`).
    """

    name = "hierarchical"

    def __init__(self, ranks_per_node: int | None = None,
                 inter_node: CrossDeviceOps | None = None, *,
                 compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        super().__init__(compression=compression, timeout_seconds=timeout_seconds)
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                           or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if inter_node is not None and not isinstance(inter_node, CrossDeviceOps):
            raise TypeError(f"inter_node must be a CrossDeviceOps such as rp.RingAllReduce(), "
                            f"got {type(inter_node).__name__}")
        if inter_node is not None and inter_node.compression is not None:
            raise ValueError("give compression to HierarchicalAllReduce itself, not to its "
                             "inter_node algorithm")
        self.ranks_per_node = ranks_per_node
        self.inter_node = inter_node or NativeAllReduce()
        # keyed by id(group); the group is kept alongside so that its id cannot be reused
        self._topologies: dict[int, tuple[dist.ProcessGroup | None, _Topology]] = {}

    def _per_node(self) -> int:
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return max(1, resolve_cluster().local_world_size)

    def _prepare(self, group: dist.ProcessGroup | None) -> None:
        key = id(group)
        if key in self._topologies and self._topologies[key][0] is group:
            return
        if not is_world(group):
            raise ValueError("HierarchicalAllReduce builds node groups out of the whole world; "
                             "it cannot run on an explicit sub-group. HINT: pass group=None")
        nodes = split_into_nodes(group_ranks(group), self._per_node())
        timeout = timedelta(seconds=default_timeout_seconds())
        me = global_rank()
        mine: _Topology | None = None
        # every rank creates every group, in the same order (new_group is a collective)
        intra_groups = [dist.new_group(node, timeout=timeout) if len(node) > 1 else None
                        for node in nodes]
        leaders = dist.new_group([node[0] for node in nodes], timeout=timeout) \
            if len(nodes) > 1 else None
        for node, intra in zip(nodes, intra_groups):
            if me in node:
                mine = _Topology(node, intra, leaders if me == node[0] else None)
        if mine is None:  # cannot happen: every rank is in the world
            raise RuntimeError(f"rank {me} is in none of the nodes {nodes}")
        self._topologies[key] = (group, mine)

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        topo = self._topologies[id(group)][1]
        leader = topo.node[0]
        if topo.intra is not None:
            dist.reduce(tensor, dst=leader, group=topo.intra)
        if topo.leaders is not None:
            self.inter_node._sum_now(tensor, topo.leaders)
        if topo.intra is not None:
            dist.broadcast(tensor, src=leader, group=topo.intra)

    def __repr__(self) -> str:
        extra = f", compression={self.compression!r}" if self.compression is not None else ""
        return (f"HierarchicalAllReduce(ranks_per_node={self.ranks_per_node}, "
                f"inter_node={self.inter_node!r}{extra})")
