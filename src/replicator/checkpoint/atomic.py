"""Durable, atomic file-system steps: what a checkpoint needs so a crash never leaves half a file.

A file is durable once its bytes are flushed and ``fsync``ed; a rename or a new entry in a
directory is durable once the *directory* is fsynced. Atomicity comes from renames: the reader
either sees the old name or the complete new one, never a half-written file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from pathlib import Path

#: Read and hash files in chunks of this size (large enough for throughput, small for memory).
CHUNK_BYTES = 8 << 20


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable.

    Some file systems (and all of Windows) cannot open a directory; there the rename itself is
    the best available guarantee, so the error is ignored.
    """
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


def write_durable(path: str | Path, data: bytes | memoryview) -> str:
    """Write ``data`` to ``path``, flush and fsync it; return its SHA-256 (hex).

    The caller decides atomicity (write into a temporary directory, or use
    :func:`write_atomic`). A partial file is removed when writing fails (a full disk).
    """
    digest = hashlib.sha256(data).hexdigest()
    try:
        with open(path, "wb") as f:
            view = memoryview(data)
            for start in range(0, len(view), CHUNK_BYTES):
                f.write(view[start:start + CHUNK_BYTES])
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise
    return digest


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically and durably: temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    write_durable(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_and_hash(path: str | Path) -> tuple[bytes, str]:
    """The bytes of ``path`` and their SHA-256 (hex), read once."""
    hasher = hashlib.sha256()
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
            parts.append(chunk)
    return b"".join(parts), hasher.hexdigest()


def hash_file(path: str | Path) -> str:
    """SHA-256 (hex) of the file at ``path``."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def remove_tree(path: str | Path) -> None:
    """Delete a directory without ever exposing a half-deleted one under its own name.

    It is first renamed to a hidden ``.trash-`` name (atomic), then deleted; a crash in between
    leaves only trash, which the next cleanup removes.
    """
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def free_bytes(path: str | Path) -> int | None:
    """Bytes free for this user on the file system of ``path`` (None when unknown)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize
