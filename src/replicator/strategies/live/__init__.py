"""Live recovery across replica groups on torchft: a per-step quorum, gradients averaged across
its groups, steps redone when not committed, healing from a live peer. torchft is imported only
when the job runs replica groups (``pip install replicator[live]``). Its errors name the group
and rank.
"""

from replicator.errors import ReplicaMismatchError, ReplicaTimeoutError, ReplicatorError
from replicator.strategies.live.settings import LiveSettings

__all__ = ["LiveSettings", "LiveRecoveryError", "LighthouseUnreachableError",
           "QuorumTimeoutError", "ReplicaGroupMismatchError", "EpochLoopError"]


class LiveRecoveryError(ReplicatorError):
    """Live recovery across replica groups cannot go on (the message names group and rank)."""


class LighthouseUnreachableError(LiveRecoveryError, ConnectionError):
    """The torchft lighthouse given in ``REPLICATOR_LIGHTHOUSE`` does not answer."""


class QuorumTimeoutError(LiveRecoveryError, ReplicaTimeoutError):
    """No quorum of at least ``--min-replicas`` groups formed within the quorum timeout."""


class ReplicaGroupMismatchError(LiveRecoveryError, ReplicaMismatchError):
    """A replica group built a model (or input) that differs from its peers'."""


class EpochLoopError(LiveRecoveryError):
    """A healed group cannot learn the script's own epoch counter from a peer."""


class StepNotCommitted(Exception):  # noqa: N818 - control flow, never reaches the user
    """Raised in a step not committed across the quorum; ``strategy.run`` redoes it."""
