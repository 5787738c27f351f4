"""Shared-memory batch buffers that a process worker reuses once the consumer lets go of them.

A process worker collates each batch straight into shared memory (``work._stack``). A fresh
buffer costs a page fault and the zeroing of every page: for 64 ImageNet crops (38.5 MB) about
30 ms, a fifth of the worker's CPU per batch in ``benchmarks/ingestion.py`` (DataLoader pays
the same), against 6-11 ms to stack into pages that are already there.

So a worker keeps a descriptor of each buffer it hands over (not its mapping: the worker's
resident set stays that of one batch) and names it with the result. The consumer notes which of
its storages hold each named buffer; once none of them is alive any more (no tensor of the
consumer's process refers to the batch), it names the buffer back to its worker, which collates
a later batch of the same size into it. The data are those of a fresh buffer: every byte is
written again. A batch whose tensors the consumer passes on to another process (a
``torch.multiprocessing`` queue) must stay referenced in the consumer until that process is
done with it, as the buffer is reused once the consumer's last reference is gone.

Only with torch's ``file_descriptor`` sharing strategy (the default on Linux), whose buffers a
descriptor names; ``file_system`` buffers are made afresh each time, as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections import OrderedDict
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

Key = tuple[int, int]  # (inode, device) of a buffer's shared-memory file, as torch's fd_id

LENT_CAP = 64  # buffers a worker remembers as handed over; older ones are forgotten
FREE_CAP = 2   # buffers a worker keeps ready for reuse (one a task); more are freed
_MADV_POPULATE_READ = 22  # Linux 5.14: fault in a whole range in one call, for reading
_MADV_POPULATE_WRITE = 23  # and for writing
_madvise: list[Any] = []  # libc's madvise once loaded; [None] where it is not to be used


def buffer_key(fd: int) -> Key:
    """The identity of a shared-memory file, the same in every process that has it open."""
    st = os.fstat(fd)
    return st.st_ino, st.st_dev


def _load_madvise() -> Any:
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def populate(storage: torch.UntypedStorage, fresh: bool = True) -> None:
    """Fault in every page of a new mapping in one system call, not one fault per page (a
    fifth to a half of the cost of filling it); a no-op where the kernel lacks the call.
    Pages a reused buffer already has are mapped as for reading, which maps 16 at a time (a
    shared mapping of shared memory gets them writable): 9.5 ms against 12.6 ms for 38.5 MB."""
    if not _madvise:
        _madvise.append(_load_madvise())
    madvise = _madvise[0]
    if madvise is None or storage.nbytes() == 0:
        return
    advice = _MADV_POPULATE_WRITE if fresh else _MADV_POPULATE_READ
    if madvise(storage.data_ptr(), storage.nbytes(), advice) != 0:
        _madvise[0] = None  # EINVAL before Linux 5.14: not again


class WorkerBuffers:
    """A process worker's buffers: those handed over (by descriptor, until the consumer names
    them back or :data:`LENT_CAP` newer ones push them out) and those free for reuse."""

    def __init__(self, releases: Any) -> None:
        self.releases = releases  # the read end of a pipe from the consumer
        self.lent: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # key: (fd, nbytes)
        self.free: list[tuple[int, int]] = []
        self.handed: list[Key] = []

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """A shared storage of ``nbytes`` for one batch: a buffer the consumer gave back, else a
        new one; its key goes with the task's result (:meth:`settle`)."""
        self.take_back()
        fd = self._pop_free(nbytes)
        if fd is None:
            storage = torch.UntypedStorage._new_shared(nbytes)
        else:
            try:
                storage = torch.UntypedStorage._new_shared_fd_cpu(  # type: ignore[attr-defined]
                    fd, nbytes)
            finally:
                os.close(fd)
        populate(storage, fresh=fd is None)
        own, _size = storage._share_fd_cpu_()
        key = buffer_key(own)
        self.lent[key] = (os.dup(own), nbytes)
        self.handed.append(key)
        while len(self.lent) > LENT_CAP:
            os.close(self.lent.popitem(last=False)[1][0])
        return storage

    def settle(self, ok: bool) -> list[Key]:
        """The keys of the buffers the task just run hands over; a failed task hands none, so
        its buffers are free again."""
        handed, self.handed = self.handed, []
        if not ok:
            self._give_back(handed)
            return []
        return handed

    def take_back(self) -> None:
        """Read the buffers the consumer gave back; keep :data:`FREE_CAP` of them, free the
        rest (an idle worker calls it too, so a pass's last batches do not stay held)."""
        try:
            while self.releases.poll():
                keys = self.releases.recv()
                if keys is None:  # the consumer's pass ended: forget what it still holds
                    self._forget()
                else:
                    self._give_back(keys)
        except (EOFError, OSError):
            pass  # the consumer is gone; the worker is told to stop
        while len(self.free) > FREE_CAP:
            os.close(self.free.pop(0)[0])

    def _forget(self) -> None:
        for fd, _size in self.lent.values():
            os.close(fd)
        self.lent.clear()

    def _give_back(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self.lent.pop(key, None)
            if entry is not None:
                self.free.append(entry)

    def _pop_free(self, nbytes: int) -> int | None:
        for i, (fd, size) in enumerate(self.free):
            if size == nbytes:
                del self.free[i]
                return fd
        return None


def worker_buffers(releases: Any) -> WorkerBuffers | None:
    """Buffers for a process worker, or ``None`` where a descriptor cannot name them."""
    import torch.multiprocessing as tmp

    if releases is None or tmp.get_sharing_strategy() != "file_descriptor":
        return None
    return WorkerBuffers(releases)


def _shared_storages(obj: Any, want: set[Key], found: dict[Key, Any]) -> None:
    if len(found) == len(want):
        return
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if obj.device.type != "cpu" or not storage.is_shared():
            return
        try:
            key = buffer_key(storage._share_fd_cpu_()[0])
        except (RuntimeError, OSError):
            return
        if key in want:
            found[key] = storage
    elif isinstance(obj, dict):
        for value in obj.values():
            _shared_storages(value, want, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj[:256]:
            _shared_storages(value, want, found)


class Leases:
    """The consumer's side: the buffers its received batches hold, by worker, and the naming
    back of those it no longer refers to."""

    def __init__(self) -> None:
        self.releases: list[Any] = []  # the write end of each worker's pipe
        self.held: list[tuple[StorageWeakRef, int, Key]] = []

    def track(self, worker: int, keys: list[Key], result: Any) -> None:
        """A result from ``worker`` holds the buffers ``keys``."""
        found: dict[Key, Any] = {}
        _shared_storages(result, set(keys), found)
        self.held.extend((StorageWeakRef(s), worker, key) for key, s in found.items())
        excess = len(self.held) - LENT_CAP * max(1, len(self.releases))
        if excess > 0:  # batches kept for long: their workers have forgotten them too
            del self.held[:excess]

    def release(self) -> None:
        """Name back to each worker the buffers no storage of this process refers to now."""
        if not self.held:
            return
        gone: dict[int, list[Key]] = {}
        kept = []
        for entry in self.held:
            if entry[0].expired():
                gone.setdefault(entry[1], []).append(entry[2])
            else:
                kept.append(entry)
        self.held = kept
        for worker, keys in gone.items():
            try:
                self.releases[worker].send(keys)
            except (OSError, ValueError, IndexError):
                pass  # a worker that stopped; the pool reports it

    def forget(self) -> None:
        """At the end of a pass: name back what is let go of, and have the workers forget the
        rest (the batches still held here are freed as usual when let go of), so idle workers
        keep no more than :data:`FREE_CAP` buffers each."""
        self.release()
        self.held.clear()
        for end in self.releases:
            try:
                end.send(None)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Close the pipes (the workers have stopped)."""
        for end in self.releases:
            end.close()
        self.releases.clear()
        self.held.clear()
