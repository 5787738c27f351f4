"""Error files: how a worker tells the launcher why it died, that it finished normally (so a
waiting peer says so), which backup it committed (so a resume is suggested only then), and its
threads' stacks when the launch is stopped from outside (what finds a hang)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from replicator.cluster.env_names import ERROR_DIR_ENV, RESTART_COUNT_ENV


class ScriptNotFoundError(FileNotFoundError):
    """The script a worker was asked to run does not exist (a restart cannot fix it)."""


@dataclass
class WorkerError:
    rank: int
    type: str
    message: str
    traceback: str
    time: float
    #: The exception's class name and its base classes' names, most derived first.
    types: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


def error_path(error_dir: str | Path, rank: int, attempt: int = 0) -> Path:
    return Path(error_dir) / f"attempt{attempt}_rank{rank}.json"


_LAUNCHER_FRAMES = ("script_entry.py", "script_launch.py", "runpy")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip the launcher's own frames at the top of a worker's traceback."""
    while tb is not None and tb.tb_next is not None and any(
            name in tb.tb_frame.f_code.co_filename for name in _LAUNCHER_FRAMES):
        tb = tb.tb_next
    return tb


def record_exception(exc: BaseException, rank: int, path: str | Path) -> None:
    """Write ``exc`` for the launcher; never raises (a failing report must not hide the error)."""
    try:
        payload = {
            "rank": rank, "type": type(exc).__name__, "message": str(exc).strip(),
            "traceback": "".join(traceback.format_exception(type(exc), exc,
                                                            _user_frames(exc.__traceback__))),
            "time": time.time(),
            "types": [cls.__name__ for cls in type(exc).__mro__ if cls is not object],
        }
        _write_json(path, payload)
    except Exception:  # noqa: BLE001 - best effort by design
        pass


def _write_json(path: str | Path, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def read_error(path: str | Path) -> WorkerError | None:
    try:
        data = json.loads(Path(path).read_text())
        return WorkerError(rank=int(data["rank"]), type=str(data["type"]),
                           message=str(data["message"]), traceback=str(data["traceback"]),
                           time=float(data["time"]),
                           types=tuple(str(t) for t in data.get("types", [data["type"]])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class BackupNote:
    """A committed backup that a rerun would resume from."""

    directory: str
    step: int


def record_backup(directory: str | Path, step: int) -> None:
    """Note for the local launcher that ``directory`` holds a backup of ``step``; never raises."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir:
        return
    try:
        rank = int(os.environ.get("RANK", "0"))
        _write_json(Path(error_dir) / f"backup_rank{rank}.json",
                    {"directory": str(directory), "step": int(step)})
    except Exception:  # noqa: BLE001 - best effort by design
        pass


def read_backup(error_dir: str | Path, ranks: range) -> BackupNote | None:
    """The newest backup any of ``ranks`` noted, or ``None``."""
    notes = []
    for rank in ranks:
        try:
            data = json.loads((Path(error_dir) / f"backup_rank{rank}.json").read_text())
            notes.append(BackupNote(str(data["directory"]), int(data["step"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(notes, key=lambda n: n.step) if notes else None


def _finished_path(error_dir: str, rank: int) -> Path:
    """Rank ``rank``'s mark, in this attempt, that it finished its script normally."""
    try:
        attempt = int(os.environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        attempt = 0
    return Path(error_dir) / f"attempt{attempt}_rank{rank}.finished"


def record_finished(rank: int) -> None:
    """Note for the local launcher that ``rank`` finished its script normally; never raises."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir:
        return
    try:
        _finished_path(error_dir, rank).touch()
    except OSError:
        pass


def finished_peers(ranks: list[int]) -> list[int]:
    """Those of ``ranks`` that finished their script normally in this attempt."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    return [r for r in ranks if error_dir and _finished_path(error_dir, r).exists()]


#: The signal a launcher sends for the stacks (SIGUSR1 is left to schedulers' preemption notices).
STACK_DUMP_SIGNAL = signal.SIGUSR2

_armed: list[IO[str]] = []  # the open file the handler writes to, for the process's lifetime


def stack_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stacks-rank{rank}.txt")


def install_stack_dump(folder: str, rank: int) -> None:
    """On :data:`STACK_DUMP_SIGNAL`, write every thread's stack to this rank's file."""
    os.makedirs(folder, exist_ok=True)
    out = open(stack_path(folder, rank), "w")  # noqa: SIM115 - written by the signal handler
    _armed[:] = [out]
    faulthandler.register(STACK_DUMP_SIGNAL, file=out, all_threads=True, chain=False)


def read_stacks(folder: str, rank: int, timeout_s: float) -> str:
    """The stacks rank ``rank`` wrote after the signal (waits until the file stops growing)."""
    path, last, deadline = stack_path(folder, rank), -1, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size and size == last:
            break
        last = size
        time.sleep(0.1)
    return Path(path).read_text().strip() if os.path.exists(path) else ""
