"""Background saves through a saver process: the training loop waits only for a memory copy.

At the step boundary :class:`ProcessSaver` copies the state into shared memory
(``staging.py``: the safetensors images of this rank's files); a long-lived saver process
(``saver_process.py``, one per training process, started with the saver) hashes and writes
or uploads them, while a light thread here waits for it and then runs the commit exactly as a
foreground save does (the ranks agree every write succeeded over a private group; the chief
commits). Python's GIL is held by the saver process's hashing and I/O, not by training: the
thread saver (``background.py``) competed with the loop for it.

At most one save is in flight. A save that falls due while the previous one is still being
written is skipped on every rank (they agree with one small all-reduce), counted in
:attr:`ProcessSaver.skipped` and logged. If the saver process dies (killed, out of memory),
that save fails (nothing is committed: the previous backup stays the newest) and the next
save starts a new process.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from replicator.checkpoint.background import MIN_WAIT_SECONDS, BackgroundSaver
from replicator.checkpoint.exchange import Channel
from replicator.checkpoint.manager import CheckpointManager, FileWriter, step_dir_name
from replicator.checkpoint.manifest import FileEntry
from replicator.checkpoint.staging import StagedFile, StagingBuffer, flatten
from replicator.checkpoint.store import RemoteStore

_PROGRAM = str(Path(__file__).with_name("saver_process.py"))
SAVERS = ("process", "thread")


class SaverProcess:
    """The client of one saver process: sends it jobs, reads its answers, restarts it."""

    def __init__(self, timeout: float = MIN_WAIT_SECONDS) -> None:
        self.timeout = timeout
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
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1,
                                      close_fds=True)

    def write(self, base: str, store: Any, items: list[tuple[str, Any, str]]
              ) -> dict[str, FileEntry]:
        """Write staged ``items`` under ``base`` (a local directory, or a path on ``store``);
        blocks until the saver process answers. Raises ``OSError`` when it fails or dies."""
        files = []
        for fname, staged, label in items:
            if not isinstance(staged, StagedFile):
                raise TypeError(f"{label}: the saver process writes staged files only")
            files.append({"name": fname, "offset": staged.offset, "length": staged.length,
                          "dest": f"{base}/{fname}", "buffer": staged.buffer})
        if not files:
            return {}
        job: dict[str, Any] = {"buffer": files[0]["buffer"], "files": files, "scheme": None,
                               "options": {}}
        if isinstance(store, RemoteStore):
            job.update(scheme=store.scheme, options=store.storage_options)
        if self.die_during_file is not None:
            job["die_during_file"], self.die_during_file = self.die_during_file, None
        reply = self._exchange(job, f"writing {base}")
        if reply["error"]:
            raise OSError(f"the saver process could not write {base}: {reply['error']}")
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

    Installed on the chief's store while a :class:`ProcessSaver` runs, so that the commit's
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


class ProcessSaver(BackgroundSaver):
    """:class:`BackgroundSaver` whose files are written by a saver process (module doc)."""

    def __init__(self, manager: CheckpointManager,
                 on_saved: Callable[[int, Any], None] | None = None) -> None:
        super().__init__(manager, on_saved)
        self.process = SaverProcess()
        self._buffer = StagingBuffer()
        #: Saves skipped because the one before was still being written.
        self.skipped = 0
        store = getattr(manager, "store", None)
        self._store_fs: tuple[RemoteStore, Any] | None = None
        if isinstance(store, RemoteStore):  # the store's calls run in the saver process too
            self._store_fs = (store, store.fs)
            store.fs = SaverFilesystem(self.process, store, store.fs)

    def _writer(self) -> FileWriter | None:
        return self.process.write

    def submit(self, step: int, replicated: Mapping[str, Any] | None, per_rank: Any,
               info: Mapping[str, Any] | None,
               before: Callable[[Channel], Any] | None = None) -> Any:
        """Copy the state into shared memory and hand it to the saver process; return where
        it will be. ``None`` when skipped: the save before is still being written."""
        ch = self.manager.channel
        busy = ch.max_flag(self.in_flight is not None,
                           f"checkpoint save of step {step} (is one still in flight?)")
        if busy:
            self.skipped += 1
            if ch.is_chief:
                print(f"[replicator] the backup of step {step} is skipped: the save of step "
                      f"{self._step} is still being written ({self.skipped} skipped so far). "
                      "HINT: save less often (save_freq) if this repeats.", file=sys.stderr,
                      flush=True)
            return None
        self.wait()
        start = time.perf_counter()
        channel = self._private_channel()
        images = {}
        if replicated is not None:
            for name, state in replicated.items():
                images[f"r:{name}"] = flatten(state, name)
        if per_rank is not None:
            images["rank"] = flatten(per_rank, f"rank {channel.rank}'s state")
        staged = self._buffer.stage(images)
        staged_rep = ({name: staged[f"r:{name}"] for name in replicated}
                      if replicated is not None else None)
        staged_rank = staged.get("rank")
        self._step, self._error, self._saved = step, None, None
        self._thread = threading.Thread(
            target=self._run, args=(step, staged_rep, staged_rank, dict(info or {}), channel,
                                    before),
            name=f"replicator-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.last_submit_seconds = time.perf_counter() - start
        directory = self.manager.directory
        return directory / step_dir_name(step) if isinstance(directory, Path) \
            else self.manager.where(step)

    def close(self) -> None:
        """Stop the saver process (after the save in flight) and free the shared memory."""
        thread = self._thread
        if thread is not None:
            thread.join(MIN_WAIT_SECONDS)
        self.process.close()
        self._buffer.close()
        if self._store_fs is not None:
            store, fs = self._store_fs
            store.fs = fs


def check_saver(kind: str | None) -> str | None:
    """``kind`` when it names a saver (or is ``None``: chosen by the location)."""
    if kind is not None and kind not in SAVERS:
        raise ValueError(f"saver must be one of {', '.join(SAVERS)} (or None), got {kind!r}")
    return kind


def make_saver(manager: CheckpointManager, kind: str | None,
               on_saved: Callable[[int, Any], None] | None = None) -> BackgroundSaver:
    """The background saver for ``manager``: ``"process"`` or ``"thread"``; ``None``: the
    saver process for a store (a URL), the thread for a local directory or ``memory://``."""
    store = getattr(manager, "store", None)
    in_memory = isinstance(store, RemoteStore) and store.scheme == "memory"
    if kind is None:
        kind = "thread" if isinstance(manager.directory, Path) or in_memory else "process"
    check_saver(kind)
    if kind == "process" and in_memory:
        raise ValueError("saver='process' cannot write to memory:// (that store lives in this "
                         "process only); use saver='thread'")
    if kind == "process" and os.name != "posix":
        kind = "thread"  # the saver process maps its staging file with select() on pipes
    return ProcessSaver(manager, on_saved) if kind == "process" else \
        BackgroundSaver(manager, on_saved)
