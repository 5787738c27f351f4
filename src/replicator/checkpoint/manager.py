"""CheckpointManager: atomic, verified, multi-rank checkpoints in one directory.

Layout of ``directory``::

    step-00000030/              a committed checkpoint (after 30 optimizer steps)
        model.safetensors       replicated state, written by the chief only
        optimizer.safetensors
        rank-00000.safetensors  per-rank state (RNG, input position), written by that rank
        rank-00001.safetensors
        COMMIT.json             the commit marker: manifest with SHA-256 of every file, last
    .tmp-step-00000040-a0/      a save in progress (attempt 0); never read, removed on restart

A save writes every file into the temporary directory (each rank its own files, the chief the
shared ones), fsyncs them, agrees across ranks that all writes succeeded, and then the chief
renames the directory into place and writes the marker. A crash at any point leaves either a
temporary directory or a directory without a marker: both are ignored by :meth:`restore`, which
takes the newest checkpoint whose marker and hashes verify and warns about each one it skips.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replicator.checkpoint import fault_points, safetensors_io, serialization
from replicator.checkpoint.atomic import fsync_dir, remove_tree
from replicator.checkpoint.exchange import Channel, describe_failures, group_collectives
from replicator.checkpoint.manifest import (
    MARKER_NAME,
    FileEntry,
    build,
    read_marker,
    verify,
    verify_file,
    write_marker,
)
from replicator.checkpoint.store import is_remote, local_path
from replicator.cluster.environment import resolve_cluster
from replicator.comm.collectives import Collectives
from replicator.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    UnsafeCheckpointError,
)

#: Writes ``(file name, state, label)`` items under a base (a local directory, or a path on
#: the remote store given) and returns their entries: the saver process's hand-off.
FileWriter = Callable[[str, Any, list[tuple[str, Any, str]]], dict[str, FileEntry]]

#: The class serving URLs, registered by ``remote_manager`` (which builds on this module);
#: the package imports it, so it is always there.
REMOTE_MANAGER: dict[str, type[CheckpointManager]] = {}

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_STATE_NAME = re.compile(r"^[A-Za-z0-9_]{1,100}$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def check_state_name(name: str) -> str:
    """A replicated state's name becomes a file name: letters, digits and ``_`` only."""
    if not isinstance(name, str) or not _STATE_NAME.match(name) or name.startswith("rank"):
        raise ValueError(f"state name {name!r} is not usable as a file name; use letters, digits "
                         "and '_' (and not a name starting with 'rank')")
    return name


@dataclass
class FrozenState:
    """A state tree flattened and copied at one moment (see :func:`freeze_state`): what a
    background save writes while training changes the live tensors."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def freeze_state(state: Any, label: str, reuse: FrozenState | None = None) -> FrozenState:
    """Copy ``state`` (a tree of plain values and tensors) into memory, as it is now.

    ``reuse``: an earlier copy that is no longer needed; its buffers are overwritten where
    names, shapes and dtypes match (no fresh allocation, no page faults). Raises the same
    ``TypeError`` as a save would for data that cannot be stored, so a bad state is reported
    at the step that produced it, not later on a thread.
    """
    tensors, metadata = serialization._flatten(state, label)
    old = reuse.tensors if reuse is not None else {}
    copies = {}
    for k, t in tensors.items():
        buf = old.get(k)
        if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
            copies[k] = buf.copy_(t.detach())
        else:
            copies[k] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    return FrozenState(copies, metadata)


@dataclass
class Restored:
    """What :meth:`CheckpointManager.restore` loaded."""

    step: int
    path: Path
    info: dict[str, Any]
    world_size: int
    replicated: dict[str, Any] = field(default_factory=dict)
    #: This rank's own state; rank 0's when the checkpoint has none for this rank.
    per_rank: Any = None
    #: The rank whose state ``per_rank`` is (None: there was none).
    per_rank_source: int | None = None


class CheckpointManager:
    """Save and restore checkpoints of a job in ``directory``, keeping the newest ``keep``.

    Every rank calls :meth:`save` and :meth:`restore` together (they agree through small
    collectives). ``collectives``: the ranks that checkpoint together and how they talk (for
    example a strategy's, so that timeouts name ranks); default: the whole job
    (:func:`~replicator.checkpoint.exchange.group_collectives`).
    ``directory`` must be one file system that every rank sees (a local disk for one machine,
    a shared one across machines).
    """

    def __new__(cls, directory: Any = None, *args: Any, **kwargs: Any) -> CheckpointManager:
        """A URL (``s3://bucket/run``) makes a
        :class:`~replicator.checkpoint.remote_manager.RemoteCheckpointManager`."""
        remote = REMOTE_MANAGER.get("class")
        if cls is CheckpointManager and remote is not None and isinstance(
                directory, (str, os.PathLike)) and is_remote(directory):
            return super().__new__(remote)
        return super().__new__(cls)

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2, *,
                 collectives: Collectives | None = None,
                 attempt: int | None = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
        self.directory = local_path(directory)
        self.keep = keep
        if collectives is not None and not isinstance(collectives, Collectives):
            raise TypeError(f"collectives must be a Collectives, got {type(collectives).__name__}"
                            ". HINT: pass strategy.collectives, or nothing for the whole job")
        self._channel: Channel | None = Channel(collectives) if collectives is not None else None
        self.attempt = resolve_cluster().restart_count if attempt is None else attempt
        self.latest_step: int | None = None
        #: Which checkpoint of the chosen step restore loads, where a step alone is ambiguous.
        self._choice_ref: Any = None

    @property
    def channel(self) -> Channel:
        if self._channel is None:
            self._channel = Channel(group_collectives())
        return self._channel

    def where(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives, for messages."""
        return str(self.directory / step_dir_name(step))

    # -- listing -------------------------------------------------------------------------------
    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every step directory, committed or not, oldest first."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        found = [(int(m.group(1)), p) for p in entries
                 if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def committed_steps(self) -> list[int]:
        """Steps whose directory has a commit marker (not verified; see :meth:`restore`)."""
        return [s for s, p in self.step_dirs() if (p / MARKER_NAME).exists()]

    def cleanup_temporaries(self) -> None:
        """Remove what interrupted saves and deletions left (``.tmp-*``, ``.trash-*``)."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return
        for p in entries:
            if p.name.startswith((".tmp-", ".trash-")):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, replicated: Mapping[str, Any] | None = None,
             per_rank: Any = None, info: Mapping[str, Any] | None = None, *,
             channel: Channel | None = None, writer: FileWriter | None = None) -> Path:
        """Write and commit the checkpoint of ``step``; every rank calls this together.

        ``replicated`` maps names to state trees that are the same on every rank (the chief
        writes them; other ranks may pass ``None``); ``per_rank`` is this rank's own state tree;
        either may be a :class:`FrozenState`. ``info`` is JSON stored in the manifest.
        ``channel``: how the ranks agree (default: the manager's own; a background save
        passes one over a private group). ``writer``: writes this rank's files (the saver
        process; default: in this thread). Raises :class:`CheckpointWriteError` on every
        rank when any rank fails, after removing the partial checkpoint.
        """
        ch = channel or self.channel
        name = step_dir_name(step)
        tmp = self.directory / f".tmp-{name}-a{self.attempt}"
        final = self.directory / name
        entries: dict[str, FileEntry] = {}
        local_exc: BaseException | None = None
        try:
            fault_points.fire("before_write", step=step, path=tmp, rank=ch.rank)
            tmp.mkdir(parents=True, exist_ok=True)
            entries = self._write_all(str(tmp), None,
                                      self._items(replicated, per_rank, ch), writer)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
            local_exc = exc
        results = ch.all_gather(
            {"error": _text(local_exc), "files": {n: e.as_json() for n, e in entries.items()}},
            f"checkpoint save of step {step} (writes)")
        failures = {r: m["error"] for r, m in enumerate(results) if m["error"]}
        if failures:
            if ch.is_chief:
                remove_tree(tmp)
            if local_exc is not None and not isinstance(local_exc, OSError):
                raise local_exc
            raise self._write_error(step, failures, local_exc)
        commit_exc: BaseException | None = None
        if ch.is_chief:
            files = {n: FileEntry(**e) for m in results for n, e in m["files"].items()}
            commit_exc = self._commit(step, tmp, final, files, dict(info or {}), ch)
        outcome = ch.from_chief(_text(commit_exc), f"checkpoint save of step {step} (commit)")
        if outcome:
            raise self._write_error(step, {0: outcome}, commit_exc)
        self.latest_step = step
        if ch.is_chief:
            self._prune(step)
        return final

    @staticmethod
    def _items(replicated: Mapping[str, Any] | None, per_rank: Any,
               ch: Channel) -> list[tuple[str, Any, str]]:
        """``(file name, state, label)`` of the files this rank writes."""
        items = []
        if per_rank is not None:
            items.append((rank_file(ch.rank), per_rank, f"rank {ch.rank}'s state"))
        if ch.is_chief:
            for key, state in (replicated or {}).items():
                items.append((f"{check_state_name(key)}.safetensors", state, key))
        return items

    def _write_all(self, base: str, store: Any, items: list[tuple[str, Any, str]],
                   writer: FileWriter | None) -> dict[str, FileEntry]:
        if writer is not None:
            return writer(base, store, items)
        return {fname: self._write(Path(base), fname, state, label)
                for fname, state, label in items}

    def _write(self, tmp: Path, fname: str, state: Any, label: str) -> FileEntry:
        if isinstance(state, FrozenState):
            size, digest = safetensors_io.write_file(tmp / fname, state.tensors, state.metadata)
        else:
            size, digest = serialization.write(tmp / fname, state, label)
        return FileEntry(bytes=size, sha256=digest)

    def _commit(self, step: int, tmp: Path, final: Path, files: dict[str, FileEntry],
                info: dict[str, Any], ch: Channel) -> BaseException | None:
        moved = False
        try:
            manifest = build(step, ch.world_size, files, info)
            fsync_dir(tmp)
            if final.exists():  # an uncommitted or damaged leftover of this same step
                remove_tree(final)
            os.rename(tmp, final)
            moved = True
            fsync_dir(self.directory)
            fault_points.fire("before_commit", step=step, path=final, rank=ch.rank)
            write_marker(final, manifest)
            fault_points.fire("after_commit", step=step, path=final, rank=ch.rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            remove_tree(final if moved else tmp)
            return exc
        return None

    def _write_error(self, step: int, failures: dict[int, str],
                     cause: BaseException | None) -> CheckpointWriteError:
        full = any("No space left" in e or "ENOSPC" in e for e in failures.values()) or (
            isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT))
        previous = (f"the previous checkpoint (step {self.latest_step}) is intact"
                    if self.latest_step is not None else "no earlier checkpoint exists")
        hint = (f"free space on the file system of {self.directory} (or lower keep=)" if full
                else f"check that every rank can write to {self.directory}")
        err = CheckpointWriteError(
            f"saving the checkpoint of step {step} to {self.directory} failed "
            f"({describe_failures(failures)}). Nothing was committed and {previous}. "
            f"HINT: {hint}.")
        if cause is not None:
            err.__cause__ = cause
        return err

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep`` committed checkpoints up to ``step``; drop the rest."""
        try:
            dirs = self.step_dirs()
            committed = [p for s, p in dirs if s <= step and (p / MARKER_NAME).exists()]
            for s, p in dirs:
                stale = s > step  # newer than what we resumed from: only invalid ones exist
                partial = s < step and not (p / MARKER_NAME).exists()
                if stale or partial or (p in committed[:-self.keep]):
                    remove_tree(p, wait=False)
        except OSError as exc:
            warnings.warn(f"could not remove old checkpoints in {self.directory}: {exc}",
                          RuntimeWarning, stacklevel=3)

    # -- restore -------------------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Load the newest valid checkpoint on every rank; ``None`` when there is none at all.

        The chief verifies candidates newest first (marker, sizes, SHA-256) and skips damaged
        or partial ones with a warning; all ranks then load the chosen one. Raises
        :class:`CheckpointCorruptError` when checkpoints exist but none is valid, and
        :class:`UnsafeCheckpointError` when one carries a pickle payload.
        """
        ch = self.channel
        decision: dict[str, Any] = {"step": -1, "skipped": [], "fatal": ""}
        kept: dict[str, np.ndarray] = {}
        fatal: BaseException | None = None
        if ch.is_chief:
            try:
                self.cleanup_temporaries()
                decision["step"], kept = self._choose(decision["skipped"])
            except (UnsafeCheckpointError, OSError) as exc:
                fatal = exc
                decision["fatal"] = _text(exc)
        decision["ref"] = self._choice_ref
        decision = ch.from_chief(decision, "checkpoint restore (choosing a checkpoint)")
        self._choice_ref = decision["ref"]
        if decision["fatal"]:
            if fatal is not None:
                raise fatal
            raise CheckpointError(f"restoring from {self.directory} failed on rank 0: "
                                  f"{decision['fatal']}")
        if decision["step"] < 0:
            if decision["skipped"]:
                raise CheckpointCorruptError(
                    f"no valid checkpoint in {self.directory}: "
                    + "; ".join(decision["skipped"])
                    + ". HINT: restore a copy of the directory, or delete it to start the "
                    "training from the beginning.")
            return None
        step = int(decision["step"])
        result, local_exc = None, None
        try:
            result = self._load(step, kept)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
            local_exc = exc
        failures = ch.failures(_text(local_exc), "checkpoint restore (loading)")
        if failures:
            if local_exc is not None:
                raise local_exc
            raise CheckpointError(f"loading {self.where(step)} failed on "
                                  f"{describe_failures(failures)}")
        self.latest_step = step
        return result

    def _choose(self, skipped: list[str]) -> tuple[int, dict[str, np.ndarray]]:
        for step, path in reversed(self.step_dirs()):
            try:
                manifest = read_marker(path)
                shared = tuple(n for n in manifest["files"] if not n.startswith("rank-"))
                return step, verify(path, manifest, keep=(*shared, rank_file(0)))
            except CheckpointCorruptError as exc:
                warnings.warn(f"skipping checkpoint {path.name}: {exc}", RuntimeWarning,
                              stacklevel=4)
                skipped.append(f"{path.name}: {exc}")
        return -1, {}

    def _load(self, step: int, kept: Mapping[str, np.ndarray]) -> Restored:
        path = self.directory / step_dir_name(step)
        manifest = read_marker(path)

        def read(name: str) -> Any:
            data = kept.get(name)
            if data is None:
                data = verify_file(path, manifest, name)
            if name.endswith(".json"):
                try:
                    return json.loads(data.tobytes())
                except ValueError as exc:
                    raise CheckpointCorruptError(f"{path.name}/{name} is not JSON") from exc
            return serialization.decode(data, f"{path.name}/{name}")

        replicated = {n.removesuffix(".safetensors"): read(n)
                      for n in sorted(manifest["files"]) if not n.startswith("rank-")}
        source: int | None = self.channel.rank
        if rank_file(self.channel.rank) not in manifest["files"]:  # more ranks than saved
            source = 0 if rank_file(0) in manifest["files"] else None
        per_rank = read(rank_file(source)) if source is not None else None
        return Restored(step=step, path=path, info=dict(manifest.get("info", {})),
                        world_size=int(manifest.get("world_size", 1)), replicated=replicated,
                        per_rank=per_rank, per_rank_source=source)

    def close(self) -> None:
        """Let go of the location (a store's lease); nothing to do for a local directory."""

    def finish(self) -> None:
        """Called at the end of training: raises what the saves left unsaid (a remote store
        that refused the last saves); nothing to do for a local directory."""

    # -- deletion ------------------------------------------------------------------------------
    def delete_all(self) -> None:
        """Remove every checkpoint (the chief only; call after the others are done with it)."""
        if not self.channel.is_chief:
            return
        for _, path in self.step_dirs():
            remove_tree(path)
        self.cleanup_temporaries()
        try:
            self.directory.rmdir()
        except OSError:
            pass  # not empty: the user keeps other files there


def _text(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    return f"{type(exc).__name__}: {exc}".strip()
