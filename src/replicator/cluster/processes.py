"""Whether a process on this host is still running (for files and leases a process owns)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs here (a zombie counts as gone, another user's as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): the signal said it exists


__all__ = ["process_alive"]
