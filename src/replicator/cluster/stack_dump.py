"""Every thread's stack from a worker that is still running when its launch is stopped.

A launch stopped from outside (a test's timeout, Ctrl-C) would otherwise lose what its workers
were doing, which is the one thing needed to find a hang. Each worker arms a handler for
:data:`STACK_DUMP_SIGNAL` at start that writes its threads' stacks to a file of its own (so
that two workers' stacks never interleave); the launcher sends the signal to the workers still
running before it stops them, and prints each file under the worker's rank.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO

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
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""
