"""The checkpoint room: atomic, verified checkpoints and exact resume after a failure.

``BackupAndRestore`` is what training code uses; ``CheckpointManager`` is the layer beneath it
(atomic step directories, SHA-256 manifests, keep-last-k, multi-rank agreement).
"""

from replicator.checkpoint.backup_and_restore import BackupAndRestore
from replicator.checkpoint.manager import CheckpointManager, Restored
from replicator.checkpoint.preemption import PREEMPTION_EXIT_CODE, Preempted

__all__ = ["BackupAndRestore", "CheckpointManager", "Restored", "Preempted",
           "PREEMPTION_EXIT_CODE"]
