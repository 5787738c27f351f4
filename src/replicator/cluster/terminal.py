"""Whether this process writes to a live terminal, its own or one the launcher relays to (the
launcher says so with rich's ``TTY_COMPATIBLE=1``); every live display of the library asks."""

from __future__ import annotations

import os
import sys
from typing import IO, Any

#: Set to "1" by the launcher for the chief whose relayed stdout reaches a terminal ("0"
#: forces plain output), as rich reads it.
TTY_COMPATIBLE_ENV = "TTY_COMPATIBLE"


def is_live_terminal(stream: IO[Any] | None = None) -> bool:
    """True when ``stream`` (stdout) is a terminal or ``TTY_COMPATIBLE`` says so."""
    forced = os.environ.get(TTY_COMPATIBLE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return isatty(sys.stdout if stream is None else stream)


def isatty(stream: Any) -> bool:
    """``stream.isatty()``, False for a stream without one or a closed one."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
