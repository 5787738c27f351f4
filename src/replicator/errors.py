"""Exceptions raised by replicator, each with its cause and, where it helps, a fix: every error
class a user may catch (``rp.errors.X``) but the input pipeline's (:mod:`replicator.data`)."""

from __future__ import annotations

__all__ = ["ReplicatorError", "ClusterConfigError", "ReplicaTimeoutError",
           "ReplicaMismatchError", "CollectiveMismatchError", "WorkerFailedError",
           "PreemptedError", "NotDistributedError", "CallbackFailedError", "NonFiniteLossError",
           "CheckpointError", "CheckpointCorruptError", "UnsafeCheckpointError",
           "CheckpointWriteError", "ParameterServerError", "ParameterServerLostError",
           "ReplicaGroupFailedError", "LighthouseError"]


class ReplicatorError(RuntimeError):
    """Base class of every error replicator raises on purpose."""


class ClusterConfigError(ReplicatorError, ValueError):
    """The cluster description (environment, world size, devices, ports) is invalid."""


class ReplicaTimeoutError(ReplicatorError, TimeoutError):
    """A collective waited longer than its timeout for one or more replicas."""

    #: True once the message names the collective and the missing ranks (set by the
    #: collectives' error translation, so an outer translation keeps it as it is).
    named: bool = False


class ReplicaMismatchError(ReplicatorError, ValueError):
    """Replicas disagree on something that must be identical (model structure, call order)."""


class WorkerFailedError(ReplicatorError):
    """A worker process failed; carries its rank, exit code and traceback. Raised by the local
    launcher (``rp.launch``, ``replicator run``) in the parent process."""

    def __init__(self, rank: int, exitcode: int | None, message: str, traceback_text: str = "",
                 others: list[str] | None = None) -> None:
        self.rank, self.exitcode, self.message = rank, exitcode, message
        self.traceback_text, self.others = traceback_text, others or []
        lines = [f"rank {rank} failed (exit code {exitcode}): {message}"]
        if traceback_text:
            lines += ["", f"Traceback of rank {rank}:", traceback_text.rstrip()]
        if self.others:
            lines += ["", "Other ranks:"] + [f"  {line}" for line in self.others]
        super().__init__("\n".join(lines))


class CheckpointError(ReplicatorError):
    """A backup or checkpoint could not be written, found or read."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint failed verification (missing commit marker, wrong size or SHA-256), or no
    valid checkpoint is left to resume from."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint carries a payload that would run code when loaded (a pickle); refused."""


class CheckpointWriteError(CheckpointError):
    """Saving a checkpoint failed (for example a full disk); nothing was committed."""


class StorageURLError(CheckpointError, ValueError):
    """A storage URL names a scheme that is unknown or whose fsspec package is not installed."""


class StoreLeaseError(CheckpointError):
    """Another job holds the lease of a checkpoint location in an object store."""


class CallbackFailedError(ReplicatorError):
    """A callback raised on one or more replicas; raised on every replica (the Trainer's
    replicas agree on callback errors, so none is left waiting in the next collective)."""


class NonFiniteLossError(ReplicatorError, FloatingPointError):
    """The loss or the gradients became NaN or infinite; the optimizer step was not taken."""


class PreemptedError(WorkerFailedError):
    """The job was preempted (SIGTERM): the workers saved a backup and stopped. A launcher
    exits with ``exit_code`` (also ``exitcode``), 75 (``EX_TEMPFAIL``), so that the scheduler
    reruns the job, which then resumes from the backup."""

    def __init__(self, message: str, rank: int = 0, exit_code: int = 75) -> None:
        super().__init__(rank, exit_code, message)
        self.exit_code = exit_code
        self.args = (message,)


class CollectiveMismatchError(ReplicaMismatchError):
    """Replicas entered different collectives at the same point (another operation, shape,
    dtype or call count); ``calls`` maps each rank to its call and the user's call site."""

    def __init__(self, message: str, calls: dict[int, str] | None = None) -> None:
        self.calls = dict(calls or {})
        super().__init__(message)


class NotDistributedError(ReplicatorError):
    """Trainable parameters are used under a multi-replica strategy without having been
    distributed (built outside ``scope()`` and never passed to ``distribute_model``): each
    replica would silently train its own model."""


class ParameterServerError(ReplicatorError):
    """A parameter server refused a request (an optimizer it cannot build, an unknown
    variable, a staleness or input wait that timed out)."""


class ParameterServerLostError(ReplicatorError, ConnectionError):
    """A parameter server died or stopped answering; the message names the server, its rank
    and the variable shards it held."""


class ReplicaGroupFailedError(WorkerFailedError):
    """A replica group of a live-recovery job (``--replica-groups``) failed after its own
    restarts; ``group`` is its id, ``rank`` the failing rank inside it."""

    def __init__(self, group: int, failure: WorkerFailedError, restarts: int,
                 max_restarts: int) -> None:
        super().__init__(failure.rank, failure.exitcode, failure.message,
                         failure.traceback_text, failure.others)
        self.group, self.restarts = group, restarts
        self.args = (f"replica group {group} failed after {restarts} restart(s) "
                     f"(--max-restarts {max_restarts} per group): {self.args[0]}",)


class LighthouseError(ReplicatorError, ConnectionError):
    """torchft's lighthouse (the quorum service of replica groups) could not be started or
    reached, or stopped while the job ran."""
