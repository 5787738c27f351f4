"""Staging buffers: the state copied into shared memory as the images of a save's files.

A background save with the saver process copies each rank's state into one shared-memory
segment (``comm/shm_segment.py``), laid out byte for byte as the safetensors files it will
write; the saver process (``saver_process.py``) maps the segment by its path and hashes and
writes or uploads the images. The segment is made once and reused by every later save (a
larger one replaces it when the state grows), so a save allocates nothing; each image starts
on a 4 KiB boundary so that it can be written with direct I/O.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from replicator.checkpoint import safetensors_io
from replicator.cluster.processes import process_alive
from replicator.comm.shm_segment import NAME_PREFIX, SharedSegment, shm_dir, unlink_segment

#: Each image starts on a 4 KiB boundary, so the saver process can write it with direct I/O.
ALIGN = 4096
_TAG = "stage"


@dataclass(frozen=True)
class StagedFile:
    """One file image in a :class:`StagingBuffer`: where it starts and how long it is."""

    buffer: str
    offset: int
    length: int


def remove_stale_buffers(directory: str | None = None) -> None:
    """Delete staging segments left by processes that no longer exist (killed)."""
    directory = directory or shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name[len(NAME_PREFIX):].split("-")
        if name.startswith(NAME_PREFIX + _TAG + "-") and len(parts) >= 3 \
                and parts[1].isdigit() and not process_alive(int(parts[1])):
            unlink_segment(name)


class StagingBuffer:
    """A shared-memory segment holding the images of one save's files; a larger one replaces
    it when the state grows. The saver process maps it by its path."""

    def __init__(self) -> None:
        remove_stale_buffers()
        self._segment: SharedSegment | None = None

    @property
    def path(self) -> str:
        return os.path.join(shm_dir(), self._segment.name) if self._segment else ""

    @property
    def nbytes(self) -> int:
        return self._segment.nbytes if self._segment is not None else 0

    def _ensure(self, size: int) -> Any:
        if self._segment is None or size > self._segment.nbytes:
            new_size = max(size, int(self.nbytes * 1.25), 1 << 20)
            self.close()
            self._segment = SharedSegment.create_named(new_size, _TAG)
        return self._segment.mm

    def stage(self, files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]],
              defer: Callable[[torch.Tensor], bool] | None = None
              ) -> tuple[dict[str, StagedFile], list[tuple[torch.Tensor, int]]]:
        """Lay out each ``name -> (tensors, metadata)`` in the buffer as a safetensors image and
        copy the tensors in; those ``defer`` accepts are left out and returned as ``(tensor,
        offset)`` pieces, for :meth:`copy` later (the caller guarantees they do not change
        before then)."""
        plans = []
        total = 0
        for name, (tensors, metadata) in files.items():
            head, order = safetensors_io._header(tensors, metadata)
            plans.append((name, head, order, total))
            total += len(head) + sum(t.numel() * t.element_size() for _, t in order)
            total += -total % ALIGN
        mm = self._ensure(max(total, 1))
        staged, now, later = {}, [], []
        for name, head, order, start in plans:
            mm[start:start + len(head)] = head
            pos = start + len(head)
            for _, t in order:
                if t.numel():
                    piece = (t.detach(), pos)
                    (later if defer is not None and defer(piece[0]) else now).append(piece)
                pos += t.numel() * t.element_size()
            staged[name] = StagedFile(self.path, start, pos - start)
        self.copy(now)
        return staged, later

    def copy(self, pieces: list[tuple[torch.Tensor, int]]) -> None:
        """Copy ``(tensor, offset)`` pieces into the buffer: one copy for each run of CPU
        tensors of one dtype that lie back to back (a safetensors image orders them so)."""
        assert self._segment is not None or not pieces
        i = 0
        while i < len(pieces):
            first, start = pieces[i]
            end, j = start + first.numel() * first.element_size(), i + 1
            while first.device.type == "cpu" and j < len(pieces) and pieces[j][1] == end \
                    and pieces[j][0].dtype == first.dtype and pieces[j][0].device.type == "cpu":
                end += pieces[j][0].numel() * first.element_size()
                j += 1
            dst = torch.frombuffer(self._segment.mm, dtype=first.dtype,  # type: ignore[union-attr]
                                   count=(end - start) // first.element_size(), offset=start)
            if j == i + 1:
                dst.copy_(first.reshape(-1))
            else:
                torch.cat([t.reshape(-1) for t, _ in pieces[i:j]], out=dst)
            i = j

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        unlink_segment(segment.name)
        try:
            segment.mm.close()
        except BufferError:  # a view is still alive; the name is gone anyway
            pass
