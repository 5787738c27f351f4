"""The library's helper threads (named ``replicator-<what>``) are waited for at exit: a daemon
thread inside torch's C++ code at finalization is ended by ``pthread_exit``, whose unwinding
aborts a finished job with SIGABRT. The handler is registered when ``replicator`` is first
imported, so that it runs after every other exit handler of the library (last in, first out).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

#: The prefix of the library's helper threads' names.
HELPER_THREAD_PREFIX = "replicator-"
#: Longest wait, at exit, for the helper threads to finish what they are doing.
EXIT_WAIT_SECONDS = 60.0

#: Whether this process created a process group (only then are there helpers to wait for).
_WAIT = [False]


def _helper_threads(prefix: str) -> list[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threading.enumerate()
            if t is not me and t.is_alive() and t.name.startswith(prefix)]


def join_helper_threads(timeout: float, prefix: str = HELPER_THREAD_PREFIX) -> list[str]:
    """Wait (at most ``timeout`` s) for the threads named ``prefix...``; those still running."""
    deadline = time.monotonic() + timeout
    for thread in _helper_threads(prefix):
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in _helper_threads(prefix)]


def wait_at_exit() -> None:
    """Make this process wait for its helper threads at exit (a process group now exists)."""
    _WAIT[0] = True


def _wait_for_helpers_at_exit() -> None:
    if not _WAIT[0]:
        return
    left = join_helper_threads(EXIT_WAIT_SECONDS)
    if left:
        print(f"[replicator] warning: helper thread(s) {', '.join(left)} still running "
              f"{EXIT_WAIT_SECONDS:g} s after the script ended; the interpreter may abort when "
              "they return.", file=sys.stderr, flush=True)


atexit.register(_wait_for_helpers_at_exit)
