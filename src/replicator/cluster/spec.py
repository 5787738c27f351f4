"""``ClusterSpec``: the position of one process in the job, as every resolver answers it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from replicator.errors import ClusterConfigError

__all__ = ["ClusterSpec"]


@dataclass(frozen=True)
class ClusterSpec:
    """The position of this process in the job; give one explicitly to pin it yourself:
    ``ClusterSpec(rank=2, world_size=4, local_world_size=2, master_addr="10.0.0.1",
    master_port=29500)``. Rank 0 hosts the store; ``node_rank`` defaults to
    ``rank // local_world_size``, ``local_rank`` to the rest.
    """

    rank: int
    world_size: int
    local_rank: int = -1
    local_world_size: int = 1
    node_rank: int = -1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    restart_count: int = 0
    store_is_hosted: bool = False
    source: str = "explicit"
    role: str = "worker"
    #: ``host:port`` of every rank where the source names them (TF_CONFIG), for error messages.
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ClusterConfigError(f"ClusterSpec.{name} must be an integer, got {value!r}")
        if self.world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: world_size={self.world_size}; the world "
                                     "needs at least one replica")
        if not 0 <= self.rank < self.world_size:
            raise ClusterConfigError(f"ClusterSpec: rank={self.rank} is outside "
                                     f"0..{self.world_size - 1} (world_size={self.world_size})")
        if self.local_world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: local_world_size={self.local_world_size} "
                                     "must be at least 1")
        if self.local_rank == -1:
            object.__setattr__(self, "local_rank", self.rank % self.local_world_size)
        if self.node_rank == -1:
            object.__setattr__(self, "node_rank", self.rank // self.local_world_size)
        if not 0 <= self.local_rank < self.local_world_size:
            raise ClusterConfigError(f"ClusterSpec: local_rank={self.local_rank} is outside "
                                     f"0..{self.local_world_size - 1}")
        if self.world_size > 1 and self.master_port is None:
            raise ClusterConfigError(
                f"ClusterSpec: master_port is not set but world_size={self.world_size}. HINT: "
                "give the chief's rendezvous port, the same on every process.")

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        """A spec is its own resolver (so it can be passed as ``cluster_resolver``)."""
        return self
