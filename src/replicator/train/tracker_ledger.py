"""What a logger has already sent to its tracker, so that a resumed run sends no step twice.

A worker dying at step 37 after the backup of step 32 has sent 33 to 37, which the exact resume
replays, and trackers cannot delete a point. So the chief keeps a ledger beside the backups
(``<backup_dir>/trackers/<name>.json``, rewritten atomically per send) and a resume skips up to
the later of ledger and backup. W&B writes later, from its own process, so it is asked instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The folder under a backup directory that holds the ledgers.
LEDGER_DIR = "trackers"


class TrackerLedger:
    """The last global step and epoch whose metrics a logger sent to its run."""

    def __init__(self) -> None:
        #: Highest global step whose batch metrics were sent (0: none).
        self.step = 0
        #: Highest epoch (0-based) whose epoch metrics were sent (-1: none).
        self.epoch = -1
        self._path: Path | None = None

    def state(self) -> dict[str, int]:
        """For the logger's ``state_dict`` (what a backup holds)."""
        return {"step": self.step, "epoch": self.epoch}

    def attach(self, trainer: Any, name: str | None, state: dict[str, Any] | None) -> None:
        """Start from a backup's ``state`` (None: a fresh run) and, on the chief, keep the
        ledger ``name`` (None: none) in the trainer's backup directory (if it has a
        ``BackupAndRestore``), taking whatever it records beyond the backup into account."""
        self.step, self.epoch = 0, -1
        if state is not None:
            self.step, self.epoch = int(state.get("step", 0)), int(state.get("epoch", -1))
        backup = getattr(trainer, "backup", None)
        backup_dir = None if backup is None else backup.backup_dir
        self._path = None if backup_dir is None or name is None else \
            Path(backup_dir) / LEDGER_DIR / f"{name}.json"
        if state is None or self._path is None:
            return
        try:
            recorded = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return  # none yet (nothing sent since the backup), or torn by a crash
        self.step = max(self.step, int(recorded.get("step", 0)))
        self.epoch = max(self.epoch, int(recorded.get("epoch", -1)))

    def wants_step(self, step: int) -> bool:
        return step > self.step

    def wants_epoch(self, epoch: int) -> bool:
        return epoch > self.epoch

    def sent(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Record a send (call after the tracker accepted it)."""
        if step is not None:
            self.step = max(self.step, step)
        if epoch is not None:
            self.epoch = max(self.epoch, epoch)
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.state()))
        os.replace(tmp, self._path)

    def close(self) -> None:
        """Training completed: remove the ledger (and its folder once empty)."""
        if self._path is None:
            return
        self._path.unlink(missing_ok=True)
        try:
            self._path.parent.rmdir()
        except OSError:
            pass  # other loggers' ledgers are still there
        self._path = None
