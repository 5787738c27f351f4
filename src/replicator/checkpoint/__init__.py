"""The checkpoint room: storage only. Atomic, verified, multi-rank checkpoints.

One :class:`CheckpointManager` saves and restores over one storage protocol
(``storage.py``): a local directory (renamed into place, SHA-256 manifest last) or an fsspec
URL (``s3://bucket/run``: a commit object written last, under a lease). Replicated saves and
sharded ones (``distributed_checkpoint``, through ``torch.distributed.checkpoint``; under a
strategy call :func:`replicator.resume.save_sharded`) share that protocol, and
:class:`BackgroundSaver` writes saves on a thread or through a saver process
(``async_mode``). This room never asks which strategy is active: what drives the training
loop (``BackupAndRestore``, preemption, the NaN guard) lives in :mod:`replicator.resume`,
which passes the strategy's collectives down.
"""

from typing import TYPE_CHECKING

from replicator.lazy_names import lazy_getattr

if TYPE_CHECKING:
    from replicator.checkpoint.exchange import Channel, group_collectives
    from replicator.checkpoint.manager import (
        CheckpointManager,
        RemoteCheckpointManager,
        Restored,
        open_manager,
    )
    from replicator.checkpoint.saver import BackgroundSaver, ProcessSaver
    from replicator.checkpoint.storage import CheckpointStorage, FsspecStorage, LocalStorage

__all__ = ["BackgroundSaver", "Channel", "CheckpointManager", "CheckpointStorage",
           "FsspecStorage", "LocalStorage", "ProcessSaver", "RemoteCheckpointManager",
           "Restored", "group_collectives", "open_manager"]

#: Imported on first use: ``replicator checkpoints``' parser is built without torch.
__getattr__ = lazy_getattr(__name__, {
    **dict.fromkeys(["Channel", "group_collectives"], "replicator.checkpoint.exchange"),
    **dict.fromkeys(["CheckpointManager", "RemoteCheckpointManager", "Restored", "open_manager"],
                    "replicator.checkpoint.manager"),
    **dict.fromkeys(["BackgroundSaver", "ProcessSaver"], "replicator.checkpoint.saver"),
    **dict.fromkeys(["CheckpointStorage", "FsspecStorage", "LocalStorage"],
                    "replicator.checkpoint.storage"),
})
