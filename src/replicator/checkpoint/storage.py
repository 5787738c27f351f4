"""Where checkpoints live: one small storage protocol over a local directory (atomic renames,
fsync) or an fsspec store (``store.py``); :func:`open_storage` reads a location as one or the
other, and the save protocol over both (``manager.py``) is written once.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from replicator.checkpoint import serialization
from replicator.checkpoint.atomic import fsync_dir, hash_file, remove_tree
from replicator.checkpoint.manifest import (
    MARKER_NAME,
    FileEntry,
    read_marker,
    verify_file,
    write_marker,
)
from replicator.checkpoint.store import (
    FsspecStorage,
    is_remote,
    local_path,
)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
#: What an interrupted save or deletion leaves in a local directory.
LEFTOVERS = (".tmp-", ".trash-")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointStorage(Protocol):
    """What the checkpoint manager needs from a location: a save is staged under its own name
    (``staging``), written, then committed in one atomic step; ``ref`` names a committed save."""

    location: Any
    #: True for a store whose refused saves are logged and retried at the next save.
    retries_later: bool

    def open(self) -> None: ...
    def check(self) -> None: ...
    def release(self) -> None: ...
    def staging(self, step: int, save_id: str) -> str: ...
    def begin(self, staging: str) -> None: ...
    def write(self, staging: str, fname: str, tensors: Mapping[str, torch.Tensor],
              metadata: Mapping[str, str]) -> FileEntry: ...
    def dest(self, staging: str, fname: str) -> str: ...
    def folder(self, staging: str) -> Path: ...
    def publish(self, staging: str, folder: Path, rank: int) -> dict[str, FileEntry]: ...
    def commit(self, step: int, staging: str, manifest: dict[str, Any],
               before: Callable[[Any], None] | None = None) -> str: ...
    def discard(self, staging: str) -> None: ...
    def saves(self) -> list[tuple[int, str]]: ...
    def manifest(self, ref: str) -> dict[str, Any]: ...
    def read(self, ref: str, manifest: Mapping[str, Any], fname: str) -> np.ndarray: ...
    def fetch_all(self, ref: str) -> Path: ...
    def where(self, ref: str) -> Any: ...
    def prune(self, step: int, newest: str, keep: int, wait: bool = False) -> None: ...
    def cleanup(self, after: int | None = None) -> list[str]: ...
    def delete_all(self) -> None: ...


class LocalStorage:
    """Step directories in one local (or shared) file system, committed by rename + marker:
    ``step-00000030/`` (its ``COMMIT.json`` written last); ``.tmp-step-00000040-<id>/`` a save
    in progress, never read, removed on the next start."""

    retries_later = False
    scheme: str | None = None
    storage_options: dict[str, Any] = {}

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.location = self.directory = local_path(directory)

    def __str__(self) -> str:
        return str(self.directory)

    def open(self) -> None:
        """Nothing to hold (no lease): one job per directory is the user's choice."""

    check = release = open

    def staging(self, step: int, save_id: str) -> str:
        return str(self.directory / f".tmp-{step_dir_name(step)}-{save_id}")

    def begin(self, staging: str) -> None:
        Path(staging).mkdir(parents=True, exist_ok=True)

    def write(self, staging: str, fname: str, tensors: Mapping[str, torch.Tensor],
              metadata: Mapping[str, str]) -> FileEntry:
        size, digest = serialization.write_file(Path(staging) / fname, tensors, metadata)
        return FileEntry(bytes=size, sha256=digest)

    def dest(self, staging: str, fname: str) -> str:
        return f"{staging}/{fname}"

    def folder(self, staging: str) -> Path:
        """A local folder a writer of files (DCP) fills: the staging directory itself."""
        return Path(staging)

    def publish(self, staging: str, folder: Path, rank: int) -> dict[str, FileEntry]:
        """The entries of every file in the shared folder, listed once (by the chief)."""
        return {p.name: FileEntry(bytes=p.stat().st_size, sha256=hash_file(p))
                for p in sorted(folder.iterdir()) if p.is_file()} if rank == 0 else {}

    def commit(self, step: int, staging: str, manifest: dict[str, Any],
               before: Callable[[Any], None] | None = None) -> str:
        """Rename the staging directory into place, ``before(path)``, then write the marker."""
        tmp, final = Path(staging), self.directory / step_dir_name(step)
        moved = False
        try:
            fsync_dir(tmp)
            if final.exists():  # an uncommitted or damaged leftover of this same step
                remove_tree(final)
            os.rename(tmp, final)
            moved = True
            fsync_dir(self.directory)
            if before is not None:
                before(final)
            write_marker(final, manifest)
        except BaseException:
            remove_tree(final if moved else tmp)
            raise
        return final.name

    def discard(self, staging: str) -> None:
        remove_tree(staging)

    def _entries(self) -> list[Path]:
        try:
            return list(self.directory.iterdir())
        except FileNotFoundError:
            return []

    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every step directory, committed or not, oldest first."""
        return sorted((int(m.group(1)), p) for p in self._entries()
                      if (m := _STEP_DIR.match(p.name)) and p.is_dir())

    def saves(self) -> list[tuple[int, str]]:
        """Every step directory (a restore skips those whose marker is missing, with why)."""
        return [(s, p.name) for s, p in self.step_dirs()]

    def committed(self) -> list[int]:
        return [s for s, p in self.step_dirs() if (p / MARKER_NAME).exists()]

    def manifest(self, ref: str) -> dict[str, Any]:
        return read_marker(self.directory / ref)

    def read(self, ref: str, manifest: Mapping[str, Any], fname: str) -> np.ndarray:
        return verify_file(self.directory / ref, manifest, fname)

    def fetch_all(self, ref: str) -> Path:
        """The save's folder, every file verified (read in place)."""
        manifest = self.manifest(ref)
        for fname in sorted(manifest["files"]):
            self.read(ref, manifest, fname)
        return self.directory / ref

    def where(self, ref: str) -> Path:
        return self.directory / ref

    def prune(self, step: int, newest: str, keep: int, wait: bool = False) -> None:
        """Keep the newest ``keep`` committed saves up to ``step``; drop older, partial and newer
        ones (a run resumed from ``step`` writes them again)."""
        try:
            dirs = self.step_dirs()
            committed = [p for s, p in dirs if s <= step and (p / MARKER_NAME).exists()]
            for s, p in dirs:
                partial = s < step and not (p / MARKER_NAME).exists()
                if s > step or partial or p in committed[:-keep]:
                    remove_tree(p, wait=wait)
        except OSError as exc:
            warnings.warn(f"could not remove old checkpoints in {self.directory}: {exc}",
                          RuntimeWarning, stacklevel=3)

    def cleanup(self, after: int | None = None) -> list[str]:
        """Remove what interrupted saves and deletions left (``.tmp-*``, ``.trash-*``), never
        reading it; with ``after``, every step newer than it. Returns the names removed."""
        removed = []
        for p in self._entries():
            m = _STEP_DIR.match(p.name)
            if p.name.startswith(LEFTOVERS) or (m and after is not None
                                                 and int(m.group(1)) > after):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p.name)
        return sorted(removed)

    def delete_all(self) -> None:
        for _, path in self.step_dirs():
            remove_tree(path)
        self.cleanup()
        try:
            self.directory.rmdir()
        except OSError:
            pass  # not empty: the user keeps other files there


def open_storage(target: Any, storage_options: Mapping[str, Any] | None = None,
                 what: str = "the checkpoint location", **lease: Any) -> Any:
    """The storage at ``target`` (a storage passed in as it is); a URL fsspec cannot open raises
    :class:`~replicator.errors.StorageURLError` here."""
    if isinstance(target, LocalStorage) or (isinstance(target, FsspecStorage) and not lease):
        return target
    if isinstance(target, FsspecStorage):  # opened for a manager: its own lease settings
        return FsspecStorage(target.url, target.storage_options, what, **lease)
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"{what} is a path or a URL string, got {type(target).__name__}")
    if is_remote(target):
        return FsspecStorage(os.fspath(target), storage_options, what, **lease)
    return LocalStorage(target)
