"""Turn a backend failure inside an algorithm into an error naming the rank and the operation."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from replicator.cluster.worker_errors import finished_peers
from replicator.errors import ReplicaTimeoutError, ReplicatorError

TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
LOST_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused",
                   "socket closed", "end of file")


def finished_peer_error(what: str, rank: int, peers: Iterable[int] | None = None
                        ) -> ReplicatorError | None:
    """An error saying a peer of ``rank`` in ``what`` finished its script normally (exit code 0),
    or ``None``."""
    if peers is None:
        peers = range(int(os.environ.get("WORLD_SIZE", "1")))
    done = finished_peers([p for p in peers if p != rank])
    if not done:
        return None
    one = len(done) == 1
    who = f"rank {done[0]}" if one else "ranks " + ", ".join(map(str, done))
    return ReplicatorError(
        f"{what} on rank {rank} failed because {who} finished {'its' if one else 'their'} "
        f"script normally (exit code 0) while rank {rank} waited for {'it' if one else 'them'}."
        " The likely cause: a collective called on some ranks only (for example under `if "
        "strategy.is_chief:`). HINT: every rank must make the same collective calls in the "
        "same order; call it on every rank and use the result on the chief only.")


def algorithm_error(exc: BaseException, rank: int, what: str,
                    peers: Iterable[int] | None = None) -> BaseException:
    """``exc`` raised in ``what`` on ``rank`` as a :class:`ReplicatorError` with a hint
    (replicator's, type and value errors pass)."""
    if isinstance(exc, (ReplicatorError, TypeError, ValueError)) or not isinstance(exc, Exception):
        return exc
    first = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).splitlines() or [""])[0])[:200]
    text = str(exc).lower()
    if any(w in text for w in TIMEOUT_WORDS):
        return ReplicaTimeoutError(
            f"{what} on rank {rank} timed out waiting for another replica ({first}). HINT: a "
            "rank may be on another code path or stuck; every rank must make the same "
            "collective calls in the same order.")
    if any(w in text for w in LOST_PEER_WORDS):
        return finished_peer_error(what, rank, peers) or ReplicatorError(
            f"{what} on rank {rank} failed because another replica exited or lost its "
            f"connection ({first}). HINT: look for that rank's own error; the launcher reports "
            "the first failure.")
    return ReplicatorError(f"{what} failed on rank {rank}: {exc}")
