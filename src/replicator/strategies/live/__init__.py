"""Live recovery across replica groups on torchft: a per-step quorum, gradients averaged across
the groups of each step's quorum, steps redone when not committed, healing from a live peer.

``engine.py`` holds the per-step protocol, ``dataset.py`` the exact data split per quorum,
``state.py`` what a healing group receives, ``transport.py`` torchft's checkpoint transport
bound to one address, ``settings.py`` the environment, ``errors.py`` the errors. torchft is
imported only when the job runs replica groups (``pip install replicator[live]``).
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
