"""The saver process: hashes and writes (or uploads) checkpoint files staged in shared memory.

A plain script (standard library and fsspec only: it starts fast) at a lower priority, so that
training gets the CPU first; one JSON job per line and one answer per line (files written, or a
call in ``CALLS``). Local files use direct I/O where the file system takes it.
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import json
import mmap
import os
import signal
import sys
from typing import Any

CHUNK = 8 << 20
#: Objects up to this size are uploaded in one call with a time limit; larger ones stream.
WHOLE_OBJECT_BYTES = 512 << 20


def filesystem(scheme: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The store's file system (one per scheme and options) and its calls' time limit."""
    return _filesystem(json.dumps([scheme, options], sort_keys=True))


@functools.cache
def _filesystem(key: str) -> tuple[Any, dict[str, Any]]:
    import fsspec  # type: ignore[import-untyped]

    scheme, options = json.loads(key)
    retries = options.pop("retries", None)
    timeout = float(options.pop("operation_timeout", 300.0))
    fs = fsspec.get_filesystem_class(scheme)(**options)
    if retries is not None:
        fs.retries = int(retries)
    return fs, {"timeout": timeout} if getattr(fs, "async_impl", False) else {}


#: Direct I/O needs the memory address, the file offset and the length of each write aligned
#: to the device's logical block size (512 B or 4 KiB); 4 KiB serves both.
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux and some BSDs; elsewhere buffered writes only


def open_for_write(dest: str, direct: bool) -> tuple[int, bool]:
    """Open ``dest`` for writing, with direct I/O when asked and the file system takes it;
    returns the descriptor and whether direct I/O is on."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and _O_DIRECT:
        try:
            return os.open(dest, flags | _O_DIRECT, 0o666), True
        except OSError:  # EINVAL on tmpfs and other file systems without direct I/O
            pass
    return os.open(dest, flags, 0o666), False


def _buffered(fd: int) -> None:
    """Turn direct I/O off on an open descriptor (for the unaligned tail, or after a refusal)."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _write_all(fd: int, part: memoryview, direct: bool) -> bool:
    """Write all of ``part``; returns whether direct I/O is still on (a direct write the file
    system refuses turns it off, and the bytes go through the page cache)."""
    done = 0
    while done < len(part):
        try:
            done += os.write(fd, part[done:])
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            _buffered(fd)
            direct = False
    return direct


def write_local(view: memoryview, dest: str, aligned: bool, die: bool = False
                ) -> tuple[int, str]:
    """Hash ``view`` and write it to the local file ``dest``, durably (fsync); direct I/O for
    the whole 4 KiB blocks when ``aligned`` (``view`` starts on a 4 KiB boundary)."""
    hasher = hashlib.sha256()
    fd, direct = open_for_write(dest, aligned)
    try:
        cut = len(view) - len(view) % DIRECT_ALIGN if direct else 0
        pos = 0
        while pos < len(view):
            end = min(pos + CHUNK, len(view))
            if pos < cut < end:
                end = cut  # a write never straddles the end of the last whole block
            part = view[pos:end]
            hasher.update(part)
            if direct and pos >= cut:
                _buffered(fd)
                direct = False
            direct = _write_all(fd, part, direct)
            _maybe_die(die)
            pos = end
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(view), hasher.hexdigest()


def _write(view: memoryview, dest: str, fs: Any, die: bool, aligned: bool = False
           ) -> tuple[int, str]:
    if fs is None:
        return write_local(view, dest, aligned, die)
    if len(view) <= WHOLE_OBJECT_BYTES:  # one call with a time limit: a hung server never answers
        fs_, limit = fs
        data = bytes(view)
        if die:  # the first chunk only, then the process dies: a partial object at most
            fs_.pipe_file(dest, data[:CHUNK // 2], **limit)
            _maybe_die(die)
        fs_.pipe_file(dest, data, **limit)
        return len(view), hashlib.sha256(data).hexdigest()
    hasher = hashlib.sha256()
    with fs[0].open(dest, "wb") as f:
        for start in range(0, len(view), CHUNK):
            part = view[start:start + CHUNK]
            hasher.update(part)
            f.write(bytes(part))
            _maybe_die(die)
    return len(view), hasher.hexdigest()


def _maybe_die(die: bool) -> None:
    if die:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    fs = filesystem(job["scheme"], job.get("options") or {}) if job.get("scheme") else None
    out: dict[str, Any] = {}
    with open(job["buffer"], "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        view = memoryview(mm)
        try:
            for index, item in enumerate(job["files"]):
                part = view[item["offset"]:item["offset"] + item["length"]]
                try:
                    size, digest = _write(part, item["dest"], fs,
                                          job.get("die_during_file") == index,
                                          aligned=item["offset"] % DIRECT_ALIGN == 0)
                finally:
                    part.release()
                out[item["name"]] = {"bytes": size, "sha256": digest}
        finally:
            view.release()
    return out


#: The file-system calls a parent may send (``RemoteStore`` uses these and no others).
CALLS = ("pipe_file", "cat_file", "exists", "ls", "rm")


def run_call(job: dict[str, Any]) -> Any:
    """One call on the store's file system; bytes and listings made JSON-able."""
    name = job["call"]
    if name not in CALLS:
        raise ValueError(f"the saver process does not make the call {name!r}")
    fs, limit = filesystem(job["scheme"], job.get("options") or {})
    args = [base64.b64decode(a["b64"]) if isinstance(a, dict) and "b64" in a else a
            for a in job.get("args", [])]
    kwargs = {**job.get("kwargs", {}), **limit}
    if name in ("exists", "ls", "rm"):
        fs.invalidate_cache(args[0])  # other processes write here: never a cached listing
    result = getattr(fs, name)(*args, **kwargs)
    if name == "ls":
        return [{"name": str(e["name"]), "size": int(e.get("size") or 0),
                 "type": str(e.get("type", "file"))} for e in result]
    if isinstance(result, (bytes, bytearray, memoryview)):
        return {"b64": base64.b64encode(bytes(result)).decode()}
    return bool(result) if name == "exists" else None


def answer(job: dict[str, Any]) -> dict[str, Any]:
    """The reply to one job: written files, or a call's result; errors as text."""
    try:
        if "call" in job:
            return {"id": job["id"], "result": run_call(job), "error": "", "error_type": ""}
        return {"id": job["id"], "files": run_job(job), "error": ""}
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        return {"id": job["id"], "files": {}, "result": None,
                "error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__}


#: The saver yields the CPU to training when both want it (a niceness above the trainer's).
NICENESS = 10


def warm() -> None:
    """Import the store's client and connect to it as the process starts (at the parent's
    priority), so that the first save does not wait for it."""
    try:
        store = json.loads(os.environ.get("REPLICATOR_SAVER_WARM", "") or "{}")
        if store.get("scheme"):
            fs, limit = filesystem(store["scheme"], store.get("options") or {})
            if store.get("root"):
                fs.exists(store["root"], **limit)  # opens the session and a connection
    except Exception:  # noqa: BLE001 - the first job makes the same call and reports it
        pass


def main() -> None:
    warm()
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
