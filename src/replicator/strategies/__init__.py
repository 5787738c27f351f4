"""The strategies room: one API, many ways to run a step."""

from replicator.strategies.base import Strategy
from replicator.strategies.losses import compute_average_loss
from replicator.strategies.memory import MemoryReport
from replicator.strategies.mesh_strategy import (
    FSDPStrategy,
    MeshStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)
from replicator.strategies.mirrored import (
    CentralStorageStrategy,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
)
from replicator.strategies.registry import available_strategies, get_strategy, register_strategy
from replicator.strategies.replica_context import (
    OneDeviceStrategy,
    ReplicaContext,
    ValueContext,
    get_replica_context,
)
from replicator.strategies.two_level import DiLoCoStrategy, LocalSGDStrategy

register_strategy(OneDeviceStrategy, "onedevice", "single", "default")
register_strategy(MirroredStrategy)
register_strategy(MultiWorkerMirroredStrategy, "multi_worker", "multiworker_mirrored")
register_strategy(CentralStorageStrategy, "central")
register_strategy(MeshStrategy)
register_strategy(FSDPStrategy, "fully_sharded")
register_strategy(TensorParallelStrategy, "tensor", "tp")
register_strategy(PipelineStrategy, "pp")
register_strategy(DiLoCoStrategy, "streaming_diloco")
register_strategy(LocalSGDStrategy, "localsgd")

__all__ = ["Strategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy",
           "CentralStorageStrategy", "ReplicaContext", "get_replica_context",
           "compute_average_loss", "get_strategy", "register_strategy", "available_strategies",
           "MeshStrategy", "FSDPStrategy", "MemoryReport", "TensorParallelStrategy",
           "PipelineStrategy", "ValueContext", "DiLoCoStrategy", "LocalSGDStrategy"]
