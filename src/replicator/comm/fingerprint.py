"""Fingerprints that let replicas check they are in the same collective before sending data.

Mispaired collectives give a silently wrong result or a backend abort, so a checked collective
first all-reduces (MAX) ``[h, -h]``, ``h`` a 62-bit hash of the call: all agree when
``max h == min h``. On a mismatch the ranks exchange descriptions and raise
:class:`CollectiveMismatchError`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from replicator.errors import CollectiveMismatchError

_MASK = (1 << 62) - 1


def digest(text: str) -> int:
    """A non-negative 62-bit hash of ``text`` (so ``-h`` never overflows int64)."""
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & _MASK


def describe_tensor(tensor: torch.Tensor, axis: int | None = None) -> str:
    """``shape (4, 3) float32``; with ``axis``, that axis' size is shown (and hashed) as ``*``."""
    dims = [str(d) for d in tensor.shape]
    if axis is not None and dims:
        dims[axis] = "*"
    shape = f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"
    return f"shape {shape} {dtype_name(tensor.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.cache
def _skip_prefixes() -> tuple[str, ...]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/
    dirs = [package, os.path.dirname(os.path.abspath(torch.__file__)),
            sysconfig.get_paths()["stdlib"]]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def call_site() -> str:
    """``file:line`` of the innermost frame outside replicator, torch and the standard library:
    the user's call."""
    skip = _skip_prefixes()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and not os.path.realpath(name).startswith(skip):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown)"


@dataclass(eq=False)
class PendingCheck:
    """A fingerprint exchange in flight; ``exchange`` gathers every rank's description on a
    mismatch."""

    agreed: Callable[[], bool]
    seq: int
    description: str
    exchange: Callable[[str], list[str]]
    ranks: Sequence[int]
    guard: Callable[[str], Any]
    what: str
    done: bool = False

    def wait(self) -> None:
        """Raise :class:`CollectiveMismatchError` on every rank if the fingerprints differ (the
        first wait only)."""
        if self.done:
            return
        self.done = True
        with self.guard(f"{self.what} (fingerprint)"):
            agreed = self.agreed()
        if agreed:
            return
        texts = self.exchange(f"{self.description} (checked call #{self.seq}) at {call_site()}")
        raise mismatch_error(dict(zip(self.ranks, texts)))


def backend_verdict(work: Any, buffer: torch.Tensor) -> Callable[[], bool]:
    """The verdict of an all-reduce MAX of ``[h, -h]`` (``work``: its handle, or ``None`` when
    done)."""
    def agreed() -> bool:
        if work is not None:
            work.wait()
        high, neg_low = buffer.tolist()
        return bool(high == -neg_low)
    return agreed


def mismatch_error(calls: dict[int, str]) -> CollectiveMismatchError:
    """The error every rank raises when the fingerprints differ, listing each rank's call."""
    lines = "\n".join(f"  rank {r}: {text}" for r, text in sorted(calls.items()))
    return CollectiveMismatchError(
        "the replicas entered different collectives at the same point:\n" + lines + "\n"
        "HINT: every rank must make the same collective calls (reduce, gather, backward of a "
        "distributed model, barrier, ...) in the same order with the same shapes and dtypes; "
        "look for a condition that depends on the rank or on its data (e.g. `if "
        "strategy.replica_id == 0: strategy.reduce(...)`) and make every rank take the same "
        "path.", calls)
