"""Checkpoint files laid out in shared memory, byte for byte as they will be written.

At a step boundary each state tree becomes a safetensors file image (header, then the tensor
bytes) inside one memory-mapped file on a RAM file system (``/dev/shm``, or
``REPLICATOR_SHM_DIR``). That copy is all the training loop waits for: the saver process
(``saver_process.py``) maps the same file and hashes and writes the images while training goes
on. The buffer is reused across saves and grows when the state does.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from replicator.checkpoint import safetensors_io, serialization
from replicator.cluster.env_names import SHM_DIR_ENV
from replicator.cluster.processes import process_alive

#: Each image starts on a 4 KiB boundary, so the saver process can write it with direct I/O.
_ALIGN = 4096
_PREFIX = "replicator-stage-"


@dataclass(frozen=True)
class StagedFile:
    """One file image in a :class:`StagingBuffer`: where it starts and how long it is."""

    buffer: str
    offset: int
    length: int


def _shm_dir() -> str:
    env = os.environ.get(SHM_DIR_ENV)
    if env:
        return env
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_stale_buffers(directory: str) -> None:
    """Delete staging files left by processes that no longer exist (killed with SIGKILL)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith(_PREFIX) and len(parts) >= 4 and parts[2].isdigit():
            if not process_alive(int(parts[2])):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass


class StagingBuffer:
    """A growable memory-mapped file that holds the images of one save's files."""

    def __init__(self) -> None:
        directory = _shm_dir()
        remove_stale_buffers(directory)
        self.path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._size = 0
        self._mm: mmap.mmap | None = None
        self._used = 0

    @property
    def nbytes(self) -> int:
        return self._size

    def _ensure(self, size: int) -> mmap.mmap:
        if self._mm is not None and size <= self._size:
            return self._mm
        new_size = max(size, int(self._size * 1.25), 1 << 20)
        if self._mm is not None:
            self._mm.close()
        with open(self.path, "a+b") as f:
            f.truncate(new_size)
            self._mm = mmap.mmap(f.fileno(), new_size)
        self._size = new_size
        return self._mm

    def stage(self, files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]]
              ) -> dict[str, StagedFile]:
        """Copy each ``name -> (tensors, metadata)`` into the buffer as a safetensors image."""
        plans = []
        total = 0
        for name, (tensors, metadata) in files.items():
            head, order = safetensors_io._header(tensors, metadata)
            data = sum(t.numel() * t.element_size() for _, t in order)
            plans.append((name, head, order, total))
            total += len(head) + data
            total += -total % _ALIGN
        mm = self._ensure(max(total, 1))
        staged = {}
        for name, head, order, start in plans:
            mm[start:start + len(head)] = head
            pos = start + len(head)
            for _, t in order:
                n = t.numel()
                if n:
                    dst = torch.frombuffer(mm, dtype=t.dtype, count=n, offset=pos)
                    dst.view(t.shape).copy_(t.detach())
                pos += n * t.element_size()
            staged[name] = StagedFile(self.path, start, pos - start)
        self._used = total
        return staged

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive; the file is removed anyway
                pass
            self._mm = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def flatten(state: Any, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A state tree as the tensors and metadata of one safetensors file (no copy yet)."""
    if hasattr(state, "tensors") and hasattr(state, "metadata"):  # a FrozenState
        return dict(state.tensors), dict(state.metadata)
    return serialization._flatten(state, label)
