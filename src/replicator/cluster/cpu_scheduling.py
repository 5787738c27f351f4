"""Batch CPU scheduling for processes that outnumber their cores and wake each other often: by
default a process that wakes another on a busy core is preempted by it, so parameter servers
meant to answer at once take turns; ``SCHED_BATCH`` lets each go on until it blocks (1-22% more
steps per second on 2 cores, docs/parameter_server.md). Applied when the processes outnumber the
cores; ``REPLICATOR_CPU_SCHEDULING=batch`` forces it, ``default`` keeps the system's."""

from __future__ import annotations

import os
import sys

from replicator.cluster.env_names import CPU_SCHEDULING_ENV

CHOICES = ("auto", "batch", "default")


def usable_cores() -> int:
    """Cores this process may run on (its affinity), or the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def wanted(local_processes: int, choice: str | None = None) -> bool:
    """Whether batch scheduling applies to ``local_processes`` on this host (``choice``: the
    environment's by default)."""
    raw = choice if choice is not None else os.environ.get(CPU_SCHEDULING_ENV, "auto")
    value = raw.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{CPU_SCHEDULING_ENV}={raw!r} is not one of {', '.join(CHOICES)}")
    return local_processes > usable_cores() if value == "auto" else value == "batch"


def use_batch_scheduling(local_processes: int, announce: bool = False) -> bool:
    """Put every thread of this process under ``SCHED_BATCH`` when :func:`wanted` says so
    (threads started later inherit it); True when it is in effect. ``announce``: say so once."""
    if not wanted(local_processes) or not hasattr(os, "sched_setscheduler"):
        return False
    policy, param = os.SCHED_BATCH, os.sched_param(0)
    applied = False
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, policy, param)
            applied = applied or os.sched_getscheduler(tid) == policy
        except OSError:  # a thread that ended meanwhile, or a policy the system refuses
            continue
    if applied and announce:
        print(f"[replicator] {local_processes} processes share {usable_cores()} cores: they "
              f"run under SCHED_BATCH (no preemption at wake-up; {CPU_SCHEDULING_ENV}=default "
              "keeps the system's policy)", file=sys.stderr, flush=True)
    return applied
