"""The checkpoint room: storage only. Atomic, verified, multi-rank checkpoints over one storage
protocol (a local directory or an fsspec URL), saved in place or in the background; it never asks
which strategy is active (:mod:`replicator.resume` passes the collectives down).
"""

from typing import TYPE_CHECKING

from replicator.lazy_names import lazy_getattr

if TYPE_CHECKING:
    from replicator.checkpoint.manager import (
        Channel,
        CheckpointManager,
        Restored,
        group_collectives,
    )
    from replicator.checkpoint.saver import BackgroundSaver
    from replicator.checkpoint.storage import CheckpointStorage, FsspecStorage, LocalStorage

__all__ = ["BackgroundSaver", "Channel", "CheckpointManager", "CheckpointStorage",
           "FsspecStorage", "LocalStorage", "Restored", "group_collectives"]

#: Imported on first use: ``replicator checkpoints``' parser is built without torch.
__getattr__ = lazy_getattr(__name__, {
    **dict.fromkeys(["Channel", "CheckpointManager", "Restored", "group_collectives"],
                    "replicator.checkpoint.manager"),
    "BackgroundSaver": "replicator.checkpoint.saver",
    **dict.fromkeys(["CheckpointStorage", "FsspecStorage", "LocalStorage"],
                    "replicator.checkpoint.storage"),
})
