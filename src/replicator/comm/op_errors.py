"""Turn a backend failure inside an algorithm into an error naming the rank and the operation."""

from __future__ import annotations

from replicator.errors import ReplicaTimeoutError, ReplicatorError

TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
LOST_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused",
                   "socket closed", "end of file")


def algorithm_error(exc: BaseException, rank: int, what: str) -> BaseException:
    """``exc`` (raised during ``what`` on ``rank``) as a :class:`ReplicatorError` with a hint.

    Errors that are already replicator's own, and programming errors (``TypeError``,
    ``ValueError``), pass through unchanged.
    """
    if isinstance(exc, (ReplicatorError, TypeError, ValueError)):
        return exc
    if not isinstance(exc, Exception):
        return exc
    first = (str(exc).splitlines() or [""])[0][:200]
    text = str(exc).lower()
    if any(w in text for w in TIMEOUT_WORDS):
        return ReplicaTimeoutError(
            f"{what} on rank {rank} timed out waiting for another replica ({first}). HINT: a "
            "rank may be on another code path or stuck; every rank must make the same "
            "collective calls in the same order.")
    if any(w in text for w in LOST_PEER_WORDS):
        return ReplicatorError(
            f"{what} on rank {rank} failed because another replica exited or lost its "
            f"connection ({first}). HINT: look for that rank's own error; the launcher reports "
            "the first failure.")
    return ReplicatorError(f"{what} failed on rank {rank}: {exc}")
