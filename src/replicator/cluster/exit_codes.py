"""Exit codes with a meaning that the launcher and the workers agree on.

``PREEMPTION_EXIT_CODE`` is 75 (``EX_TEMPFAIL``, "retry"): a worker that got SIGTERM, agreed
on a step and saved a backup exits with it, so a scheduler tells a clean preemption from a
crash; the launcher exits with it when the whole job was preempted.
"""

from __future__ import annotations

PREEMPTION_EXIT_CODE = 75

__all__ = ["PREEMPTION_EXIT_CODE"]
