"""Preemption: turn a SIGTERM on any rank into one agreed step at which every rank saves and stops.

The signal may reach one worker only: its handler sets a flag, and about every
``check_seconds`` the ranks combine flags and step times in one small ``MAX`` all-reduce, so
every rank stops at the same step and derives the same next check interval (in steps).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import torch

from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.comm.collectives import Collectives
from replicator.comm.reduce_op import ReduceOp

__all__ = ["PREEMPTION_EXIT_CODE", "Preempted", "PreemptionWatcher"]

#: The most steps between two checks, however fast the steps are.
MAX_CHECK_INTERVAL = 10_000


class Preempted(SystemExit):
    """Raised on every rank after the preemption backup was saved: a ``SystemExit`` with code
    75, so an uncaught one ends the process without a traceback."""

    def __init__(self, step: int, rank: int, path: str | None) -> None:
        self.step, self.rank, self.path = step, rank, path
        super().__init__(PREEMPTION_EXIT_CODE)

    def __str__(self) -> str:
        where = f"; backup saved at {self.path}" if self.path else ""
        return (f"rank {self.rank}: preempted (SIGTERM) after step {self.step}{where}; "
                f"exiting with code {PREEMPTION_EXIT_CODE}")


class PreemptionWatcher:
    """Catches the preemption signals and lets the ranks agree on when to stop: :meth:`install`
    and :meth:`uninstall` around training, :meth:`poll` once per step on every rank."""

    def __init__(self, collectives: Collectives, signals: tuple[int, ...] = (signal.SIGTERM,),
                 check_seconds: float = 1.0) -> None:
        if check_seconds < 0:
            raise ValueError(f"check_seconds must be >= 0, got {check_seconds}")
        self.collectives = collectives
        self.signals = signals
        self.check_seconds = check_seconds
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._interval = 1
        self._countdown = 1
        self._last_check: float | None = None

    def install(self) -> bool:
        """Install the handler (main thread only); returns False where that is impossible."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = True
            print(f"[replicator] rank {self.collectives.rank}: received "
                  f"{signal.Signals(signum).name}; the ranks will agree on a step, save a backup"
                  " and stop", file=sys.stderr, flush=True)
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def request(self) -> None:
        """Ask for a preemption stop from code (same effect as the signal)."""
        self.requested = True

    def poll(self) -> bool:
        """True on every rank, at the same step, once any rank asked to stop."""
        coll = self.collectives
        if coll.world_size == 1:
            return self.requested
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now = time.perf_counter()
        step_time = ((now - self._last_check) / self._interval
                     if self._last_check is not None else 0.0)
        local = torch.tensor([1.0 if self.requested else 0.0, step_time],
                             dtype=torch.float64)
        flag, slowest = coll.all_reduce(local, ReduceOp.MAX, "preemption check").tolist()
        if flag > 0:
            return True
        self._interval = 1 if self.check_seconds == 0 or slowest <= 0 else int(
            min(MAX_CHECK_INTERVAL, max(1, self.check_seconds // slowest)))
        self._countdown = self._interval
        self._last_check = time.perf_counter()
        return False
