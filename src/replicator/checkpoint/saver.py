"""Background saves: the training loop waits only for a copy of the state, on one saver.

At the step boundary :class:`BackgroundSaver` copies the state, then writes and commits it
while the next steps run, exactly as a foreground save does (staging, the ranks' agreement
over a private group that never interleaves with training's collectives, the chief's atomic
commit): a crash in the middle leaves the previous backup the newest valid one. Who writes
the files is a setting, ``async_mode``:

- ``"thread"``: the state is copied into memory (:func:`~replicator.checkpoint.manager.
  freeze_state`) and a thread serialises, hashes and writes it;
- ``"process"``: the state is copied into shared memory as the safetensors images of this
  rank's files (:class:`StagingBuffer`, a segment of ``comm/shm_segment.py``) and a
  long-lived saver process (``saver_process.py``, started with the saver so that its imports
  and its store connection overlap the first steps) hashes and writes or uploads them at a
  lower priority; the store's own calls (the commit's listing, pruning, the lease) go there
  too. Python's GIL is then held by the saver process, not by training.

At most one save is in flight. With the thread, starting another waits for the one before;
with the process, a save due while the previous one is still being written is skipped on every
rank (one small all-reduce), counted in :attr:`BackgroundSaver.skipped` and said once, with
how long the save took and the ``save_freq`` that would fit. A save's error is raised at the
next save or by :meth:`BackgroundSaver.wait`, never dropped. If the saver process dies, that
save fails (nothing is committed) and the next save starts a new process.
"""

from __future__ import annotations

import atexit
import base64
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import safetensors_io, serialization
from replicator.checkpoint.exchange import Channel
from replicator.checkpoint.manager import CheckpointManager, FileWriter, FrozenState, freeze_state
from replicator.checkpoint.manifest import FileEntry
from replicator.checkpoint.storage import open_storage
from replicator.checkpoint.store import RemoteStore
from replicator.cluster.processes import process_alive
from replicator.comm.shm_segment import NAME_PREFIX, SharedSegment, shm_dir, unlink_segment
from replicator.errors import CheckpointWriteError

_PROGRAM = str(Path(__file__).with_name("saver_process.py"))
SAVERS = ("process", "thread")
#: The least time :meth:`BackgroundSaver.wait` waits for a save's thread (slow disks).
MIN_WAIT_SECONDS = 600.0
#: Each image starts on a 4 KiB boundary, so the saver process can write it with direct I/O.
_ALIGN = 4096
_TAG = "stage"


@dataclass(frozen=True)
class StagedFile:
    """One file image in a :class:`StagingBuffer`: where it starts and how long it is."""

    buffer: str
    offset: int
    length: int


def remove_stale_buffers(directory: str | None = None) -> None:
    """Delete staging segments left by processes that no longer exist (killed)."""
    directory = directory or shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name[len(NAME_PREFIX):].split("-")
        if name.startswith(NAME_PREFIX + _TAG + "-") and len(parts) >= 3 \
                and parts[1].isdigit() and not process_alive(int(parts[1])):
            unlink_segment(name)


class StagingBuffer:
    """A shared-memory segment holding the images of one save's files; a larger one replaces
    it when the state grows. The saver process maps it by its path."""

    def __init__(self) -> None:
        remove_stale_buffers()
        self._segment: SharedSegment | None = None

    @property
    def path(self) -> str:
        return os.path.join(shm_dir(), self._segment.name) if self._segment else ""

    @property
    def nbytes(self) -> int:
        return self._segment.nbytes if self._segment is not None else 0

    def _ensure(self, size: int) -> Any:
        if self._segment is None or size > self._segment.nbytes:
            new_size = max(size, int(self.nbytes * 1.25), 1 << 20)
            self.close()
            self._segment = SharedSegment.create_named(new_size, _TAG)
        return self._segment.mm

    def stage(self, files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]]
              ) -> dict[str, StagedFile]:
        """Copy each ``name -> (tensors, metadata)`` into the buffer as a safetensors image."""
        plans = []
        total = 0
        for name, (tensors, metadata) in files.items():
            head, order = safetensors_io._header(tensors, metadata)
            plans.append((name, head, order, total))
            total += len(head) + sum(t.numel() * t.element_size() for _, t in order)
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
        return staged

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        unlink_segment(segment.name)
        try:
            segment.mm.close()
        except BufferError:  # a view is still alive; the name is gone anyway
            pass


class SaverProcess:
    """The client of one saver process: sends it jobs, reads its answers, restarts it."""

    def __init__(self, timeout: float = MIN_WAIT_SECONDS, store: Any = None) -> None:
        self.timeout = timeout
        #: The store whose client the process imports and connects as it starts.
        self._warm = {"scheme": getattr(store, "scheme", None),
                      "root": getattr(store, "root", None),
                      "options": dict(getattr(store, "storage_options", None) or {})}
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._jobs = 0
        self.restarts = 0
        #: Fault injection for tests: in the next job, the process SIGKILLs itself in the
        #: middle of this file (0-based; the files before it are complete), then it is cleared.
        self.die_during_file: int | None = None
        self.start()
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        code = f"import runpy; runpy.run_path({_PROGRAM!r}, run_name='__main__')"
        env = {**os.environ, "REPLICATOR_SAVER_WARM": json.dumps(self._warm)}
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1,
                                      close_fds=True, env=env)

    def write(self, store: Any, staging: str, items: list[tuple[str, Any, str]]
              ) -> dict[str, FileEntry]:
        """Write staged ``items`` into ``staging`` of ``store`` (a storage); blocks until the
        saver process answers. Raises ``OSError`` when it fails or dies."""
        files = []
        for fname, staged, label in items:
            if not isinstance(staged, StagedFile):
                raise TypeError(f"{label}: the saver process writes staged files only")
            files.append({"name": fname, "offset": staged.offset, "length": staged.length,
                          "dest": store.dest(staging, fname), "buffer": staged.buffer})
        if not files:
            return {}
        job: dict[str, Any] = {"buffer": files[0]["buffer"], "files": files,
                               "scheme": store.scheme, "options": store.storage_options}
        if self.die_during_file is not None:
            job["die_during_file"], self.die_during_file = self.die_during_file, None
        reply = self._exchange(job, f"writing {staging}")
        if reply["error"]:
            raise OSError(f"the saver process could not write {staging}: {reply['error']}")
        return {name: FileEntry(**entry) for name, entry in reply["files"].items()}

    def call(self, scheme: str, options: Mapping[str, Any], name: str, *args: Any,
             **kwargs: Any) -> Any:
        """Make the file-system call ``name(*args, **kwargs)`` in the saver process (bytes
        arguments and results travel base64-encoded); its errors come back as ``OSError``,
        and ``FileNotFoundError`` as itself."""
        job = {"scheme": scheme, "options": dict(options), "call": name,
               "args": [{"b64": base64.b64encode(bytes(a)).decode()}
                        if isinstance(a, (bytes, bytearray, memoryview)) else a for a in args],
               "kwargs": kwargs}
        where = str(args[0]) if args else ""
        reply = self._exchange(job, f"{name} {where}")
        if reply["error"]:
            if reply.get("error_type") == "FileNotFoundError":
                raise FileNotFoundError(where)
            raise OSError(f"the saver process's {name} {where}: {reply['error']}")
        result = reply["result"]
        return base64.b64decode(result["b64"]) if isinstance(result, dict) else result

    @property
    def closed(self) -> bool:
        return self._proc is None

    @property
    def busy(self) -> bool:
        """A job is running (an upload can take minutes)."""
        return self._lock.locked()

    def _exchange(self, job: dict[str, Any], what: str) -> dict[str, Any]:
        """Send one job (restarting a process that died) and wait for its answer."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = proc.returncode if proc is not None else None
                print(f"[replicator] starting a new saver process (the previous one exited "
                      f"with code {code})", file=sys.stderr, flush=True)
                self.start()
                self.restarts += 1
                proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            self._jobs += 1
            job = {**job, "id": self._jobs}
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise OSError(f"the saver process (pid {proc.pid}) is gone: {exc}") from exc
            return self._read_reply(proc, job["id"], what)

    def _read_reply(self, proc: subprocess.Popen[str], job_id: int,
                    what: str) -> dict[str, Any]:
        assert proc.stdout is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                reply = json.loads(line)
                if reply.get("id") == job_id:
                    return dict(reply)
            elif proc.poll() is not None:
                break
        try:
            code = proc.wait(10)  # its output ended: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            proc.kill()
            raise OSError(f"the saver process (pid {proc.pid}) did not finish {what} in "
                          f"{self.timeout:.0f} s; it was stopped")
        lost = "; nothing of this save is committed" if what.startswith("writing") else ""
        raise OSError(f"the saver process (pid {proc.pid}) died (exit code {code}) while "
                      f"{what}{lost}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


class SaverFilesystem:
    """The few fsspec calls :class:`RemoteStore` makes, made by the saver process.

    Installed on the chief's store while a saver process runs, so that the commit's
    listing and write, pruning and the lease's heartbeat spend their CPU (an S3 client spends
    milliseconds per request, holding the GIL) in the lower-priority saver process, not in
    the training process. While that process is busy with an upload (a heartbeat must not
    wait minutes) or once it is closed, the calls go to ``fallback``, in this process.
    """

    def __init__(self, process: SaverProcess, store: RemoteStore, fallback: Any) -> None:
        self._process, self._store, self._fallback = process, store, fallback

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._process.closed or self._process.busy:
            return getattr(self._fallback, name)(*args, **kwargs)
        kwargs.pop("timeout", None)  # the saver process applies the store's own time limit
        return self._process.call(self._store.scheme, self._store.storage_options, name,
                                  *args, **kwargs)

    def pipe_file(self, path: str, data: bytes, **kwargs: Any) -> None:
        self._call("pipe_file", path, data, **kwargs)

    def cat_file(self, path: str, **kwargs: Any) -> bytes:
        return bytes(self._call("cat_file", path, **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self._call("exists", path, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return list(self._call("ls", path, detail=detail, **kwargs))

    def rm(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        self._call("rm", path, recursive=recursive, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        """The saver process drops its own cache before each listing; this drops ours."""
        self._fallback.invalidate_cache(path)


class BackgroundSaver:
    """Runs :meth:`CheckpointManager.save` for one checkpoint at a time in the background.

    ``async_mode``: ``"thread"`` or ``"process"`` (module doc). Every rank calls
    :meth:`submit` at the same step. ``on_saved(step, path)`` runs on the thread once a save
    is committed on every rank.
    """

    def __init__(self, manager: CheckpointManager,
                 on_saved: Callable[[int, Any], None] | None = None,
                 async_mode: str = "thread", process: SaverProcess | None = None) -> None:
        self.manager = manager
        self.on_saved = on_saved
        self.async_mode = check_saver(async_mode) or "thread"
        self._channel: Channel | None = None
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: BaseException | None = None
        self._saved: tuple[int, Any] | None = None
        #: The last save's copies, reused by the next one (it is done with them by then).
        self._frozen: dict[str, FrozenState] = {}
        #: Seconds the caller spent in the last :meth:`submit` (copying the state).
        self.last_submit_seconds = 0.0
        #: Seconds the last save took on its thread (write, agreement, commit).
        self.last_write_seconds = 0.0
        #: Seconds from each committed save's step (its submit) to its commit, in order.
        self.commit_seconds: list[float] = []
        #: Saves skipped because the one before was still being written.
        self.skipped = 0
        self._submitted_at = 0.0
        self.process: SaverProcess | None = None
        self._buffer: StagingBuffer | None = None
        self._store_fs: tuple[RemoteStore, Any] | None = None
        if self.async_mode == "process":
            store = manager.store
            self.process = process or SaverProcess(store=store)
            self._buffer = StagingBuffer()
            if store.retries_later:  # a store's own calls run in the saver process too
                self._store_fs = (store, store.fs)
                store.fs = SaverFilesystem(self.process, store, store.fs)

    @property
    def in_flight(self) -> int | None:
        """The step being saved right now (``None``: no save is running)."""
        thread = self._thread
        return self._step if thread is not None and thread.is_alive() else None

    def start(self) -> BackgroundSaver:
        """Make the private group now (a collective: every rank calls it), so that the first
        save does not wait for it; the saver process is already starting."""
        self._private_channel()
        return self

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
               before: Callable[[Channel], Any] | None = None) -> Any:
        """Copy the state now and save it as ``step`` in the background; return where it will
        be. The thread waits for the save before (raising its error); the process skips this
        one (returns ``None``) while the save before is still being written.
        ``before(channel)`` runs on the thread first (a sharded save the backup names)."""
        if self.process is not None and self._skip(step):
            return None
        self.wait()
        start = time.perf_counter()
        channel = self._private_channel()
        if self.process is not None:
            rep, rank = self._stage(replicated, per_rank, channel.rank)
        else:
            rep, rank = self._freeze(replicated, per_rank, channel.rank)
        self._step, self._error, self._saved = step, None, None
        self._submitted_at = start
        self._thread = threading.Thread(
            target=self._run, args=(step, rep, rank, dict(info or {}), channel, before),
            name=f"replicator-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.last_submit_seconds = time.perf_counter() - start
        return self.manager.where(step)

    def _freeze(self, replicated: Mapping[str, Any] | None, per_rank: Any,
                rank: int) -> tuple[dict[str, Any] | None, Any]:
        old = self._frozen
        rep = ({name: freeze_state(state, name, old.get(name))
                for name, state in replicated.items()} if replicated is not None else None)
        own = freeze_state(per_rank, f"rank {rank}'s state",
                           old.get("rank-")) if per_rank is not None else None
        self._frozen = dict(rep or {})
        if own is not None:
            self._frozen["rank-"] = own
        return rep, own

    def _stage(self, replicated: Mapping[str, Any] | None, per_rank: Any,
               rank: int) -> tuple[dict[str, Any] | None, Any]:
        assert self._buffer is not None
        images = {f"r:{name}": serialization.flatten(state, name)
                  for name, state in (replicated or {}).items()}
        if per_rank is not None:
            images["rank"] = serialization.flatten(per_rank, f"rank {rank}'s state")
        staged = self._buffer.stage(images)
        rep = ({name: staged[f"r:{name}"] for name in replicated}
               if replicated is not None else None)
        return rep, staged.get("rank")

    def _skip(self, step: int) -> bool:
        """Agree whether the save before is still being written; if so skip this one, and say
        once how long a save takes and which ``save_freq`` would fit."""
        ch = self.manager.channel
        running = self.in_flight
        if not ch.max_flag(running is not None,
                           f"checkpoint save of step {step} (is one still in flight?)"):
            return False
        self.skipped += 1
        if self.skipped == 1 and ch.is_chief and running is not None:
            elapsed = time.perf_counter() - self._submitted_at
            per_step = elapsed / max(1, step - running)
            fit = math.ceil(1.5 * max([elapsed, *self.commit_seconds[-1:]]) / per_step)
            print(f"[replicator] the backup of step {step} is skipped: the save of step "
                  f"{running} is still being written {elapsed:.1f} s after its step (steps "
                  f"take {per_step * 1e3:.0f} ms), so a save every {step - running} steps "
                  f"cannot keep up. Later skips are counted, not said. HINT: save_freq={fit} "
                  "or more would fit.", file=sys.stderr, flush=True)
        return True

    def _run(self, step: int, replicated: Mapping[str, Any] | None,
             per_rank: Any, info: dict[str, Any], channel: Channel,
             before: Callable[[Channel], Any] | None = None) -> None:
        start = time.perf_counter()
        try:
            if before is not None:
                before(channel)
            writer: FileWriter | None = self.process.write if self.process else None
            path = self.manager.save(step, replicated, per_rank, info, channel=channel,
                                     writer=writer)
            if path is not None:  # None: a store refused it (logged; the next save retries)
                self.commit_seconds.append(time.perf_counter() - self._submitted_at)
                self._saved = (step, path)
                if self.on_saved is not None:
                    self.on_saved(step, path)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread later
            self._error = exc
        finally:
            self.last_write_seconds = time.perf_counter() - start

    def wait(self) -> tuple[int, Any] | None:
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

    def close(self) -> None:
        """Stop the saver process (after the save in flight) and free the shared memory."""
        thread = self._thread
        if thread is not None:
            thread.join(MIN_WAIT_SECONDS)
        if self.process is not None:
            self.process.close()
        if self._buffer is not None:
            self._buffer.close()
        if self._store_fs is not None:
            store, fs = self._store_fs
            store.fs = fs
            self._store_fs = None


def ProcessSaver(manager: CheckpointManager,  # noqa: N802 - the name users knew
                 on_saved: Callable[[int, Any], None] | None = None) -> BackgroundSaver:
    """A :class:`BackgroundSaver` with ``async_mode="process"``."""
    return BackgroundSaver(manager, on_saved, async_mode="process")


def check_saver(kind: str | None) -> str | None:
    """``kind`` when it names a saver (or is ``None``: chosen by the location)."""
    if kind is not None and kind not in SAVERS:
        raise ValueError(f"saver must be one of {', '.join(SAVERS)} (or None), got {kind!r}")
    return kind


def saver_kind(storage: Any, kind: str | None) -> str:
    """Who writes background saves to ``storage``: ``kind``, or by default the saver process
    for a store (a URL) and the thread for a local directory or ``memory://`` (that store
    lives in this process only)."""
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
    """A saver process started now for backups to ``location`` that will use one (see
    :func:`saver_kind`): its imports and its connection to the store overlap building the
    model and the first steps. Hand it to :func:`make_saver`."""
    storage = open_storage(location, storage_options)
    return SaverProcess(store=storage) if saver_kind(storage, kind) == "process" else None


def make_saver(manager: CheckpointManager, kind: str | None,
               on_saved: Callable[[int, Any], None] | None = None,
               process: SaverProcess | None = None) -> BackgroundSaver:
    """The background saver for ``manager`` (see :func:`saver_kind`), its private group made;
    ``process``: a saver process started earlier, with the backup."""
    kind = saver_kind(manager.store, kind)
    if kind != "process" and process is not None:
        process.close()
        process = None
    return BackgroundSaver(manager, on_saved, async_mode=kind, process=process).start()
