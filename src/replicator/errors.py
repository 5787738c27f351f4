"""Exceptions raised by replicator: each carries the cause and, where it helps, a fix."""

from __future__ import annotations


class ReplicatorError(RuntimeError):
    """Base class of every error replicator raises on purpose."""


class ClusterConfigError(ReplicatorError, ValueError):
    """The cluster description (environment, world size, devices, ports) is invalid."""


class ReplicaTimeoutError(ReplicatorError, TimeoutError):
    """A collective waited longer than its timeout for one or more replicas."""


class ReplicaMismatchError(ReplicatorError, ValueError):
    """Replicas disagree on something that must be identical (model structure, call order)."""


class WorkerFailedError(ReplicatorError):
    """A worker process failed; carries its rank, exit code and traceback.

    Raised by the local launcher (``rp.launch``, ``replicator run``) in the parent process.
    """

    def __init__(self, rank: int, exitcode: int | None, message: str, traceback_text: str = "",
                 others: list[str] | None = None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.message = message
        self.traceback_text = traceback_text
        self.others = others or []
        lines = [f"rank {rank} failed (exit code {exitcode}): {message}"]
        if traceback_text:
            lines += ["", f"Traceback of rank {rank}:", traceback_text.rstrip()]
        if self.others:
            lines += ["", "Other ranks:"] + [f"  {line}" for line in self.others]
        super().__init__("\n".join(lines))
