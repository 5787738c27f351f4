"""Live recovery across replica groups on torchft: a per-step quorum, gradients averaged across
its groups, steps redone when not committed, healing from a live peer. torchft is imported only
when the job runs replica groups (``pip install replicator[live]``).
"""

from replicator.strategies.live.errors import (
    EpochLoopError,
    LighthouseUnreachableError,
    LiveRecoveryError,
    QuorumTimeoutError,
    ReplicaGroupMismatchError,
)
from replicator.strategies.live.settings import LiveSettings

__all__ = ["LiveSettings", "LiveRecoveryError", "LighthouseUnreachableError",
           "QuorumTimeoutError", "ReplicaGroupMismatchError", "EpochLoopError"]
