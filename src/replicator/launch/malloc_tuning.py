"""Keep a training step's large CPU buffers in the heap instead of new pages every step.

glibc serves a request above its mmap threshold (at most 32 MB) with fresh pages and gives
them back on ``free``, so a CPU step that frees and reallocates the same activations faults
them in again: with a 57k-parameter CNN, 18-23% of the step was kernel time; with the
thresholds raised (``mallopt``, the gist of jemalloc/tcmalloc in PyTorch's CPU tuning guides)
it took 28 ms instead of 34-37. The launchers apply it in every worker (a process then holds
its peak memory); ``REPLICATOR_MALLOC=default`` or glibc's ``MALLOC_*_`` keep glibc's choice.
"""

from __future__ import annotations

import ctypes
import os
import platform

from replicator.cluster.env_names import MALLOC_ENV

__all__ = ["CHOICES", "MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "tune_malloc"]

CHOICES = ("auto", "default")

#: Requests up to this size come from the heap (glibc's default rises to 32 MB at most).
MMAP_THRESHOLD = 256 << 20
#: The heap's free top goes back to the kernel only past this.
TRIM_THRESHOLD = 1 << 30
#: Extra bytes each heap extension asks for (untouched pages cost no memory).
TOP_PAD = 64 << 20

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_GLIBC_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _choice() -> str:
    raw = os.environ.get(MALLOC_ENV, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(f"{MALLOC_ENV}={raw!r} is not one of {', '.join(CHOICES)}. HINT: "
                         f"unset it (the library tunes glibc's malloc for training) or set "
                         f"{MALLOC_ENV}=default to keep glibc's defaults")
    return raw


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; whether it did."""
    if _choice() == "default" or platform.system() != "Linux":
        return False
    if any(name in os.environ for name in _GLIBC_TUNABLES):
        return False  # the user's own choice, which glibc read at start
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt tunables)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all([mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD), mallopt(_M_TOP_PAD, TOP_PAD)])
