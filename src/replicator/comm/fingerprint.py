"""Fingerprints that let replicas check they are in the same collective before sending data.

Collectives paired wrongly across ranks give a silently wrong result (equal sizes) or abort in
the backend (different sizes). So every checked collective first all-reduces (MAX) a fixed-size
``[h, -h]``, ``h`` a 62-bit hash of (operation, sequence number, shape, dtype): the result tells
every rank at once whether all sent the same ``h``. On a mismatch every rank exchanges a readable
description of its call (and the user's line) and raises :class:`CollectiveMismatchError`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.errors import CollectiveMismatchError

_MASK = (1 << 62) - 1
_SKIP_PREFIXES: tuple[str, ...] | None = None


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


def _skip_prefixes() -> tuple[str, ...]:
    global _SKIP_PREFIXES
    if _SKIP_PREFIXES is None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/
        dirs = [package,
                os.path.dirname(os.path.abspath(torch.__file__)),
                sysconfig.get_paths()["stdlib"]]
        _SKIP_PREFIXES = tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
    return _SKIP_PREFIXES


def call_site() -> str:
    """``file:line`` of the innermost frame outside replicator, torch and the standard library
    (the user's call that led here); ``(unknown)`` when there is none (a backend thread)."""
    skip = _skip_prefixes()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and not os.path.realpath(name).startswith(skip):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown)"


class PendingCheck:
    """A fingerprint exchange in flight; :meth:`wait` gives the verdict (raises on mismatch).
    ``agreed()`` waits and says whether all ranks agree; ``exchange`` gathers every rank's line
    of the error, on a mismatch only.
    """

    def __init__(self, agreed: Callable[[], bool], seq: int, description: str,
                 exchange: Callable[[str], list[str]], ranks: Sequence[int],
                 guard: Callable[[str], Any], what: str) -> None:
        self._agreed = agreed
        self.seq = seq
        self.description = description
        self._exchange = exchange
        self._ranks = list(ranks)
        self._guard = guard
        self.what = what
        self.done = False

    def wait(self) -> None:
        """Wait for the exchange; raise :class:`CollectiveMismatchError` on every rank if the
        ranks' fingerprints differ. Only the first wait gives the verdict; later ones return
        at once (the error has already been raised on every rank)."""
        if self.done:
            return
        self.done = True
        with self._guard(f"{self.what} (fingerprint)"):
            agreed = self._agreed()
        if agreed:
            return
        mine = f"{self.description} (checked call #{self.seq}) at {call_site()}"
        texts = self._exchange(mine)
        raise mismatch_error(dict(zip(self._ranks, texts)))


def backend_verdict(work: Any, buffer: torch.Tensor) -> Callable[[], bool]:
    """The verdict of an all-reduce MAX of ``[h, -h]`` (``work``: its handle, or ``None`` when
    it already ran): every rank sent the same ``h`` when ``max h == min h``."""
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


def exchange_texts(text: str, group: dist.ProcessGroup | None, world_size: int,
                   device: torch.device) -> list[str]:
    """Every rank's ``text`` in group order: a fixed-size exchange of lengths, then the
    bytes padded to the longest (no pickling)."""
    data = text.encode()[:4096]
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:n].cpu().tolist()).decode(errors="replace")
            for p, n in zip(parts, sizes)]
