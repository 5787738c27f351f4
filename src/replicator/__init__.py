"""replicator: distributed training for PyTorch with the ergonomics of tf.distribute.

Write a single-device model, an input function and a step function; one line picks how it
runs::

    import replicator as rp
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = Net(); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

The top level holds what a training script writes; the machinery lives in its room
(:mod:`replicator.comm`, ``.errors``, ``.callbacks``, ``.checkpoint``, ``.cluster``,
``.strategies``)."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

from replicator import errors

# first: its exit handler must be registered before any room's (see the module)
from replicator.cluster import helper_threads  # noqa: F401
from replicator.errors import ReplicatorError, WorkerFailedError
from replicator.launch import launch  # here: the name would otherwise be the launch room's
from replicator.lazy_names import lazy_getattr

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from replicator import (
        callbacks,
        checkpoint,
        cluster,
        comm,
        data,
        metrics,
        optim,
        scaling,
        testing,
    )
    from replicator import plan as plan  # rp.plan.bench / rp.plan.plan; a room, not in __all__
    from replicator import rl as rl  # rp.rl: actors and replay; a room, not in __all__
    from replicator.cluster import Topology
    from replicator.comm import CommunicationOptions, ReduceOp
    from replicator.data import InputContext
    from replicator.precision import MixedPrecision
    from replicator.ps import ClusterCoordinator, ParameterServerStrategy, get_strategy
    from replicator.resume import BackupAndRestore
    from replicator.strategies import (
        CentralStorageStrategy,
        DiLoCoStrategy,
        FSDPStrategy,
        LocalSGDStrategy,
        MeshStrategy,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        PipelineStrategy,
        Strategy,
        TensorParallelStrategy,
        compute_average_loss,
        get_replica_context,
    )
    from replicator.train import Callback, EarlyStopping, ModelCheckpoint, Replicator, Trainer

#: Where each top-level name lives; its first use imports it, so ``import replicator`` (the
#: command line, the launcher, ``replicator --help``) does not import torch.
_LAZY: dict[str, str] = {
    **{room: f"replicator.{room}" for room in (
        "callbacks", "checkpoint", "cluster", "comm", "data", "metrics", "optim", "plan", "rl",
        "scaling", "testing", "strategies", "train", "ps", "resume", "parallel", "precision")},
    "Topology": "replicator.cluster", "InputContext": "replicator.data",
    "CommunicationOptions": "replicator.comm", "ReduceOp": "replicator.comm",
    "MixedPrecision": "replicator.precision", "BackupAndRestore": "replicator.resume",
    "ClusterCoordinator": "replicator.ps", "ParameterServerStrategy": "replicator.ps",
    **dict.fromkeys(
        ["CentralStorageStrategy", "DiLoCoStrategy", "FSDPStrategy", "LocalSGDStrategy",
         "MeshStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy", "OneDeviceStrategy",
         "PipelineStrategy", "Strategy", "TensorParallelStrategy", "compute_average_loss",
         "get_replica_context"], "replicator.strategies"),
    # by name: from the room that registers the last built-in strategy, so every one is known
    "get_strategy": "replicator.ps",
    **dict.fromkeys(["Callback", "EarlyStopping", "ModelCheckpoint", "Replicator", "Trainer"],
                    "replicator.train"),
}

__version__ = "0.1.0"

__all__ = [
    # strategies: the one line that changes
    "Strategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy",
    "CentralStorageStrategy", "ParameterServerStrategy", "MeshStrategy", "FSDPStrategy",
    "TensorParallelStrategy", "PipelineStrategy", "get_strategy", "ClusterCoordinator",
    "DiLoCoStrategy", "LocalSGDStrategy",
    # inside a step and an input function
    "get_replica_context", "compute_average_loss", "ReduceOp", "CommunicationOptions",
    "InputContext", "MixedPrecision",
    # cluster and launching
    "Topology", "launch",
    # the high-level loop, the callbacks given to it most, and every callback (rp.callbacks)
    "Trainer", "Replicator", "Callback", "BackupAndRestore", "EarlyStopping",
    "ModelCheckpoint", "callbacks",
    # the errors a script catches (every other one: rp.errors)
    "ReplicatorError", "WorkerFailedError",
    # rooms
    "data", "metrics", "optim", "scaling", "errors", "comm", "checkpoint", "testing", "cluster",
]

#: Names that left the top level, and the module that holds each now. They still resolve for
#: one release, with a DeprecationWarning naming the new place.
_MOVED: dict[str, str] = {
    **dict.fromkeys(
        ["CrossDeviceOps", "NativeAllReduce", "RingAllReduce", "HierarchicalAllReduce",
         "ReductionToOneDevice", "SharedMemoryAllReduce", "Compression", "CastCompression",
         "PowerSGD", "ddp_comm_hook", "register_ddp_comm_hook"], "replicator.comm"),
    **dict.fromkeys(
        ["ClusterConfigError", "ReplicaTimeoutError", "ReplicaMismatchError",
         "CollectiveMismatchError", "NotDistributedError", "CheckpointError",
         "CheckpointCorruptError", "UnsafeCheckpointError", "CheckpointWriteError",
         "NonFiniteLossError", "PreemptedError", "ParameterServerError",
         "ParameterServerLostError", "CallbackFailedError"], "replicator.errors"),
    **dict.fromkeys(["ReplicaContext", "register_strategy", "MemoryReport"],
                    "replicator.strategies"),
    **dict.fromkeys(["LearningRateScheduler", "CSVLogger", "TensorBoard", "TerminateOnNaN",
                     "History", "ProgressBar"], "replicator.callbacks"),
    "available_strategies": "replicator.ps", "partitioners": "replicator.ps",
    "CheckpointManager": "replicator.checkpoint", "PREEMPTION_EXIT_CODE": "replicator.cluster",
}

#: Rooms that hold moved names; listed by ``dir(rp)`` beside ``__all__``.
_ROOMS = ("strategies", "train", "ps", "resume", "parallel", "plan", "rl")

_lazy = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    """Import a top-level name on first use (:data:`_LAZY`); resolve a name that left the top
    level, with a DeprecationWarning naming its place."""
    if name in _LAZY:
        return _lazy(name)
    where = _MOVED.get(name)
    if where is None:  # name and obj let the traceback suggest a close name from dir()
        raise AttributeError(f"module 'replicator' has no attribute {name!r}", name=name,
                             obj=sys.modules[__name__])
    new = f"rp.{where.removeprefix('replicator.')}.{name}"
    warnings.warn(f"rp.{name} moved to {new}; the top-level name is removed in the next "
                  f"release. HINT: write {new}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)


def __dir__() -> list[str]:
    """The public names (``__all__``), ``__version__`` and the rooms that hold the rest."""
    return sorted({*__all__, "__version__", *_ROOMS})
