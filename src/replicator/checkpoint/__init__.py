"""The checkpoint room: storage only. Atomic, verified, multi-rank checkpoints.

``CheckpointManager`` commits step directories atomically (SHA-256 manifests, safetensors,
keep-last-k) and agrees across the ranks of a ``Collectives`` passed in; given an fsspec URL
(``s3://bucket/run``) it is a ``RemoteCheckpointManager``, which commits with commit objects
written last and a lease (``remote_manager.py``). ``BackgroundSaver`` writes its saves on a
thread, ``saver.ProcessSaver`` through a saver process. ``distributed_checkpoint`` saves
sharded model state through ``torch.distributed.checkpoint`` (under a strategy, call
:func:`replicator.resume.save_sharded`, which prepares the optimizers first). This room never
asks which strategy is active: what drives the training loop (``BackupAndRestore``,
preemption, the NaN guard) lives in :mod:`replicator.resume`, which passes the strategy's
collectives down.
"""

from replicator.checkpoint.background import BackgroundSaver
from replicator.checkpoint.exchange import Channel, group_collectives
from replicator.checkpoint.manager import CheckpointManager, Restored
from replicator.checkpoint.remote_manager import RemoteCheckpointManager, open_manager

__all__ = ["BackgroundSaver", "Channel", "CheckpointManager", "RemoteCheckpointManager",
           "Restored", "group_collectives", "open_manager"]
