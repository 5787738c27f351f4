"""Whether this process writes to a live terminal, its own or one the launcher relays to.

``replicator run`` relays workers' output through pipes (``isatty()`` is False), so it tells the
chief with ``TTY_COMPATIBLE=1`` (rich's variable) that its stdout ends on a terminal. Every live
display of the library asks :func:`is_live_terminal`, so they all agree.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

#: Set to "1" by the launcher for the chief whose relayed stdout reaches a terminal ("0"
#: forces plain output), as rich reads it.
TTY_COMPATIBLE_ENV = "TTY_COMPATIBLE"


def is_live_terminal(stream: IO[Any] | None = None) -> bool:
    """True when ``stream`` (default: standard output) shows a live terminal: it is one, or
    ``TTY_COMPATIBLE=1`` says the launcher relays it to one (``TTY_COMPATIBLE=0``: never)."""
    forced = os.environ.get(TTY_COMPATIBLE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
