"""Durable, atomic file-system steps (fsync the file, rename, fsync the directory), so that a
crash never leaves half a file under a checkpoint's name."""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

#: Read and hash files in chunks of this size (large enough for throughput, small for memory).
CHUNK_BYTES = 8 << 20


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable, where it opens."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_durable(path: str | Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    """Write ``chunks`` to ``path``, hashing each while the next is written, and fsync it;
    return (bytes, SHA-256). A partial file is removed when writing fails (a full disk)."""
    hasher = OverlappedHasher()
    size = 0
    try:
        with open(path, "wb") as f:
            for chunk in chunks:
                hasher.update(chunk)
                f.write(chunk)
                size += len(chunk)
            digest = hasher.hexdigest()
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise
    finally:
        hasher.close()
    return size, digest


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically and durably: temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    write_durable(tmp, [data])
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class OverlappedHasher:
    """SHA-256 on a helper thread (``hashlib`` releases the GIL), overlapping the next chunk's
    I/O; updates stay in order because each waits for the one before."""

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replicator-sha256")
        self._pending: Future[None] | None = None

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._wait()
        self._pending = self._pool.submit(self._hasher.update, chunk)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def hexdigest(self) -> str:
        self._wait()
        self._pool.shutdown(wait=False)
        return self._hasher.hexdigest()

    def close(self) -> None:
        self._pending = None
        self._pool.shutdown(wait=True)


def read_and_hash(path: str | Path) -> tuple[np.ndarray, str]:
    """The bytes of ``path`` and their SHA-256 (hex), read once, hashing each chunk while the
    next one is read. The bytes land in an uninitialised numpy ``uint8`` array (no zero-fill
    of a large buffer), which tensors can then view without a copy."""
    hasher = OverlappedHasher()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = np.empty(size, dtype=np.uint8)
            view = data.data  # a memoryview of the array's bytes
            filled = 0
            while filled < size:
                n = f.readinto(view[filled:filled + CHUNK_BYTES])
                if not n:
                    break
                hasher.update(view[filled:filled + n])
                filled += n
            digest = hasher.hexdigest()
            view.release()
            if filled < size:  # the file shrank while being read
                data = data[:filled]
    finally:
        hasher.close()
    return data, digest


def hash_file(path: str | Path) -> str:
    """SHA-256 (hex) of the file at ``path``, read in chunks."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


#: Name of the threads deleting trash in the background (the process waits for them at exit).
PRUNE_THREAD_NAME = "replicator-prune"
#: Longest wait at exit for background deletions to finish.
PRUNE_EXIT_WAIT_SECONDS = 30.0


def finish_removals(timeout: float = PRUNE_EXIT_WAIT_SECONDS) -> None:
    """Wait (at most ``timeout`` s) for background deletions: no ``.trash-`` directory is left."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == PRUNE_THREAD_NAME:
            thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(finish_removals)


def remove_tree(path: str | Path, wait: bool = True) -> None:
    """Delete a directory, first renamed to a hidden ``.trash-`` name so that no half-deleted
    one shows under its name; ``wait=False`` deletes on a thread the process waits for at exit."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    if wait:
        shutil.rmtree(trash, ignore_errors=True)
    else:
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                         name=PRUNE_THREAD_NAME, daemon=True).start()
