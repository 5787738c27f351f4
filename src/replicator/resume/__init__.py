"""The resume room: what drives a training loop through failures, above the strategies.

``BackupAndRestore`` backs up and resumes a run at the exact step; ``PreemptionWatcher`` turns
a SIGTERM on any rank into one agreed step at which every rank saves and stops (``Preempted``,
exit code :data:`PREEMPTION_EXIT_CODE`); ``NonFiniteGuard`` stops before an optimizer step
on NaN or infinite gradients; ``save_sharded`` / ``load_sharded`` save a split model under
its strategy. They take the strategy explicitly (or the active one) and use only its public
API; storage is :mod:`replicator.checkpoint`'s, which never asks about a strategy.
"""

from replicator.resume.backup_and_restore import BackupAndRestore
from replicator.resume.preemption import PREEMPTION_EXIT_CODE, Preempted, PreemptionWatcher
from replicator.resume.sharded import checkpoint_collectives, load_sharded, save_sharded
from replicator.resume.step_hooks import NonFiniteGuard, gradients_finite

__all__ = ["BackupAndRestore", "NonFiniteGuard", "PREEMPTION_EXIT_CODE", "Preempted",
           "PreemptionWatcher", "checkpoint_collectives", "gradients_finite", "load_sharded",
           "save_sharded"]
