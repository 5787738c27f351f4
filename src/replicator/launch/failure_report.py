"""Why an attempt failed: the root cause first, the other ranks as its consequences.

An error that only says a peer vanished is never the root while another rank failed by itself
(a killed server's workers write theirs before its end is seen); among the rest the earliest
wins. One with no failed peer waited for a rank that finished: a collective on some ranks only.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.cluster.worker_errors import BackupNote, WorkerError
from replicator.errors import WorkerFailedError

#: Words of the errors of a rank whose peer vanished (comm/groups.py, comm/shm_segment.py).
CONSEQUENCE_PHRASES = ("because another replica exited or lost its connection",
                       "exited while the others waited for it",
                       # a peer that finished normally (comm/groups.finished_peer_error)
                       "script normally (exit code 0) while rank",
                       # a coordinator's function failed on a worker that lost its server
                       "ParameterServerLostError: parameter server")
#: Exception types raised because a peer vanished (a worker losing its parameter server, or
#: the chief that closed its connection after failing itself).
CONSEQUENCE_TYPES = ("ParameterServerLostError", "PeerLostError")
#: How much of another rank's error the summary repeats (its error file keeps the whole).
OTHER_ERROR_CHARS = 200


#: Exception types (or their bases) that a restart only repeats (the same steps, code or
#: import), and why: restarting them wastes the budget and hides the cause.
REPEATING_FAILURES: dict[str, str] = {
    "NonFiniteLossError": "the restart replays the same steps from the last backup",
    "ReplicaMismatchError": "the replicas run the same code again",
    "CollectiveMismatchError": "the replicas run the same code again",
    "SyntaxError": "the script does not compile",
    "ImportError": "the same import fails again",
    "ScriptNotFoundError": "the script file does not exist",
}


def restart_refusal(error_types: Iterable[str]) -> str | None:
    """Why a restart cannot help a failure of ``error_types`` (class and bases), else ``None``."""
    names = list(error_types)
    why = next((REPEATING_FAILURES[name] for name in names if name in REPEATING_FAILURES), None)
    return None if why is None else f"not restarting: {names[0]} repeats on restart ({why})"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"ranks 0, 2-4, 7"``; one rank -> ``"rank 5"``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    spans = []  # runs of consecutive ranks: "3", "3, 4", "3-5"
    for _, run in itertools.groupby(enumerate(ordered), lambda pair: pair[1] - pair[0]):
        members = [r for _, r in run]
        first, last = members[0], members[-1]
        spans.append(str(first) if first == last else
                     f"{first}, {last}" if last == first + 1 else f"{first}-{last}")
    return "ranks " + ", ".join(spans)


def group_by_rank(details: Mapping[int, str], min_group: int = 3) -> list[str]:
    """One line per rank, ``min_group`` or more ranks with one text on one line (``ranks 2-98``)."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(details):
        by_text.setdefault(details[rank], []).append(rank)
    entries: list[tuple[int, str]] = []
    for text, ranks in by_text.items():
        if len(ranks) >= min_group:
            entries.append((ranks[0], f"{rank_ranges(ranks)}: {text}"))
        else:
            entries += [(r, f"rank {r}: {text}") for r in ranks]
    return [line for _, line in sorted(entries)]


def clip(text: str, limit: int = OTHER_ERROR_CHARS) -> str:
    """The first line of ``text``, cut at a word boundary within ``limit`` with ``...``."""
    line = text.splitlines()[0] if text else ""
    if len(line) <= limit:
        return line
    cut = line[:limit - 3]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "..."


def describe_exit(code: int | None) -> str:
    """``exit code 1``, ``killed by SIGKILL``, ``exit code 75 (preempted; backup saved)``."""
    if code is None:
        return "still running"
    if code == PREEMPTION_EXIT_CODE:
        return f"exit code {code} (preempted; backup saved)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def describe_codes(codes: dict[int, int | None]) -> str:
    """Every rank's end in one line, ranks with the same end grouped."""
    return ", ".join(group_by_rank({r: describe_exit(c) for r, c in codes.items()}))


def resume_hint(note: BackupNote | None, codes: dict[int, int | None]) -> str:
    """What a rerun does: resume from a committed backup, or start over without one."""
    if note is not None:
        return (f"Rerun the same command to resume from the backup (step {note.step} in "
                f"{note.directory}).")
    if any(c == PREEMPTION_EXIT_CODE for c in codes.values()):
        return "Rerun the same command to resume from the backup."
    return ("No backup was saved (the script uses no BackupAndRestore, or it had not saved "
            "yet): a rerun starts from the beginning.")


@dataclass
class RankEnd:
    """How one rank of a failed attempt ended, as the launcher saw it."""

    rank: int
    code: int | None                 # exit code; None: still running when the launcher stopped
    seen_at: float | None            # when the launcher saw it end (time.time())
    error: WorkerError | None = None  # its error file, if it raised
    terminated: bool = False         # stopped by the launcher after the failure

    @property
    def failed(self) -> bool:
        return not self.terminated and self.code not in (None, 0)

    @property
    def consequence(self) -> bool:
        """Its error only says that a peer vanished."""
        err = self.error
        return err is not None and (any(p in err.message for p in CONSEQUENCE_PHRASES)
                                    or any(t in CONSEQUENCE_TYPES for t in err.types))

    def time(self) -> float:
        times = [t for t in (self.error.time if self.error else None, self.seen_at)
                 if t is not None]
        return min(times) if times else float("inf")


def root_of(ends: list[RankEnd], first: int) -> RankEnd:
    """The rank whose failure the others followed (``first``: the first the launcher saw)."""
    failed = [e for e in ends if e.failed]
    if not failed:
        return next(e for e in ends if e.rank == first)
    return min(failed, key=lambda e: (e.consequence, e.time(), e.rank))


# -- a rank that finished while the others waited ----------------------------------------------
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_NAMED_PEER = re.compile(r"rank (\d+) \(pid \d+\) exited while the others waited|"
                         r"because rank (\d+) finished its script normally")


def _library_dirs() -> tuple[str, ...]:
    import torch

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/
    dirs = [package, os.path.dirname(torch.__file__),
            sysconfig.get_paths()["stdlib"]]
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def call_site(traceback_text: str) -> tuple[str, str] | None:
    """``(call, "script.py:7")``: the user's last frame in a traceback and what it called."""
    frames = [m for m in map(_FRAME.match, traceback_text.splitlines()) if m]
    library = _library_dirs()

    def is_library(path: str) -> bool:
        return path.startswith("<") or os.path.realpath(path).startswith(library)

    for i in range(len(frames) - 1, 0, -1):
        if is_library(frames[i]["path"]) and not is_library(frames[i - 1]["path"]):
            user = frames[i - 1]
            return frames[i]["func"], f"{user['path']}:{user['line']}"
    return None


def finished_while_waiting(root: RankEnd, ends: list[RankEnd]) -> str | None:
    """The explanation when ``root`` waited for ranks that exited normally (else ``None``)."""
    if not root.consequence or any(e.failed and e is not root for e in ends):
        return None
    done = [e.rank for e in ends if e.code == 0 and not e.terminated]
    named = _NAMED_PEER.search(root.error.message) if root.error else None
    peer = int(named.group(1) or named.group(2)) if named else -1
    if peer in done:
        done = [peer]
    if not done:
        return None
    who = "rank" if len(done) == 1 else "ranks"
    site = call_site(root.error.traceback) if root.error else None
    where = f" in `{site[0]}` at {site[1]}" if site else " in a collective"
    return (f"{who} {', '.join(map(str, done))} finished {'its' if len(done) == 1 else 'their'}"
            f" script normally (exit code 0) while rank {root.rank} waited for "
            f"{'it' if len(done) == 1 else 'them'}{where}. The likely cause: a collective "
            "called on some ranks only (for example under `if strategy.is_chief:`). HINT: "
            "every rank must make the same collective calls in the same order; call it on "
            "every rank and use the result on the chief only.")


# -- the summary -------------------------------------------------------------------------------
def failure_for(ends: list[RankEnd], first: int, role: Callable[[int], str],
                note: BackupNote | None) -> tuple[WorkerFailedError, tuple[str, ...]]:
    """The :class:`WorkerFailedError` of a failed attempt and its root's exception types;
    ``role(rank)`` names a rank's role (``""``: a worker), ``note`` is the committed backup."""
    root = root_of(ends, first)
    err = root.error
    named = f"{role(root.rank)} (rank {root.rank})" if role(root.rank) else f"rank {root.rank}"
    message = finished_while_waiting(root, ends)
    if message is None:
        message = err.summary if err else describe_exit(root.code)
        if err is None and role(root.rank):
            message = f"{role(root.rank)} was {describe_exit(root.code)}"
    after = (f"after {named} was {describe_exit(root.code)}"
             if err is None and root.code is not None and root.code < 0
             else f"after rank {root.rank} failed")
    details: dict[int, str] = {}
    for e in ends:
        if e is root:
            continue
        if e.terminated:
            details[e.rank] = f"terminated by the launcher {after}"
        elif e.failed:
            text = e.error.summary if e.error else describe_exit(e.code)
            if e.error is None and role(e.rank):
                text = f"{role(e.rank)}, {text}"
            details[e.rank] = f"{clip(text)} ({after})"
    types = err.types if err else ()
    if note is not None and restart_refusal(types) is None:
        message += "\n" + resume_hint(note, {})
    failure = WorkerFailedError(root.rank, root.code, message, err.traceback if err else "",
                                group_by_rank(details))
    return failure, types
