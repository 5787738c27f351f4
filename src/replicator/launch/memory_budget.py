"""How many local workers this machine's memory holds, checked before any worker starts: a
worker is an interpreter with torch (300 MB resident; the digits demo peaks at 410 MB), and more
workers than memory holds do not fail cleanly (the out-of-memory killer picks any process), so
``replicator run`` refuses them unless ``--force``."""

from __future__ import annotations

import os
from pathlib import Path

#: Resident memory a worker needs at least (an interpreter with torch and a small model).
WORKER_BYTES = 300 * 1024 ** 2
_GB = 1024 ** 3


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_available() -> int | None:
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _cgroup_left(root: str = "/sys/fs/cgroup") -> int | None:
    """What a cgroup v2 memory limit leaves (``None``: no limit)."""
    try:
        limit = Path(root, "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path(root, "memory.current").read_text().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_memory() -> tuple[int, str] | None:
    """``(bytes available, where that figure comes from)``, or ``None`` when unknown."""
    meminfo = _meminfo_available()
    figures = [(meminfo, "MemAvailable in /proc/meminfo") if meminfo is not None
               else (_sysconf_available(), "available physical pages, os.sysconf"),
               (_cgroup_left(), "what the container's cgroup memory.max leaves")]
    known = [(value, source) for value, source in figures if value is not None]
    return min(known) if known else None


def memory_refusal(nproc: int, available: tuple[int, str] | None,
                   per_worker: int = WORKER_BYTES) -> str | None:
    """The error for ``nproc`` workers that ``available`` memory cannot hold, else ``None``."""
    if available is None:
        return None
    free, source = available
    need = nproc * per_worker
    if need <= free:
        return None
    fits = free // per_worker
    advice = f"use --nproc {fits} or fewer" if fits >= 1 else "free some memory first"
    return (f"--nproc {nproc} needs about {need / _GB:.1f} GB ({nproc} workers x "
            f"~{per_worker / 1024 ** 2:.0f} MB each: an interpreter with torch and a small "
            f"model), but only {free / _GB:.1f} GB is available ({source}), which holds "
            f"{fits} worker(s); more would be ended by the out-of-memory killer. HINT: "
            f"{advice}, or add --force to start them anyway.")
