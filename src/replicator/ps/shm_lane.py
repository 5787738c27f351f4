"""A shared-memory lane for a message connection whose two ends share a host: payloads go
through the segment, headers still on the socket (so a lost peer is noticed as before).

Reuse rule: a sender overwrites its outbox with each shared batch, so it may send one only once
the peer is done with the previous one (only requests answered after their payloads were
consumed, and their answers, use the lane)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from replicator.comm.shm_segment import ALIGN, SharedSegment, align

#: Dtypes whose payloads are copied and viewed through numpy: a slice and a view there cost
#: about a third of torch's (measured 1.3 vs 3.4-5.7 us per payload; a step moves dozens).
_NUMPY = {dt: torch.empty(0, dtype=dt).numpy().dtype for dt in (
    torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class SharedLane:
    """Regions of ``segment``: the outbox ``out`` and the inbox ``inbox``, as (offset, bytes)."""

    def __init__(self, segment: SharedSegment, out: tuple[int, int], inbox: tuple[int, int]
                 ) -> None:
        self.segment = segment
        self.out_offset, self.out_bytes = out
        self.in_offset, self.in_bytes = inbox
        self._array = segment.base.numpy()  # the same memory, for cheap slices and copies
        self._bytes = memoryview(self._array)  # type: ignore[arg-type]

    @staticmethod
    def layout(first_bytes: int, second_bytes: int) -> tuple[int, tuple[int, int],
                                                            tuple[int, int]]:
        """The segment size and two regions for payloads of ``first_bytes`` (the creator's
        outbox) and ``second_bytes`` (the peer's outbox)."""
        first = align(max(first_bytes, ALIGN))
        second = align(max(second_bytes, ALIGN))
        return first + second, (0, first), (first, second)

    @staticmethod
    def nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
        """Outbox bytes that ``tensors`` take (each payload starts aligned)."""
        return sum(align(t.numel() * t.element_size()) for t in tensors if t is not None)

    def write(self, tensors: Sequence[torch.Tensor | None], start: int = 0) -> list[int]:
        """Copy each tensor into the outbox one after the other from ``start`` (aligned); their
        offsets there (-1 for ``None``). The caller checked that they fit."""
        offsets = []
        at = start
        for t in tensors:
            if t is None:
                offsets.append(-1)
                continue
            n = t.numel() * t.element_size()
            if n:
                start = self.out_offset + at
                if t.dtype in _NUMPY and t.device.type == "cpu" and t.is_contiguous() \
                        and not (t.is_conj() or t.is_neg()):
                    source = t.detach().numpy().reshape(-1).view(np.uint8)
                    self._bytes[start:start + n] = source  # type: ignore[call-overload]
                else:
                    dst = self.segment.base[start:start + n]
                    dst.view(t.dtype).view(t.shape).copy_(t.detach())
            offsets.append(at)
            at += align(n)
        return offsets

    def read(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
             ) -> torch.Tensor | None:
        """A view of the payload at ``offset`` in the inbox (``None`` if it lies outside)."""
        if offset < 0 or offset % ALIGN or offset + nbytes > self.in_bytes:
            return None
        start = self.in_offset + offset
        np_dtype = _NUMPY.get(dtype)
        if np_dtype is None:
            return self.segment.base[start:start + nbytes].view(dtype).view(shape)
        return torch.from_numpy(self._array[start:start + nbytes].view(np_dtype).reshape(shape))
