"""Error files: how a worker tells the launcher why it died (rank, exception, traceback, time)."""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

ERROR_DIR_ENV = "REPLICATOR_ERROR_DIR"


@dataclass
class WorkerError:
    rank: int
    type: str
    message: str
    traceback: str
    time: float

    @property
    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


def error_path(error_dir: str | Path, rank: int, attempt: int = 0) -> Path:
    return Path(error_dir) / f"attempt{attempt}_rank{rank}.json"


_LAUNCHER_FRAMES = ("script_entry.py", "function_launch.py", "runpy")


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
        }
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - best effort by design
        pass


def read_error(path: str | Path) -> WorkerError | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return WorkerError(rank=int(data["rank"]), type=str(data["type"]),
                           message=str(data["message"]), traceback=str(data["traceback"]),
                           time=float(data["time"]))
    except (OSError, ValueError, KeyError):
        return None
