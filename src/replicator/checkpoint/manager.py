"""CheckpointManager: atomic, verified, multi-rank checkpoints over one storage protocol: a crash
at any point of a save leaves the previous save the newest valid one, and a restore loads the
newest save whose manifest and SHA-256 hashes verify (docs/fault_tolerance.md).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from replicator import fault_points
from replicator.checkpoint import serialization
from replicator.checkpoint.manifest import FileEntry, build
from replicator.checkpoint.storage import open_storage, step_dir_name
from replicator.checkpoint.store import DEFAULT_LEASE_TIMEOUT
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.timeouts import resolve_timeout
from replicator.cluster.worker_errors import record_backup
from replicator.comm import timing
from replicator.comm.collectives import Collectives
from replicator.comm.groups import collective_device
from replicator.comm.reduce_op import ReduceOp
from replicator.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    StoreLeaseError,
    UnsafeCheckpointError,
)


def group_collectives(group: dist.ProcessGroup | None = None) -> Collectives:
    """Collectives over ``group`` (``None``: the whole job) with the group's timeout; one rank
    of one when ``torch.distributed`` is not initialized (a single-process run)."""
    if not dist.is_available() or not dist.is_initialized():
        return Collectives(0, 1, torch.device("cpu"), resolve_timeout())
    return Collectives.for_group(group, collective_device(group),
                                 resolve_timeout(group=group))


class Channel:
    """JSON messages between the ranks of a job (one collective exchange per call), so that a
    failure on one rank becomes the same clear error on every rank, never a hang."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.is_chief = collectives.rank == 0

    def all_gather(self, message: Any, what: str) -> list[Any]:
        """Every rank's ``message`` (JSON-serialisable), in rank order, on every rank."""
        payload = json.dumps(message, allow_nan=True).encode()
        if self.world_size == 1:
            return [json.loads(payload)]
        texts = self.collectives.all_gather_bytes(payload, what)
        return [json.loads(t) for t in texts]

    def from_chief(self, message: Any, what: str) -> Any:
        """The chief's ``message`` on every rank (other ranks' arguments are ignored)."""
        return self.all_gather(message if self.is_chief else None, what)[0]

    def failures(self, error: str, what: str) -> dict[int, str]:
        """Agree on who failed: ``error`` is this rank's error text, empty when it succeeded."""
        return {r: e for r, e in enumerate(self.all_gather(error, what)) if e}

    def max_flag(self, flag: bool, what: str) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        return bool(self.collectives.all_reduce(value, ReduceOp.MAX, what).item() > 0)


def describe_failures(failures: dict[int, str]) -> str:
    """``rank 1: OSError: ...; rank 2: ...`` for an error message."""
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))


#: Writes ``(file name, state, label)`` items into a staging area of a storage and returns
#: their entries: the saver process's hand-off.
FileWriter = Callable[[Any, str, list[tuple[str, Any, str]]], dict[str, FileEntry]]

_STATE_NAME = re.compile(r"^[A-Za-z0-9_]{1,100}$")


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
    """A state tree flattened and copied at one moment: what a background save writes."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def freeze_state(state: Any, label: str, reuse: FrozenState | None = None) -> FrozenState:
    """Copy ``state`` into memory as it is now, into ``reuse``'s matching buffers where it can
    (a state that cannot be stored raises a save's ``TypeError`` here)."""
    tensors, metadata = serialization.flatten(state, label)
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
    """Save and restore checkpoints of a job at ``directory``, keeping the newest ``keep``.

    ``directory``: a local directory every rank sees, or an fsspec URL (with
    ``storage_options``; a lease held for ``job_id`` keeps a second job out). ``collectives``:
    the ranks that checkpoint together (default: the whole job). ``mirror``: for a URL, a local
    directory that also receives every save. A save a store refuses is logged and training
    goes on (:meth:`finish` raises at the end); a local save that fails raises on every rank.
    """

    def __init__(self, directory: Any, keep: int = 2, *,
                 collectives: Collectives | None = None, attempt: int | None = None,
                 mirror: str | os.PathLike[str] | CheckpointManager | None = None,
                 storage_options: Mapping[str, Any] | None = None, job_id: str | None = None,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
        if collectives is not None and not isinstance(collectives, Collectives):
            raise TypeError(f"collectives must be a Collectives, got {type(collectives).__name__}"
                            ". HINT: pass strategy.collectives, or nothing for the whole job")
        self.store = open_storage(directory, storage_options, job_id=job_id,
                                  lease_timeout=lease_timeout)
        self.keep = keep
        self._channel: Channel | None = Channel(collectives) if collectives is not None else None
        self.attempt = resolve_cluster().restart_count if attempt is None else attempt
        self.latest_step: int | None = None
        #: The committed save :meth:`restore` chose or the last save wrote.
        self._choice_ref: str | None = None
        self._token: str | None = None
        self._saves = 0
        self.mirror = self._open_mirror(mirror, collectives, directory)
        #: The steps of the saves a store refused since its last success, the last error, and
        #: what the last 20 refusals said.
        self._failed_steps: list[int] = []
        self.last_error: BaseException | None = None
        self.failure_log: list[str] = []

    def _open_mirror(self, mirror: Any, collectives: Collectives | None,
                     directory: Any) -> CheckpointManager | None:
        if mirror is None or isinstance(mirror, CheckpointManager):
            return mirror
        if not self.store.retries_later:
            raise ValueError(f"mirror= is for a backup location in an object store; "
                             f"{os.fspath(directory)!r} is already a local directory")
        local = open_storage(mirror, what="the mirror")
        if local.retries_later:
            raise ValueError(f"mirror= must be a local directory, got {os.fspath(mirror)!r}")
        return CheckpointManager(local, self.keep, collectives=collectives)

    @property
    def channel(self) -> Channel:
        """How the ranks agree (the whole job's unless ``collectives`` was given)."""
        if self._channel is None:
            self._channel = Channel(group_collectives())
        return self._channel

    @property
    def directory(self) -> Any:
        """The location: a local :class:`Path`, or the URL of a store."""
        return self.store.location

    def where(self, step: int) -> Any:
        """Where the checkpoint of ``step`` lives, for messages."""
        if not self.store.retries_later:  # a local save's name is its step's
            return self.store.where(step_dir_name(step))
        ref = self._choice_ref if self.latest_step == step else None
        return self.store.where(ref) if ref else f"{self.directory} (step {step})"

    # -- the job's claim on the location ------------------------------------------------------
    def open(self, channel: Channel | None = None) -> None:
        """Take the store's lease (the chief) and agree on this run's save token; every rank
        calls it once, before the first save (restore does)."""
        if self._token is not None:
            return
        ch = channel or self.channel
        message = {"token": uuid.uuid4().hex[:8], "error": "", "io": False}
        lease_exc: BaseException | None = None
        if ch.is_chief:
            try:
                self.store.open()
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                message.update(error=_text(exc), io=isinstance(exc, OSError))
                lease_exc = exc
        message = ch.from_chief(message, "checkpoint store lease")
        if message["io"]:  # the store is unreachable: a save fails (logged), a later retries
            raise CheckpointWriteError(f"cannot take the lease of {self.directory}: "
                                       f"{message['error']}") from lease_exc
        if message["error"]:
            raise lease_exc or StoreLeaseError(f"rank 0 could not take the lease of "
                                               f"{self.directory}: {message['error']}")
        self._token = message["token"]

    def close(self) -> None:
        """Let go of the location (a store's lease, on the chief)."""
        if self.channel.is_chief:
            self.store.release()

    def commits(self) -> list[tuple[int, str]]:
        """``(step, name)`` of every save the location lists, oldest first."""
        return self.store.saves()

    def committed_steps(self) -> list[int]:
        """Steps with a commit (not verified; see :meth:`restore`)."""
        return self.store.committed()

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, replicated: Mapping[str, Any] | None = None,
             per_rank: Any = None, info: Mapping[str, Any] | None = None, *,
             channel: Channel | None = None, writer: FileWriter | None = None) -> Any:
        """Write and commit the checkpoint of ``step``; every rank calls this together.

        ``replicated``: named states the same on every rank (the chief writes them);
        ``per_rank``: this rank's own state; ``info``: JSON for the manifest; ``writer``: writes
        this rank's files (the saver process). Returns where the save is; a failure raises
        :class:`CheckpointWriteError` on every rank (in a store: logged, and ``None``).
        """
        with timing.region("checkpoint"):  # a profile shows the save apart from compute
            return self._save_or_log(step, replicated, per_rank, info, channel, writer)

    def _save_or_log(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
                     info: Mapping[str, Any] | None, channel: Channel | None,
                     writer: FileWriter | None) -> Any:
        mirrored = None if self.mirror is None else self.mirror.save(
            step, replicated, per_rank, info, channel=channel, writer=writer)
        try:
            where = self._save(step, replicated, per_rank, info, channel, writer)
        except CheckpointWriteError as exc:
            if not self.store.retries_later:  # a local save that fails raises on every rank
                raise
            self.last_error = exc
            self._failed_steps.append(step)
            self.failure_log = [*self.failure_log[-19:], f"step {step}: {exc}"]
            if (channel or self.channel).is_chief:
                kept = (f"; the local mirror {self.mirror.directory} holds it" if
                        self.mirror is not None else "")
                print(f"[replicator] the backup of step {step} did not reach {self.directory} "
                      f"({len(self._failed_steps)} failed in a row{kept}); training goes on and "
                      f"the next save tries again. {exc}", file=sys.stderr, flush=True)
            return mirrored
        self.last_error, self._failed_steps = None, []
        return where

    def _save(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
              info: Mapping[str, Any] | None, channel: Channel | None,
              writer: FileWriter | None) -> Any:
        """The save protocol: write, agree, commit on the chief, hear the outcome, prune."""
        ch = channel or self.channel
        self.open(ch)
        self._saves += 1
        staging = self.store.staging(step, f"{self._token}-{self.attempt}x{self._saves}")
        entries: dict[str, FileEntry] = {}
        local_exc: BaseException | None = None
        try:
            if ch.is_chief:
                self.store.check()
            fault_points.fire("before_write", step=step, rank=ch.rank,
                              path=self.store.dest(staging, "")[:-1])
            self.store.begin(staging)
            items = [] if per_rank is None else [  # (file name, state, label)
                (rank_file(ch.rank), per_rank, f"rank {ch.rank}'s state")]
            if ch.is_chief:
                items += [(f"{check_state_name(key)}.safetensors", state, key)
                          for key, state in (replicated or {}).items()]
            entries = writer(self.store, staging, items) if writer is not None else {
                fname: self.store.write(staging, fname, *serialization.flatten(state, label))
                for fname, state, label in items}
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
            local_exc = exc

        def noted(ref: str) -> None:
            record_backup(self.directory, step)  # what a rerun resumes from, said at once
            fault_points.fire("after_commit", step=step, path=self.store.where(ref),
                              rank=ch.rank)

        ref = commit_agreed(self.store, ch, step, staging, entries, local_exc, dict(info or {}),
                            self.keep, lambda failed, cause: self._write_error(step, failed, cause),
                            noted, lambda path: fault_points.fire("before_commit", step=step,
                                                                  path=path, rank=ch.rank))
        self.latest_step, self._choice_ref = step, ref
        return self.store.where(ref)

    def _write_error(self, step: int, failures: dict[int, str],
                     cause: BaseException | None) -> CheckpointWriteError:
        full = any("No space left" in e or "ENOSPC" in e for e in failures.values()) or (
            isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT))
        previous = (f"the previous checkpoint (step {self.latest_step}) is intact"
                    if self.latest_step is not None else "no earlier checkpoint exists")
        hint = (f"free space on the file system of {self.directory} (or lower keep=)" if full
                else f"check that every rank can write to {self.directory}" if not
                self.store.retries_later else "check that the store is reachable and that "
                f"every rank's credentials can write to {self.directory}")
        err = CheckpointWriteError(
            f"saving the checkpoint of step {step} to {self.directory} failed "
            f"({describe_failures(failures)}). Nothing was committed and {previous}. "
            f"HINT: {hint}.")
        err.__cause__ = cause
        return err

    def finish(self) -> None:
        """Raise :class:`CheckpointWriteError` when the last saves never reached the store
        (called at the end of training; nothing to say for a local directory)."""
        if not self._failed_steps:
            return
        steps = self._failed_steps
        kept = (f"The training's newest state (step {steps[-1]}) is in the local mirror "
                f"{self.mirror.directory}; copy it to the store once it is back, or resume "
                "from it." if self.mirror is not None else
                "Nothing holds that state. HINT: pass mirror='ckpt/' to keep a local copy of "
                "every backup.")
        raise CheckpointWriteError(
            f"the object store {self.directory} was unreachable for the last {len(steps)} saves "
            f"(steps {', '.join(map(str, steps[-5:]))}); its newest backup is "
            f"{'step ' + str(self.latest_step) if self.latest_step is not None else 'none'}. "
            f"{kept} Last error: {self.last_error}") from self.last_error

    # -- restore -------------------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Load the newest valid checkpoint on every rank (``None``: there is none at all).

        The chief verifies candidates newest first, skipping damaged or partial ones with a
        warning (:class:`CheckpointCorruptError` when none is valid). With a mirror, from the
        mirror when it is newer or the store is down.
        """
        if self.mirror is not None and self._mirror_is_newer():
            restored = self.mirror.restore()
            self.latest_step = restored.step if restored is not None else self.latest_step
            return restored
        self.open()
        ch = self.channel
        decision: dict[str, Any] = {"step": -1, "skipped": [], "fatal": "", "ref": None}
        kept: dict[str, np.ndarray] = {}
        fatal: BaseException | None = None
        if ch.is_chief:
            try:
                removed = self.store.cleanup()  # what interrupted saves left (never read)
                if removed:
                    print(f"[replicator] removed {len(removed)} leftover(s) of an interrupted "
                          f"save or deletion in {self.directory}: {', '.join(removed)}",
                          file=sys.stderr, flush=True)
                decision["step"], decision["ref"], kept = self._choose(decision["skipped"])
            except (UnsafeCheckpointError, OSError) as exc:
                fatal = exc
                decision["fatal"] = _text(exc)
        decision = ch.from_chief(decision, "checkpoint restore (choosing a checkpoint)")
        if decision["fatal"]:
            raise fatal or CheckpointError(f"restoring from {self.directory} failed on rank 0: "
                                           f"{decision['fatal']}")
        if decision["step"] < 0:
            if decision["skipped"]:
                raise CheckpointCorruptError(
                    f"no valid checkpoint in {self.directory}: " + "; ".join(decision["skipped"])
                    + ". HINT: restore a copy of the directory, or delete it to start the "
                    "training from the beginning.")
            return None
        step, ref = int(decision["step"]), str(decision["ref"])
        result, local_exc = None, None
        try:
            result = self._load(step, ref, kept)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
            local_exc = exc
        failures = ch.failures(_text(local_exc), "checkpoint restore (loading)")
        if failures:
            raise local_exc or CheckpointError(f"loading {self.store.where(ref)} failed on "
                                               f"{describe_failures(failures)}")
        self.latest_step, self._choice_ref = step, ref
        return result

    def _mirror_is_newer(self) -> bool:
        """The chief decides whether the mirror holds a newer save (or the store is down)."""
        assert self.mirror is not None
        ch = self.channel
        choice = {"mirror": False, "why": ""}
        if ch.is_chief:
            local = self.mirror.committed_steps()
            try:
                remote = self.committed_steps()
            except OSError as exc:
                choice = {"mirror": bool(local), "why": f"{self.directory} cannot be read ({exc})"}
            else:
                if local and (not remote or local[-1] > remote[-1]):
                    choice = {"mirror": True, "why": f"it holds step {local[-1]}, newer than "
                              f"the store's {remote[-1] if remote else 'none'}"}
        choice = ch.from_chief(choice, "checkpoint restore (store or mirror)")
        if choice["mirror"] and ch.is_chief:
            print(f"[replicator] restoring from the local mirror {self.mirror.directory}: "
                  f"{choice['why']}", file=sys.stderr, flush=True)
        return bool(choice["mirror"])

    def _choose(self, skipped: list[str]) -> tuple[int, str | None, dict[str, np.ndarray]]:
        """The newest save whose every file verifies, and the bytes of the files every rank
        reads (the replicated ones, rank 0's)."""
        for step, ref in reversed(self.store.saves()):
            try:
                manifest = self.store.manifest(ref)
                kept = {}
                for fname in sorted(manifest["files"]):
                    data = self.store.read(ref, manifest, fname)  # every file verified
                    if not fname.startswith("rank-") or fname == rank_file(0):
                        kept[fname] = data
                return step, ref, kept
            except CheckpointCorruptError as exc:
                warnings.warn(f"skipping checkpoint {ref}: {exc}", RuntimeWarning, stacklevel=4)
                skipped.append(f"{ref}: {exc}")
        return -1, None, {}

    def _load(self, step: int, ref: str, kept: Mapping[str, np.ndarray]) -> Restored:
        manifest = self.store.manifest(ref)

        def read(fname: str) -> Any:
            data = kept.get(fname)
            if data is None:
                data = self.store.read(ref, manifest, fname)
            if fname.endswith(".json"):
                try:
                    return json.loads(data.tobytes())
                except ValueError as exc:
                    raise CheckpointCorruptError(f"{ref}/{fname} is not JSON") from exc
            return serialization.decode(data, f"{ref}/{fname}")

        files = manifest["files"]
        replicated = {n.removesuffix(".safetensors"): read(n)
                      for n in sorted(files) if not n.startswith("rank-")}
        source = self.channel.rank if rank_file(self.channel.rank) in files else (
            0 if rank_file(0) in files else None)  # more ranks than saved: rank 0's
        per_rank = read(rank_file(source)) if source is not None else None
        return Restored(step=step, path=self.store.where(ref), info=dict(manifest.get("info", {})),
                        world_size=int(manifest.get("world_size", 1)), replicated=replicated,
                        per_rank=per_rank, per_rank_source=source)

    def delete_all(self) -> None:
        """Remove every checkpoint (the chief only; call after the others are done with it)."""
        if self.channel.is_chief:
            self.store.delete_all()


def commit_agreed(storage: Any, ch: Channel, step: int, staging: str,
                  entries: Mapping[str, FileEntry], local_exc: BaseException | None,
                  info: dict[str, Any], keep: int,
                  error: Callable[[dict[int, str], BaseException | None], Exception],
                  on_commit: Callable[[str], None] | None = None,
                  before_commit: Callable[[Any], None] | None = None) -> str:
    """The save protocol after the writes, for every kind of save: the ranks agree that every
    write succeeded (else ``error(failures, cause)`` on every rank), the chief commits the
    manifest of every rank's files, every rank hears the outcome, the chief prunes to ``keep``.
    Returns the committed save's name."""
    results = ch.all_gather(
        {"error": _text(local_exc), "files": {n: asdict(e) for n, e in entries.items()}},
        f"checkpoint save of step {step} (writes)")
    failures = {r: m["error"] for r, m in enumerate(results) if m["error"]}
    if failures:
        if ch.is_chief:
            storage.discard(staging)
        if local_exc is not None and not isinstance(local_exc, OSError):
            raise local_exc
        raise error(failures, local_exc)
    ref, commit_exc = None, None
    if ch.is_chief:
        try:
            files: dict[str, FileEntry] = {}
            for rank, message in enumerate(results):
                for fname, entry in message["files"].items():
                    if fname in files:
                        raise CheckpointWriteError(f"two ranks wrote the file {fname!r} (rank "
                                                   f"{rank} and an earlier one)")
                    files[fname] = FileEntry(**entry)
            ref = storage.commit(step, staging, build(step, ch.world_size, files, info),
                                 before_commit)
            if on_commit is not None:
                on_commit(ref)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            commit_exc = exc
    outcome = ch.from_chief({"error": _text(commit_exc), "ref": ref},
                            f"checkpoint save of step {step} (commit)")
    if outcome["error"]:
        raise error({0: outcome["error"]}, commit_exc)
    if ch.is_chief:
        storage.prune(step, outcome["ref"], keep)
    return str(outcome["ref"])


def _text(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {exc}".strip()
