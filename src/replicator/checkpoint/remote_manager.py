"""Checkpoints in an object store: a commit protocol for stores without an atomic rename.

Layout under the URL::

    LEASE.json                               the writing job's id and heartbeat (lease.py)
    data/step-00000030.3f2a9c01-0/           one save's objects, under a prefix of its own
        model.safetensors  optimizer.safetensors  rank-00000.safetensors ...
    commits/step-00000030.3f2a9c01-0.json    its commit object, written last

A save uploads every file under a prefix no other save uses (the step, a token the ranks agree
on once, and a save counter), hashing each as it goes; the ranks agree that every upload
succeeded, the chief checks that each object is in the store with its size, and only then
writes the commit object (the manifest of ``manifest.py``: SHA-256 and size of every file, its
own checksum, and the prefix). Readers list the commit objects and choose the newest whose
files all verify, skipping partial or damaged saves with the object's name and the hash
mismatch in the warning. Keep-last-k deletes a save's commit object, then its prefix, only
after a newer commit exists; prefixes that never got a commit are deleted once a save of the
same or a later step committed (never a later step's prefix: the other ranks may already be
uploading the next save while the chief prunes).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from replicator.checkpoint import fault_points, safetensors_io, serialization
from replicator.checkpoint.commit_objects import (
    COMMITS,
    DATA,
    hash_bytes,
    list_commits,
    prune_commits,
    read_commit,
    remove_upload,
)
from replicator.checkpoint.exchange import Channel, describe_failures
from replicator.checkpoint.lease import DEFAULT_LEASE_TIMEOUT, Lease
from replicator.checkpoint.manager import (
    REMOTE_MANAGER,
    CheckpointManager,
    FileWriter,
    FrozenState,
    Restored,
    _text,
    rank_file,
    step_dir_name,
)
from replicator.checkpoint.manifest import FileEntry, build, check_bytes
from replicator.checkpoint.store import RemoteStore, is_remote, local_path, open_store
from replicator.comm.collectives import Collectives
from replicator.errors import CheckpointCorruptError, CheckpointWriteError, StoreLeaseError


class RemoteCheckpointManager(CheckpointManager):
    """:class:`CheckpointManager` over an fsspec URL, with commit objects and a lease.

    ``job_id`` / ``lease_timeout``: see :mod:`replicator.checkpoint.lease`.
    """

    def __init__(self, store: RemoteStore | str, keep: int = 2, *,
                 collectives: Collectives | None = None, attempt: int | None = None,
                 job_id: str | None = None,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
                 mirror: CheckpointManager | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(".", keep, collectives=collectives, attempt=attempt)
        if not isinstance(store, RemoteStore):
            store = RemoteStore(os.fspath(store), storage_options)
        self.store = store
        self.url = store.url
        self.lease = Lease(store, job_id, lease_timeout)
        #: A local manager that every save is also committed to, first.
        self.mirror = mirror
        self._token: str | None = None
        self._saves = 0
        #: Saves the store refused since its last success, and the last error.
        self.failed_saves = 0
        self.last_error: BaseException | None = None
        self._failed_steps: list[int] = []
        #: What each refused save said, oldest first (the last 20).
        self.failure_log: list[str] = []

    @property  # type: ignore[override]
    def directory(self) -> str:  # type: ignore[override]
        return self.url

    @directory.setter
    def directory(self, value: Any) -> None:
        pass  # the base class sets a local path; a store has its URL

    def where(self, step: int) -> str:
        ref = self._choice_ref if self.latest_step == step else None
        return f"{self.url}/{COMMITS}/{ref}" if ref else f"{self.url} (step {step})"

    # -- the job's claim on the location ------------------------------------------------------
    def open(self, channel: Channel | None = None) -> None:
        """Take the lease (the chief) and agree on this run's save token; every rank calls it
        once, before the first save (restore does)."""
        if self._token is not None:
            return
        ch = channel or self.channel
        message = {"token": uuid.uuid4().hex[:8], "error": "", "io": False}
        lease_exc: BaseException | None = None
        if ch.is_chief:
            try:
                self.lease.acquire()
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                message.update(error=_text(exc), io=isinstance(exc, OSError))
                lease_exc = exc
        message = ch.from_chief(message, "checkpoint store lease")
        if message["io"]:  # the store is unreachable: a save fails (logged), a later retries
            raise CheckpointWriteError(f"cannot take the lease of {self.url}: "
                                       f"{message['error']}") from lease_exc
        if message["error"]:
            if lease_exc is not None:
                raise lease_exc
            raise StoreLeaseError(f"rank 0 could not take the lease of {self.url}: "
                                  f"{message['error']}")
        self._token = message["token"]

    def close(self) -> None:
        """Release the lease (the chief; a no-op elsewhere)."""
        if self.channel.is_chief:
            self.lease.release()

    # -- listing ------------------------------------------------------------------------------
    def commits(self) -> list[tuple[int, str]]:
        """``(step, commit object name)`` of every commit object, oldest first."""
        return list_commits(self.store)

    def committed_steps(self) -> list[int]:
        return sorted({s for s, _ in self.commits()})

    def step_dirs(self) -> list[tuple[int, Any]]:
        return [(s, f"{self.url}/{COMMITS}/{n}") for s, n in self.commits()]

    def cleanup_temporaries(self) -> None:
        """Nothing to do before a restore: an upload without a commit is never read, and it
        is deleted once a newer save commits."""

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, replicated: Mapping[str, Any] | None = None,
             per_rank: Any = None, info: Mapping[str, Any] | None = None, *,
             channel: Channel | None = None, writer: FileWriter | None = None) -> Any:
        """Commit the save to the mirror (if any), then to the store. A save the store
        refuses (unreachable, failed upload) is logged and counted, training goes on and the
        next save tries again; :meth:`finish` raises at the end if the newest state never
        reached the store. Returns the commit's URL, or the mirror's path (``None``: neither).
        """
        mirrored = None
        if self.mirror is not None:
            mirrored = self.mirror.save(step, replicated, per_rank, info, channel=channel,
                                        writer=writer)
        try:
            url = self._save_remote(step, replicated, per_rank, info, channel, writer)
        except CheckpointWriteError as exc:
            self.failed_saves += 1
            self.last_error = exc
            self._failed_steps.append(step)
            self.failure_log = [*self.failure_log[-19:], f"step {step}: {exc}"]
            ch = channel or self.channel
            if ch.is_chief:
                kept = (f"; the local mirror {self.mirror.directory} holds it" if
                        self.mirror is not None else "")
                print(f"[replicator] the backup of step {step} did not reach {self.url} "
                      f"({self.failed_saves} failed in a row{kept}); training goes on and the "
                      f"next save tries again. {exc}", file=sys.stderr, flush=True)
            return mirrored
        self.failed_saves = 0
        self.last_error = None
        self._failed_steps = []
        return url

    def finish(self) -> None:
        """Raise :class:`CheckpointWriteError` when the last saves never reached the store."""
        if not self._failed_steps:
            return
        steps = self._failed_steps
        kept = (f"The training's newest state (step {steps[-1]}) is in the local mirror "
                f"{self.mirror.directory}; copy it to the store once it is back, or resume "
                "from it." if self.mirror is not None else
                "Nothing holds that state. HINT: pass mirror='ckpt/' to keep a local copy of "
                "every backup.")
        err = CheckpointWriteError(
            f"the object store {self.url} was unreachable for the last {len(steps)} saves "
            f"(steps {', '.join(map(str, steps[-5:]))}); its newest backup is "
            f"{'step ' + str(self.latest_step) if self.latest_step is not None else 'none'}. "
            f"{kept} Last error: {self.last_error}")
        err.__cause__ = self.last_error
        raise err

    def _save_remote(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
                     info: Mapping[str, Any] | None, channel: Channel | None,
                     writer: FileWriter | None) -> str:
        ch = channel or self.channel
        self.open(ch)
        self._saves += 1
        save_id = f"{self._token}-{self.attempt}x{self._saves}"
        prefix = f"{DATA}/{step_dir_name(step)}.{save_id}"
        entries: dict[str, FileEntry] = {}
        local_exc: BaseException | None = None
        try:
            if ch.is_chief:
                self.lease.check()
            fault_points.fire("before_write", step=step, path=self.store.name_url(prefix),
                              rank=ch.rank)
            entries = self._write_all(self.store.path(prefix), self.store,
                                      self._items(replicated, per_rank, ch), writer)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
            local_exc = exc
        results = ch.all_gather(
            {"error": _text(local_exc), "files": {n: e.as_json() for n, e in entries.items()}},
            f"checkpoint save of step {step} (uploads)")
        failures = {r: m["error"] for r, m in enumerate(results) if m["error"]}
        if failures:
            if ch.is_chief:
                remove_upload(self.store, prefix)
            if local_exc is not None and not isinstance(local_exc, OSError):
                raise local_exc
            raise self._write_error(step, failures, local_exc)
        commit_exc: BaseException | None = None
        name = f"{step_dir_name(step)}.{save_id}.json"
        if ch.is_chief:
            files = {n: FileEntry(**e) for m in results for n, e in m["files"].items()}
            commit_exc = self._commit(step, prefix, name, files, dict(info or {}), ch)
        outcome = ch.from_chief(_text(commit_exc), f"checkpoint save of step {step} (commit)")
        if outcome:
            raise self._write_error(step, {0: outcome}, commit_exc)
        self.latest_step = step
        self._choice_ref = name
        if ch.is_chief:
            self._prune_remote(step, name)
        return f"{self.url}/{COMMITS}/{name}"

    def _write_all(self, base: str, store: Any, items: list[tuple[str, Any, str]],
                   writer: FileWriter | None) -> dict[str, FileEntry]:
        if writer is not None:
            return writer(base, store, items)
        entries = {}
        for fname, state, label in items:  # in this thread: serialise, hash, upload
            if isinstance(state, FrozenState):
                data = safetensors_io.to_bytes(state.tensors, state.metadata)
            else:
                data = serialization.encode(state, label)
            self.store.put_path(f"{base}/{fname}", data)
            entries[fname] = FileEntry(bytes=len(data), sha256=hash_bytes(data))
        return entries

    def _commit(self, step: int, prefix: str, name: str,  # type: ignore[override]
                files: dict[str, FileEntry], info: dict[str, Any],
                ch: Channel) -> BaseException | None:
        try:
            listed = dict(self.store.objects(prefix))
            for fname, entry in files.items():
                if listed.get(fname) != entry.bytes:
                    raise OSError(f"{self.store.name_url(prefix)}/{fname} is "
                                  f"{'missing' if fname not in listed else 'the wrong size'} "
                                  "in the store after its upload")
            manifest = build(step, ch.world_size, files, info, prefix=prefix)
            fault_points.fire("before_commit", step=step, path=self.store.name_url(prefix),
                              rank=ch.rank)
            self.lease.check()
            self.store.put(f"{COMMITS}/{name}",
                           json.dumps(manifest, indent=1, sort_keys=True,
                                      allow_nan=True).encode())
            fault_points.fire("after_commit", step=step, path=self.store.name_url(prefix),
                              rank=ch.rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            remove_upload(self.store, prefix)
            return exc
        return None

    def _write_error(self, step: int, failures: dict[int, str],
                     cause: BaseException | None) -> CheckpointWriteError:
        previous = (f"the previous backup (step {self.latest_step}) is intact"
                    if self.latest_step is not None else "no earlier backup exists")
        err = CheckpointWriteError(
            f"saving the checkpoint of step {step} to {self.url} failed "
            f"({describe_failures(failures)}). Nothing was committed and {previous}. "
            f"HINT: check that the store is reachable and that every rank's credentials can "
            f"write to {self.url}.")
        if cause is not None:
            err.__cause__ = cause
        return err

    def _prune_remote(self, step: int, newest: str) -> None:
        prune_commits(self.store, step, newest, self.keep)

    # -- restore --------------------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Load the newest verified backup; from the mirror when it is newer than the
        store's, or when the store cannot be reached (said in the log)."""
        if self.mirror is None:
            self.open()
            return super().restore()
        ch = self.channel
        choice = {"source": "store", "why": ""}
        if ch.is_chief:
            local = self.mirror.committed_steps()
            try:
                remote = self.committed_steps()
            except OSError as exc:
                if local:
                    choice = {"source": "mirror", "why": f"{self.url} cannot be read ({exc})"}
            else:
                if local and (not remote or local[-1] > remote[-1]):
                    choice = {"source": "mirror", "why": f"it holds step {local[-1]}, newer "
                              f"than the store's {remote[-1] if remote else 'none'}"}
        choice = ch.from_chief(choice, "checkpoint restore (store or mirror)")
        if choice["source"] == "mirror":
            if ch.is_chief:
                print(f"[replicator] restoring from the local mirror "
                      f"{self.mirror.directory}: {choice['why']}", file=sys.stderr, flush=True)
            restored = self.mirror.restore()
            if restored is not None:
                self.latest_step = restored.step
            return restored
        self.open()
        return super().restore()

    def _fetch(self, prefix: str, manifest: Mapping[str, Any], name: str,
               where: str) -> np.ndarray:
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointCorruptError(f"{where} does not list {name!r}")
        try:
            data = self.store.get(f"{prefix}/{name}")
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{where}: object {self.store.name_url(prefix)}/{name} is missing") from None
        check_bytes(where, f"object {self.store.name_url(prefix)}/{name}", entry, len(data),
                    hash_bytes(data))
        return np.frombuffer(bytearray(data), dtype=np.uint8)

    def _read_commit(self, name: str) -> dict[str, Any]:
        return read_commit(self.store, name)

    def _choose(self, skipped: list[str]) -> tuple[int, dict[str, np.ndarray]]:
        self._choice_ref = None
        for step, name in reversed(self.commits()):
            where = f"commit {COMMITS}/{name}"
            try:
                manifest = self._read_commit(name)
                kept = {}
                shared = tuple(n for n in manifest["files"] if not n.startswith("rank-"))
                for fname in sorted(manifest["files"]):
                    data = self._fetch(manifest["prefix"], manifest, fname, where)
                    if fname in (*shared, rank_file(0)):
                        kept[fname] = data
                self._choice_ref = name
                return step, kept
            except CheckpointCorruptError as exc:
                warnings.warn(f"skipping checkpoint {name}: {exc}", RuntimeWarning,
                              stacklevel=4)
                skipped.append(f"{name}: {exc}")
        return -1, {}

    def _load(self, step: int, kept: Mapping[str, np.ndarray]) -> Restored:
        name = str(self._choice_ref)
        manifest = self._read_commit(name)
        where = f"commit {COMMITS}/{name}"

        def read(fname: str) -> Any:
            data = kept.get(fname)
            if data is None:
                data = self._fetch(manifest["prefix"], manifest, fname, where)
            if fname.endswith(".json"):
                return json.loads(data.tobytes())
            return serialization.decode(data, f"{name}/{fname}")

        replicated = {n.removesuffix(".safetensors"): read(n)
                      for n in sorted(manifest["files"]) if not n.startswith("rank-")}
        source: int | None = self.channel.rank
        if rank_file(self.channel.rank) not in manifest["files"]:
            source = 0 if rank_file(0) in manifest["files"] else None
        per_rank = read(rank_file(source)) if source is not None else None
        return Restored(step=step, path=f"{self.url}/{COMMITS}/{name}",  # type: ignore[arg-type]
                        info=dict(manifest.get("info", {})),
                        world_size=int(manifest.get("world_size", 1)), replicated=replicated,
                        per_rank=per_rank, per_rank_source=source)

    # -- deletion -------------------------------------------------------------------------------
    def delete_all(self) -> None:
        if not self.channel.is_chief:
            return
        for _, name in self.commits():
            self.store.remove(f"{COMMITS}/{name}")
        self.store.remove(DATA, recursive=True)
        self.store.remove(COMMITS, recursive=True)
        self.lease.release()


REMOTE_MANAGER["class"] = RemoteCheckpointManager


def open_manager(target: str | os.PathLike[str], keep: int = 2, *,
                 collectives: Collectives | None = None,
                 mirror: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 job_id: str | None = None,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> CheckpointManager:
    """A :class:`CheckpointManager` for a local path (the local code path, unchanged) or a
    :class:`RemoteCheckpointManager` for an fsspec URL; ``mirror``: a local directory that
    also receives every save of a URL (refused for a local path: save there directly)."""
    location = open_store(target, storage_options, "the checkpoint location")
    if isinstance(location, Path):
        if mirror is not None:
            raise ValueError(f"mirror= is for a backup location in an object store; "
                             f"{os.fspath(target)!r} is already a local directory")
        return CheckpointManager(location, keep, collectives=collectives)
    local = None
    if mirror is not None:
        if is_remote(mirror):
            raise ValueError(f"mirror= must be a local directory, got {os.fspath(mirror)!r}")
        local = CheckpointManager(local_path(mirror), keep, collectives=collectives)
    return RemoteCheckpointManager(location, keep, collectives=collectives, job_id=job_id,
                                   lease_timeout=lease_timeout, mirror=local)
