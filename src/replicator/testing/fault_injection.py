"""Fault injection for tests: kill, stop, fail or delay a rank at a step, kill a rank in the
middle of a save, damage the newest checkpoint. Call a step fault at the top of each step::

    kill = rp.testing.kill_rank(1, at_step=37)          # SIGKILL rank 1 once, at step 37
    for step, batch in backup.steps(dist_dataset, num_steps=100):
        kill(step)
        ...

"Once": on the first attempt only (restart count 0), so a restarted group runs through;
``once=False`` fires on every attempt."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from replicator import fault_points
from replicator.checkpoint.manifest import MARKER_NAME
from replicator.cluster.environment import resolve_cluster


def _attempt() -> int:
    return resolve_cluster().restart_count


class Fault:
    """An action that fires on ``rank`` when called with ``step == at_step``."""

    def __init__(self, action: Callable[[], None], rank: int, at_step: int, once: bool,
                 description: str, on_fire: Callable[[], None] | None = None) -> None:
        if at_step < 1:
            raise ValueError(f"at_step counts steps from 1, got {at_step}")
        self.action, self.rank, self.at_step, self.once = action, rank, at_step, once
        self.description, self.on_fire = description, on_fire

    def applies(self) -> bool:
        """True on the rank and attempt where this fault fires."""
        return resolve_cluster().rank == self.rank and (not self.once or _attempt() == 0)

    def __call__(self, step: int) -> None:
        if step != self.at_step or not self.applies():
            return
        print(f"[replicator.testing] rank {self.rank}: {self.description} at step {step} "
              f"(attempt {_attempt()})", file=sys.stderr, flush=True)
        if self.on_fire is not None:
            self.on_fire()
        self.action()

    def __repr__(self) -> str:
        when = "first attempt" if self.once else "every attempt"
        return f"Fault({self.description}, rank={self.rank}, at_step={self.at_step}, {when})"


def _signal_self(sig: int) -> Callable[[], None]:
    def action() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
        if sig == signal.SIGKILL:  # pragma: no cover - never returns
            time.sleep(60)

    return action


def kill_rank(rank: int, at_step: int, *, once: bool = True, sig: int = signal.SIGKILL,
              on_fire: Callable[[], None] | None = None) -> Fault:
    """Kill rank ``rank`` with ``sig`` (default SIGKILL: no cleanup, like a lost machine)."""
    return Fault(_signal_self(sig), rank, at_step, once,
                 f"killing itself with {signal.Signals(sig).name}", on_fire)


def terminate_rank(rank: int, at_step: int, *, once: bool = True) -> Fault:
    """Send SIGTERM to rank ``rank`` (a preemption notice) and let training go on."""
    return Fault(_signal_self(signal.SIGTERM), rank, at_step, once, "sending itself SIGTERM")


def fail_rank(rank: int, at_step: int, *, once: bool = False,
              message: str = "injected failure") -> Fault:
    """Raise ``RuntimeError(message)`` on rank ``rank`` (default: on every attempt)."""
    def action() -> None:
        raise RuntimeError(f"{message} (rank {rank}, step {at_step})")

    return Fault(action, rank, at_step, once, f"raising RuntimeError({message!r})")


def delay_rank(rank: int, at_step: int, seconds: float, *, once: bool = True) -> Fault:
    """Stall rank ``rank`` for ``seconds`` (a hang, if longer than the collective timeout)."""
    return Fault(lambda: time.sleep(seconds), rank, at_step, once, f"sleeping {seconds:g} s")


def kill_during_save(rank: int = 0, at_step: int | None = None, *,
                     once: bool = True) -> Callable[[], None]:
    """SIGKILL rank ``rank`` in the save of ``at_step`` (any when None) after the data files,
    before the commit marker (the chief's, ``rank=0``). Returns a function removing the hook."""
    target_rank = rank

    def hook(step: int, path: Path, rank: int) -> None:
        if rank != target_rank or at_step not in (None, step) or (once and _attempt() != 0):
            return
        print(f"[replicator.testing] rank {rank}: killing itself during the save of step {step}"
              f" (files written, no commit marker yet)", file=sys.stderr, flush=True)
        _signal_self(signal.SIGKILL)()

    return fault_points.add_hook("before_commit", hook)


def latest_checkpoint(backup_dir: str | os.PathLike[str]) -> Path:
    """The newest committed step directory in ``backup_dir``."""
    dirs = sorted(p for p in Path(backup_dir).glob("step-*") if (p / MARKER_NAME).exists())
    if not dirs:
        raise FileNotFoundError(f"no committed checkpoint in {backup_dir}")
    return dirs[-1]


def corrupt_latest_checkpoint(backup_dir: str | os.PathLike[str], mode: str = "flip",
                              file: str | None = None) -> Path:
    """Damage the newest committed checkpoint's ``file`` (default: the largest data file) and
    return it: ``mode="flip"`` inverts a middle byte, ``"truncate"`` halves it, ``"delete"``."""
    step_dir = latest_checkpoint(backup_dir)
    target = step_dir / file if file is not None else max(
        (p for p in step_dir.iterdir() if p.name != MARKER_NAME and p.is_file()),
        key=lambda p: p.stat().st_size)
    if mode == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif mode == "truncate":
        os.truncate(target, target.stat().st_size // 2)
    elif mode == "delete":
        target.unlink()
    else:
        raise ValueError(f"unknown mode {mode!r}; use 'flip', 'truncate' or 'delete'")
    return target
