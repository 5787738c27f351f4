"""The training process's side of the saver process (``saver_process.py``): the shared-memory
:class:`StagingBuffer` (safetensors images, 4 KiB aligned for direct I/O, reused),
:class:`SaverProcess` (jobs and answers, restarted when it died) and :class:`SaverFilesystem`."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import serialization
from replicator.checkpoint.manifest import FileEntry
from replicator.checkpoint.store import RemoteStore
from replicator.cluster.processes import process_alive
from replicator.comm.shm_segment import NAME_PREFIX, SharedSegment, shm_dir, unlink_segment

_PROGRAM = str(Path(__file__).with_name("saver_process.py"))
#: The least time a save's wait waits for its thread or the saver process (slow disks).
MIN_WAIT_SECONDS = 600.0
#: Each image starts on a 4 KiB boundary, so the saver process can write it with direct I/O.
ALIGN = 4096
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
    """A shared-memory segment (mapped by the saver process by its path) holding the images of
    one save's files; a larger one replaces it when the state grows."""

    def __init__(self) -> None:
        remove_stale_buffers()
        self._segment: SharedSegment | None = None

    def _ensure(self, size: int) -> SharedSegment:
        if self._segment is None or size > self._segment.nbytes:
            grown = int(self._segment.nbytes * 1.25) if self._segment is not None else 0
            new_size = max(size, grown, 1 << 20)
            self.close()
            self._segment = SharedSegment.create_named(new_size, _TAG)
        return self._segment

    def stage(self, files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]],
              defer: Callable[[torch.Tensor], bool] | None = None
              ) -> tuple[dict[str, StagedFile], list[tuple[torch.Tensor, int]]]:
        """Lay out each ``name -> (tensors, metadata)`` as a safetensors image and copy the
        tensors in, but those ``defer`` accepts: returned as ``(tensor, offset)`` pieces for
        :meth:`copy` later."""
        plans = []
        total = 0
        for name, (tensors, metadata) in files.items():
            head, order = serialization.header(tensors, metadata)
            plans.append((name, head, order, total))
            total += len(head) + sum(t.numel() * t.element_size() for _, t in order)
            total += -total % ALIGN
        segment = self._ensure(max(total, 1))
        mm, path = segment.mm, os.path.join(shm_dir(), segment.name)
        staged: dict[str, StagedFile] = {}
        now: list[Any] = []
        later: list[Any] = []
        for name, head, order, start in plans:
            mm[start:start + len(head)] = head
            pos = start + len(head)
            for _, t in order:
                if t.numel():
                    piece = (t.detach(), pos)
                    (later if defer is not None and defer(piece[0]) else now).append(piece)
                pos += t.numel() * t.element_size()
            staged[name] = StagedFile(path, start, pos - start)
        self.copy(now)
        return staged, later

    def copy(self, pieces: list[tuple[torch.Tensor, int]]) -> None:
        """Copy ``(tensor, offset)`` pieces in, one copy per back-to-back run of a CPU dtype."""
        assert self._segment is not None or not pieces
        i = 0
        while i < len(pieces):
            first, start = pieces[i]
            end, j = start + first.numel() * first.element_size(), i + 1
            while first.device.type == "cpu" and j < len(pieces) and pieces[j][1] == end \
                    and pieces[j][0].dtype == first.dtype and pieces[j][0].device.type == "cpu":
                end += pieces[j][0].numel() * first.element_size()
                j += 1
            dst = torch.frombuffer(self._segment.mm, dtype=first.dtype,  # type: ignore[union-attr]
                                   count=(end - start) // first.element_size(), offset=start)
            if j == i + 1:
                dst.copy_(first.reshape(-1))
            else:
                torch.cat([t.reshape(-1) for t, _ in pieces[i:j]], out=dst)
            i = j

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
        """Write staged ``items`` into ``staging`` of ``store`` and wait for the answer;
        ``OSError`` when the saver process fails or dies."""
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
        """Make the file-system call ``name(*args, **kwargs)`` in the saver process (bytes as
        base64); its errors come back as ``OSError`` (``FileNotFoundError`` as itself)."""
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
            proc.kill()
            raise OSError(f"the saver process (pid {proc.pid}) did not finish {what} in "
                          f"{self.timeout:.0f} s; it was stopped") from None
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
    """The few fsspec calls :class:`RemoteStore` makes, made by the saver process (their CPU,
    holding the GIL, is not training's); while it is busy or closed, by ``fallback``."""

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
