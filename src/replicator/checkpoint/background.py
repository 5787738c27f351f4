"""Checkpoint saves that write and commit on a thread while training goes on.

At the step boundary the state is copied into memory (:func:`freeze_state`: a flat copy of
every tensor, the non-tensor parts as JSON); the step that follows starts at once. A thread
then writes the files, agrees with the other ranks that every write succeeded and lets the
chief commit, exactly as a foreground save does (temporary directory, fsync, rename, the
SHA-256 manifest last): a crash in the middle leaves the previous backup as the newest valid
one. At most one save is in flight; starting another first waits for the one before, and a
save's error is raised then, or by :meth:`BackgroundSaver.wait` at the end, never dropped.

The thread's agreement runs over a private copy of the job's group (created once, on the
caller's thread, by every rank together), so it never interleaves with the collectives that
training issues on the main thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint.exchange import Channel
from replicator.checkpoint.manager import (
    CheckpointManager,
    FileWriter,
    FrozenState,
    freeze_state,
    step_dir_name,
)
from replicator.errors import CheckpointWriteError

#: The least time :meth:`BackgroundSaver.wait` waits for a save's thread (slow disks).
MIN_WAIT_SECONDS = 600.0


class BackgroundSaver:
    """Runs :meth:`CheckpointManager.save` for one checkpoint at a time on a thread.

    Every rank calls :meth:`submit` at the same step (it is a collective the first time).
    ``on_saved(step, path)`` runs on the thread once a save is committed on every rank.
    """

    def __init__(self, manager: CheckpointManager,
                 on_saved: Callable[[int, Path], None] | None = None) -> None:
        self.manager = manager
        self.on_saved = on_saved
        self._channel: Channel | None = None
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: BaseException | None = None
        self._saved: tuple[int, Path] | None = None
        #: The last save's copies, reused by the next one (it is done with them by then).
        self._frozen: dict[str, FrozenState] = {}
        #: Seconds the caller spent in the last :meth:`submit` (copying the state).
        self.last_submit_seconds = 0.0
        #: Seconds the last save took on its thread (write, agreement, commit).
        self.last_write_seconds = 0.0

    @property
    def in_flight(self) -> int | None:
        """The step being saved right now (``None``: no save is running)."""
        thread = self._thread
        return self._step if thread is not None and thread.is_alive() else None

    def _writer(self) -> FileWriter | None:
        """Who writes this rank's files: this thread (``None``) here."""
        return None

    def _private_channel(self) -> Channel:
        """A channel over a private copy of the job's group (collective on first use)."""
        if self._channel is None:
            own = self.manager.channel
            coll = own.collectives
            if own.world_size == 1:
                self._channel = own
            else:
                from replicator.comm.collectives import Collectives
                from replicator.comm.groups import group_ranks, new_private_group

                group = new_private_group(group_ranks(coll.group), "checkpoint",
                                          coll.timeout_seconds, backend="gloo")
                self._channel = Channel(Collectives(own.rank, own.world_size,
                                                    torch.device("cpu"), coll.timeout_seconds,
                                                    None, group=group))
        return self._channel

    def submit(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
               info: Mapping[str, Any] | None,
               before: Callable[[Channel], Any] | None = None) -> Path:
        """Copy the state now and save it as ``step`` on the thread; return the path it will
        have. Waits for the save before this one first (raising its error, if any).
        ``before(channel)`` runs on the thread first (a sharded save the backup names)."""
        self.wait()
        start = time.perf_counter()
        channel = self._private_channel()
        old = self._frozen
        frozen_rep = ({name: freeze_state(state, name, old.get(name))
                       for name, state in replicated.items()}
                      if replicated is not None else None)
        frozen_rank = freeze_state(per_rank, f"rank {channel.rank}'s state",
                                   old.get("rank-")) if per_rank is not None else None
        self._frozen = dict(frozen_rep or {})
        if frozen_rank is not None:
            self._frozen["rank-"] = frozen_rank
        info = dict(info or {})
        self._step, self._error, self._saved = step, None, None
        self._thread = threading.Thread(
            target=self._run, args=(step, frozen_rep, frozen_rank, info, channel, before),
            name=f"replicator-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.last_submit_seconds = time.perf_counter() - start
        directory = self.manager.directory
        return directory / step_dir_name(step) if isinstance(directory, Path) \
            else self.manager.where(step)  # type: ignore[return-value]

    def _run(self, step: int, replicated: Mapping[str, Any] | None,
             per_rank: Any, info: dict[str, Any], channel: Channel,
             before: Callable[[Channel], Any] | None = None) -> None:
        start = time.perf_counter()
        try:
            if before is not None:
                before(channel)
            path = self.manager.save(step, replicated, per_rank, info, channel=channel,
                                     writer=self._writer())
            if path is not None:  # None: a store refused it (logged; the next save retries)
                self._saved = (step, path)
                if self.on_saved is not None:
                    self.on_saved(step, path)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread later
            self._error = exc
        finally:
            self.last_write_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Nothing to release: the thread ends with its save."""

    def wait(self) -> tuple[int, Path] | None:
        """Wait for the save in flight; return ``(step, path)`` of the save that finished
        (``None`` when none was pending) or raise its error. Bounded: the thread's agreement
        waits at most the collective timeout for the other ranks."""
        thread = self._thread
        if thread is None:
            return None
        limit = max(MIN_WAIT_SECONDS, 4 * self.manager.channel.collectives.timeout_seconds)
        thread.join(limit)
        if thread.is_alive():
            raise CheckpointWriteError(
                f"the background save of step {self._step} to {self.manager.directory} did "
                f"not finish in {limit:.0f} s. HINT: the file system may be stalled; the "
                "previous checkpoint is still the newest valid one.")
        self._thread = None
        error, self._error = self._error, None
        saved, self._saved = self._saved, None
        if error is not None:
            raise error
        return saved
