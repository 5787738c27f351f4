"""Exit codes with a meaning that the launcher and the workers agree on.

``PREEMPTION_EXIT_CODE`` is 75, ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure; the user
is invited to retry"): a worker that received SIGTERM, agreed on a step with the other ranks and
saved a backup exits with it, so a launcher or a scheduler can tell a clean preemption from a
crash. The launcher exits with the same code when the whole job was preempted.
"""

from __future__ import annotations

PREEMPTION_EXIT_CODE = 75

__all__ = ["PREEMPTION_EXIT_CODE"]
