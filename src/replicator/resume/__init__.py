"""The resume room: what drives a training loop through failures (backups and exact resume,
preemption, non-finite gradients, sharded saves), above the strategies: it asks a strategy only
through its public API, and storage (:mod:`replicator.checkpoint`) never asks about one.
"""

from replicator.resume.backup_and_restore import BackupAndRestore
from replicator.resume.preemption import PREEMPTION_EXIT_CODE, Preempted, PreemptionWatcher
from replicator.resume.sharded import checkpoint_collectives, load_sharded, save_sharded
from replicator.resume.step_hooks import NonFiniteGuard, gradients_finite

__all__ = ["BackupAndRestore", "NonFiniteGuard", "PREEMPTION_EXIT_CODE", "Preempted",
           "PreemptionWatcher", "checkpoint_collectives", "gradients_finite", "load_sharded",
           "save_sharded"]
