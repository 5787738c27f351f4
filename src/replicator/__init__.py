"""replicator: distributed training for PyTorch with the ergonomics of tf.distribute.

Write a single-device model, an input function and a step function; one line picks how it
runs::

    import replicator as rp
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = Net(); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""

from replicator import cluster, data, metrics, optim, scaling, testing
from replicator.checkpoint import PREEMPTION_EXIT_CODE, BackupAndRestore, CheckpointManager
from replicator.cluster import Topology, launch
from replicator.comm import (
    CastCompression,
    CommunicationOptions,
    Compression,
    CrossDeviceOps,
    HierarchicalAllReduce,
    NativeAllReduce,
    PowerSGD,
    ReduceOp,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
    ddp_comm_hook,
    register_ddp_comm_hook,
)
from replicator.data import InputContext
from replicator.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    ClusterConfigError,
    CollectiveMismatchError,
    NonFiniteLossError,
    NotDistributedError,
    ParameterServerError,
    ParameterServerLostError,
    PreemptedError,
    ReplicaMismatchError,
    ReplicaTimeoutError,
    ReplicatorError,
    UnsafeCheckpointError,
    WorkerFailedError,
)
from replicator.precision import MixedPrecision
from replicator.ps import partitioners
from replicator.strategies import (
    CentralStorageStrategy,
    FSDPStrategy,
    MemoryReport,
    MeshStrategy,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    ReplicaContext,
    Strategy,
    TensorParallelStrategy,
    available_strategies,
    compute_average_loss,
    get_replica_context,
    get_strategy,
    register_strategy,
)
from replicator.train import (
    Callback,
    CallbackFailedError,
    CSVLogger,
    EarlyStopping,
    History,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    Replicator,
    TensorBoard,
    TerminateOnNaN,
    Trainer,
)

__version__ = "0.1.0"

__all__ = [
    "Strategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy",
    "ReplicaContext", "get_replica_context", "compute_average_loss", "get_strategy",
    "register_strategy", "available_strategies", "ReduceOp", "CommunicationOptions",
    "CrossDeviceOps", "NativeAllReduce", "InputContext", "launch", "data", "testing",
    "ReplicatorError", "ClusterConfigError", "ReplicaTimeoutError", "ReplicaMismatchError",
    "WorkerFailedError", "__version__", "metrics", "Trainer", "Replicator", "Callback",
    "History", "EarlyStopping", "ModelCheckpoint", "LearningRateScheduler", "CSVLogger",
    "TensorBoard", "TerminateOnNaN", "ProgressBar", "CallbackFailedError",
    "CentralStorageStrategy", "RingAllReduce", "HierarchicalAllReduce", "ReductionToOneDevice",
    "SharedMemoryAllReduce", "Compression", "CastCompression", "PowerSGD", "ddp_comm_hook",
    "register_ddp_comm_hook", "BackupAndRestore", "CheckpointManager", "PREEMPTION_EXIT_CODE",
    "CheckpointError", "CheckpointCorruptError", "UnsafeCheckpointError", "CheckpointWriteError",
    "NonFiniteLossError", "PreemptedError", "CollectiveMismatchError", "NotDistributedError",
    "Topology", "cluster", "scaling", "optim", "MixedPrecision", "MeshStrategy",
    "FSDPStrategy", "MemoryReport", "TensorParallelStrategy", "PipelineStrategy",
    "ParameterServerStrategy", "partitioners", "ParameterServerError", "ParameterServerLostError",
]
