"""Background saves: the loop waits only for a copy of the state, then one writer thread writes
and commits each save as a foreground one, its files written by that thread or by a saver
process from shared memory (``async_mode``; docs/remote_storage.md).
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator import fault_points
from replicator.checkpoint import serialization
from replicator.checkpoint.manager import Channel, CheckpointManager, FrozenState, freeze_state
from replicator.checkpoint.saver_client import (
    MIN_WAIT_SECONDS,
    SaverFilesystem,
    SaverProcess,
    StagingBuffer,
)
from replicator.checkpoint.storage import open_storage
from replicator.checkpoint.store import RemoteStore
from replicator.cluster.helper_threads import EXIT_WAIT_SECONDS
from replicator.cluster.process_group import on_shutdown
from replicator.errors import CheckpointWriteError

SAVERS = ("process", "thread")


@dataclass
class _Job:
    """One due save for the writer thread (with the saver process every rank queues one per due
    step, staged or not, so the writer threads agree on each in the same order)."""

    step: int
    info: dict[str, Any]
    before: Callable[[Channel], Any] | None
    submitted_at: float
    #: The staged or frozen (replicated, per-rank) states; ``None``: not staged on this rank.
    staged: tuple[Any, Any] | None = None
    #: ``(tensor, offset)`` pieces the writer thread copies into the buffer first.
    pieces: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: ``(step, seconds since its step)`` of the save still being written when this one was due.
    behind: tuple[int, float] | None = None
    #: Set once the state of this save is in the buffer (at once when nothing was deferred).
    copied: threading.Event = field(default_factory=threading.Event)


class BackgroundSaver:
    """Runs :meth:`CheckpointManager.save` for one checkpoint at a time in the background;
    every rank calls :meth:`submit` at the same step, and ``on_saved(step, path)`` runs on the
    writer thread once a save is committed."""

    def __init__(self, manager: CheckpointManager,
                 on_saved: Callable[[int, Any], None] | None = None,
                 async_mode: str = "thread", process: SaverProcess | None = None) -> None:
        self.manager = manager
        self.on_saved = on_saved
        self.async_mode = check_saver(async_mode) or "thread"
        self._channel: Channel | None = None
        self._error: BaseException | None = None
        self._saved: tuple[int, Any] | None = None
        #: The last save's copies, reused by the next one (it is done with them by then).
        self._frozen: dict[str, FrozenState] = {}
        #: Seconds from each committed save's step (its submit) to its commit, in order.
        self.commit_seconds: list[float] = []
        #: Saves skipped because the one before was still being written.
        self.skipped = 0
        #: Seconds each :meth:`wait_copied` that had to wait waited (a deferred copy).
        self.copy_wait_seconds: list[float] = []
        self.process: SaverProcess | None = None
        self._buffer: StagingBuffer | None = None
        self._store_fs: tuple[RemoteStore, Any] | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._pending = 0  # jobs queued or being written
        self._done = threading.Condition()
        self._writing: _Job | None = None
        self._last_job: _Job | None = None
        if self.async_mode == "process":
            store = manager.store
            self.process = process or SaverProcess(store=store)
            self._buffer = StagingBuffer()
            if store.retries_later:  # a store's own calls run in the saver process too
                self._store_fs = (store, store.fs)
                store.fs = SaverFilesystem(self.process, store, store.fs)

    def start(self) -> BackgroundSaver:
        """Make the private group now (a collective: every rank calls it) and start the writer."""
        self._private_channel()
        self._start_writer()
        return self

    def _private_channel(self) -> Channel:
        """A channel over a private copy of the job's group (collective on first use), so that
        a save's agreement never interleaves with training's collectives."""
        if self._channel is None:
            own = self.manager.channel
            # no fingerprint (it doubled a save's collectives): the same calls on every rank
            self._channel = own if own.world_size == 1 else Channel(
                own.collectives.private_copy("checkpoint", check=False))
        return self._channel

    def submit(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
               info: Mapping[str, Any] | None,
               before: Callable[[Channel], Any] | None = None,
               defer: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """Copy the state now (no collective on this thread) and queue its save as ``step``;
        return where it will be (``None``: skipped). ``before(channel)`` runs on the writer
        thread first. ``defer`` (the process only): tensors it accepts are copied on the writer
        thread; the caller keeps them unchanged until :meth:`wait_copied` returns."""
        if self.process is None:
            self.wait()  # the thread: one save at a time, the one before's error raised here
        error, self._error = self._error, None
        if error is not None:  # a save that failed on the writer thread
            raise error
        start = time.perf_counter()
        channel = self._private_channel()
        self._start_writer()
        job = _Job(step, dict(info or {}), before, start)
        with self._done:
            busy = self._pending > 0
        if busy:
            running = self._writing or self._last_job
            job.behind = (running.step, start - running.submitted_at) if running else None
        else:
            rep, own, job.pieces = self._copy(replicated, per_rank, channel.rank, defer)
            job.staged = (rep, own)
        if not job.pieces:
            job.copied.set()
        with self._done:
            self._pending += 1
        self._last_job = job
        self._jobs.put(job)
        return self.manager.where(step) if job.staged is not None else None

    def wait_copied(self, timeout: float = MIN_WAIT_SECONDS) -> None:
        """Return once the last save's deferred tensors are copied (before an optimizer step)."""
        job = self._last_job
        if job is None or job.copied.is_set():
            return
        start = time.perf_counter()
        done = job.copied.wait(timeout)
        self.copy_wait_seconds.append(time.perf_counter() - start)
        if not done:
            raise CheckpointWriteError(
                f"the state of step {job.step} was not copied for its save in {timeout:.0f} s. "
                "HINT: the machine may be overloaded; the previous checkpoint is still the "
                "newest valid one.")

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._serve, daemon=True,
                                            name="replicator-checkpoint-writer")
            self._writer.start()
            # at exit, even by failing (the process group is left before atexit runs), the
            # queued saves, bounded: a save stuck on a lost peer must not hold the exit
            atexit.register(self._stop_writer)
            on_shutdown(lambda: self._stop_writer(EXIT_WAIT_SECONDS))

    def _stop_writer(self, wait: float = MIN_WAIT_SECONDS) -> None:
        """End the writer thread after the saves queued (waiting at most ``wait`` s)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._jobs.put(None)
            writer.join(wait)

    def _serve(self) -> None:
        """The writer thread: each queued save in turn, its deferred copy first."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._writing = job
            try:
                try:
                    if job.pieces:
                        assert self._buffer is not None
                        fault_points.fire("before_copy", step=job.step, path=None,
                                          rank=self._private_channel().rank)
                        self._buffer.copy(job.pieces)
                except BaseException as exc:  # noqa: BLE001 - raised at the next save
                    job.staged, self._error = None, self._error or exc
                finally:
                    job.pieces = []
                    job.copied.set()
                self._write(job)
            except BaseException as exc:  # noqa: BLE001 - raised at the next save
                self._error = self._error or exc
            finally:
                self._writing = None
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _write(self, job: _Job) -> None:
        """Agree that every rank staged ``job`` (else skip it everywhere), then save it."""
        channel = self._private_channel()
        if self.process is not None and channel.max_flag(
                job.staged is None, f"checkpoint save of step {job.step} (staged on every rank?)"):
            self._skipped(job)
            return
        assert job.staged is not None
        if job.before is not None:
            job.before(channel)
        writer = self.process.write if self.process is not None else None
        path = self.manager.save(job.step, job.staged[0], job.staged[1], job.info,
                                 channel=channel, writer=writer)
        if path is not None:  # None: a store refused it (logged; the next save retries)
            self.commit_seconds.append(time.perf_counter() - job.submitted_at)
            self._saved = (job.step, path)
            if self.on_saved is not None:
                self.on_saved(job.step, path)

    def _skipped(self, job: _Job) -> None:
        """Count a save skipped on every rank; say once which ``save_freq`` would fit."""
        self.skipped += 1
        if self.skipped != 1 or not self._private_channel().is_chief:
            return
        if job.behind is None:
            print(f"[replicator] the backup of step {job.step} is skipped: another rank was "
                  "still writing the save before. Later skips are counted, not said.",
                  file=sys.stderr, flush=True)
            return
        running, elapsed = job.behind
        per_step = elapsed / max(1, job.step - running)
        fit = math.ceil(1.5 * max([elapsed, *self.commit_seconds[-1:]]) / per_step)
        print(f"[replicator] the backup of step {job.step} is skipped: the save of step "
              f"{running} is still being written {elapsed:.1f} s after its step (steps "
              f"take {per_step * 1e3:.0f} ms), so a save every {job.step - running} steps "
              f"cannot keep up. Later skips are counted, not said. HINT: save_freq={fit} "
              "or more would fit.", file=sys.stderr, flush=True)

    def _copy(self, replicated: Mapping[str, Any] | None, per_rank: Any, rank: int,
              defer: Callable[[torch.Tensor], bool] | None
              ) -> tuple[dict[str, Any] | None, Any, list[tuple[torch.Tensor, int]]]:
        """Copy the states now: frozen in memory (the thread, reusing the last save's copies) or
        staged in the buffer (the process, but for the ``(tensor, offset)`` pieces deferred)."""
        states = {f"r:{name}": (state, name) for name, state in (replicated or {}).items()}
        if per_rank is not None:
            states["rank"] = (per_rank, f"rank {rank}'s state")
        later: list[tuple[torch.Tensor, int]] = []
        copies: dict[str, Any]
        if self._buffer is None:
            copies = {key: freeze_state(state, label, self._frozen.get(key))
                      for key, (state, label) in states.items()}
            self._frozen = copies
        else:
            images = {key: serialization.flatten(state, label)
                      for key, (state, label) in states.items()}
            copies, later = self._buffer.stage(images, defer)
        rep = {name: copies[f"r:{name}"] for name in replicated} if replicated is not None else None
        return rep, copies.get("rank"), later

    def wait(self) -> tuple[int, Any] | None:
        """Wait (bounded) for the saves in flight; return ``(step, path)`` of the last one
        committed since the last wait (``None``: none) or raise a save's error."""
        limit = max(MIN_WAIT_SECONDS, 4 * self.manager.channel.collectives.timeout_seconds)
        deadline = time.monotonic() + limit
        with self._done:
            while self._pending > 0 and time.monotonic() < deadline:
                self._done.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            running = self._pending > 0
        if running:
            job = self._writing or self._last_job
            raise CheckpointWriteError(
                f"the background save of step {job.step if job else '?'} to "
                f"{self.manager.directory} did not finish in {limit:.0f} s. HINT: the file "
                "system may be stalled; the previous checkpoint is still the newest valid one.")
        error, self._error = self._error, None
        saved, self._saved = self._saved, None
        if error is not None:
            raise error
        return saved

    def close(self) -> None:
        """Stop the writer and the saver process (after the saves in flight); free the memory."""
        self._stop_writer()
        if self.process is not None:
            self.process.close()
        if self._buffer is not None:
            self._buffer.close()
        if self._store_fs is not None:
            store, fs = self._store_fs
            store.fs = fs
            self._store_fs = None


def check_saver(kind: str | None) -> str | None:
    """``kind`` when it names a saver (or is ``None``: chosen by the location)."""
    if kind is not None and kind not in SAVERS:
        raise ValueError(f"saver must be one of {', '.join(SAVERS)} (or None), got {kind!r}")
    return kind


def saver_kind(storage: Any, kind: str | None) -> str:
    """Who writes background saves to ``storage``: ``kind``, or by default the saver process
    for a URL and the thread for a local directory or ``memory://`` (in this process only)."""
    scheme = storage.scheme
    if kind is None:
        kind = "process" if scheme not in (None, "memory") else "thread"
    check_saver(kind)
    if kind == "process" and scheme == "memory":
        raise ValueError("saver='process' cannot write to memory:// (that store lives in this "
                         "process only); use saver='thread'")
    if kind == "process" and os.name != "posix":
        kind = "thread"  # the saver process maps its staging file with select() on pipes
    return kind


def early_process(location: Any, kind: str | None,
                  storage_options: Mapping[str, Any] | None = None) -> SaverProcess | None:
    """A saver process started now (its imports and connection overlap building the model)
    for backups to ``location`` that will use one; hand it to :func:`make_saver`."""
    storage = open_storage(location, storage_options)
    return SaverProcess(store=storage) if saver_kind(storage, kind) == "process" else None


def make_saver(manager: CheckpointManager, kind: str | None,
               on_saved: Callable[[int, Any], None] | None = None,
               process: SaverProcess | None = None) -> BackgroundSaver:
    """The background saver for ``manager``, started; ``process``: one from early_process."""
    kind = saver_kind(manager.store, kind)
    if kind != "process" and process is not None:
        process.close()
        process = None
    return BackgroundSaver(manager, on_saved, async_mode=kind, process=process).start()
