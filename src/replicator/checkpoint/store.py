"""An fsspec store as the checkpoint room uses it: URLs, the store's calls, commit objects and
the lease (``storage.py`` holds the storage protocol over it).

A URL fsspec knows (``s3://`` needs ``s3fs``, from ``replicator[remote]``) is opened through
fsspec; ``file://`` and plain paths are local directories; anything else that looks like a URL is
an error, never a local directory named ``s3:``. S3 credentials and endpoint come from ``AWS_*``
and ``FSSPEC_S3_ENDPOINT_URL``, or ``storage_options``.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from replicator.checkpoint.manifest import parse_marker
from replicator.cluster.processes import process_alive
from replicator.errors import CheckpointCorruptError, StorageURLError, StoreLeaseError

T = TypeVar("T")
#: Default seconds one call on a store may take (``storage_options["operation_timeout"]``).
OPERATION_TIMEOUT = 300.0
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: Schemes read as local paths (the local code path, with atomic renames).
LOCAL_SCHEMES = ("file", "local")
#: Connection settings for S3 that fail within seconds, not minutes, when the store is down
#: (a failed save is logged and retried at the next one); ``storage_options`` override them.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                      "retries": {"max_attempts": 3, "mode": "standard"}},
}


def url_scheme(target: str | os.PathLike[str]) -> str | None:
    """The scheme of ``target`` when it is a URL (``"s3"``), else ``None``."""
    m = _URL.match(os.fspath(target)) if isinstance(target, (str, os.PathLike)) else None
    return m.group(1).lower() if m else None


def is_remote(target: str | os.PathLike[str]) -> bool:
    """True for a URL opened through fsspec (not ``file://``, not a plain path)."""
    scheme = url_scheme(target)
    return scheme is not None and scheme not in LOCAL_SCHEMES


def local_path(target: str | os.PathLike[str]) -> Path:
    """``target`` as a local path (``file:///a/b`` -> ``/a/b``); refuses remote URLs."""
    scheme = url_scheme(target)
    text = os.fspath(target)
    if scheme is None:
        return Path(text)
    if scheme in LOCAL_SCHEMES:
        return Path(text[len(scheme) + 3:] or "/")
    raise StorageURLError(f"{text!r} is a {scheme}:// URL, not a local path")


def check_location(target: str | os.PathLike[str], what: str) -> None:
    """Raise :class:`StorageURLError` when ``target`` is a URL that cannot be opened here."""
    if is_remote(target):
        _filesystem_class(os.fspath(target), what)


def _filesystem_class(url: str, what: str) -> Any:
    scheme = url_scheme(url) or ""
    try:
        import fsspec  # type: ignore[import-untyped]
        from fsspec.registry import known_implementations  # type: ignore[import-untyped]
    except ImportError:
        raise StorageURLError(
            f"{what} {url!r} is a {scheme}:// URL, which needs fsspec. HINT: "
            "pip install 'replicator[remote]' (fsspec and s3fs), or give a local path.") from None
    if scheme not in known_implementations and scheme not in fsspec.available_protocols():
        raise StorageURLError(
            f"{what} {url!r} has the unknown URL scheme {scheme!r}, so it cannot be opened "
            f"(it is not taken for a local directory named '{scheme}:'). HINT: use a local "
            "path, or a scheme fsspec knows: s3://, gs://, az://, hdfs://, memory://, file://.")
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        hint = known_implementations.get(scheme, {}).get("err", "")
        raise StorageURLError(
            f"{what} {url!r} needs a package that implements {scheme}://, which is not "
            f"installed ({hint or exc}), so it cannot be opened. HINT: install it (for s3:// "
            "and gs://: pip install 'replicator[remote]' s3fs / gcsfs).") from None


def _io(op: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Turn a store's own exceptions (botocore's, aiohttp's) into ``OSError`` naming the call;
    ``FileNotFoundError`` passes through."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(self: RemoteStore, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except (FileNotFoundError, StorageURLError):
                raise
            except Exception as exc:  # noqa: BLE001 - the store's own errors, translated
                name = str(args[0]) if args else ""
                what = (f"{self.scheme}://{name}" if name.startswith(self.root)
                        else f"{self.url}/{name}")
                detail = str(exc) or f"no answer in {self.timeout:.0f} s"
                message = f"{op} {what}: {type(exc).__name__}: {detail}"
                code = getattr(exc, "errno", None)
                raise (OSError(code, message) if code else OSError(message)) from exc
        return call
    return wrap


class RemoteStore:
    """A root URL on an fsspec file system with the few calls the checkpoint room needs; names
    are relative to the root, and listings bypass fsspec's cache (other processes write here)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 what: str = "the checkpoint location") -> None:
        cls = _filesystem_class(url, what)
        self.url = url.rstrip("/")
        self.scheme = url_scheme(url) or ""
        self.storage_options = merged_options(self.scheme, storage_options)
        options = dict(self.storage_options)
        retries = options.pop("retries", None)  # s3fs's own retry count (an attribute)
        #: Seconds one call on the store may take (a hung server never answers a PUT).
        self.timeout = float(options.pop("operation_timeout", OPERATION_TIMEOUT))
        if getattr(cls, "cachable", True):
            options.setdefault("skip_instance_cache", True)
        self.fs = cls(**options)
        if retries is not None:
            self.fs.retries = int(retries)
        self._limit = {"timeout": self.timeout} if getattr(self.fs, "async_impl", False) \
            else {}
        self.root = str(cls._strip_protocol(self.url)).rstrip("/")  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def __str__(self) -> str:
        return self.url

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def name_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def put(self, name: str, data: bytes) -> None:
        self.put_path(self.path(name), data)

    @_io("writing")
    def put_path(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` (a full path on the store, without the scheme)."""
        self.fs.pipe_file(path, bytes(data), **self._limit)

    @_io("reading")
    def get(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(name), **self._limit))

    def get_or(self, name: str, missing: str) -> bytes:
        """The object ``name``; :class:`CheckpointCorruptError` saying ``missing`` if gone."""
        try:
            return self.get(name)
        except FileNotFoundError:
            raise CheckpointCorruptError(missing) from None

    @_io("checking")
    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.path(name))
        return bool(self.fs.exists(self.path(name), **self._limit))

    def _listing(self, prefix: str) -> tuple[str, list[dict[str, Any]]]:
        """The folder path ending in ``/`` and its fresh (uncached) entries; none if missing."""
        where = self.path(prefix)
        self.fs.invalidate_cache(where)
        try:
            entries = self.fs.ls(where, detail=True, **self._limit)
        except FileNotFoundError:
            entries = []
        return where.rstrip("/") + "/", entries

    @_io("listing")
    def objects(self, prefix: str) -> list[tuple[str, int]]:
        """``(name, size)`` of the objects directly under ``prefix`` (a folder name)."""
        base, entries = self._listing(prefix)
        out = []
        for e in entries:
            full = str(e["name"]).rstrip("/")
            if e.get("type") == "directory" or not full.startswith(base):
                continue
            out.append((full[len(base):], int(e.get("size") or 0)))
        return sorted(out)

    @_io("listing")
    def folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under ``prefix``."""
        base, entries = self._listing(prefix)
        return sorted(str(e["name"]).rstrip("/")[len(base):] for e in entries
                      if e.get("type") == "directory"
                      and str(e["name"]).startswith(base))

    @_io("deleting")
    def remove(self, name: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(self.path(name), recursive=recursive, **self._limit)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path(name))


def merged_options(scheme: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` over the defaults for ``scheme`` (short S3 timeouts), over what fsspec's
    own configuration (``FSSPEC_S3_ENDPOINT_URL`` and the like) sets."""
    try:
        import fsspec.config  # type: ignore[import-untyped]
        fresh: dict[str, dict[str, Any]] = {}
        fsspec.config.set_conf_env(fresh)  # FSSPEC_S3_ENDPOINT_URL set after fsspec's import
        conf = {**fsspec.config.conf.get(scheme, {}), **fresh.get(scheme, {})}
    except ImportError:
        conf = {}
    defaults = S3_DEFAULTS if scheme in ("s3", "s3a") else \
        {"auto_mkdir": True} if scheme in ("file", "local") else {}  # folders as on S3
    base: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v
                            for k, v in defaults.items()}
    given = dict(options or {})
    if "endpoint_url" in dict(given.get("client_kwargs") or {}):
        conf.pop("endpoint_url", None)  # the caller's endpoint wins over the environment's
    for k, v in {**conf, **given}.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return base


def read_url(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes | None:
    """The bytes of the object at ``url`` (``None`` when there is none)."""
    store = RemoteStore(url, storage_options, "the file")
    try:
        return store.get("")
    except FileNotFoundError:
        return None


def write_url(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write the object at ``url`` in one call (a reader sees the old or the new one whole)."""
    store = RemoteStore(url, storage_options, "the file")
    store.put_path(store.root, data)


def upload_tree(local: str | os.PathLike[str], url: str,
                storage_options: Mapping[str, Any] | None = None) -> None:
    """Copy every file under the local directory ``local`` to the same names under ``url``."""
    store = RemoteStore(url, storage_options, "the directory")
    base = Path(local)
    for path in sorted(base.rglob("*")):
        if path.is_file():
            store.put(path.relative_to(base).as_posix(), path.read_bytes())


# -- commit objects: how a save in a store without atomic rename becomes visible -------------------
#: A save uploads its files under ``data/<save id>/`` and is committed by the object
#: ``commits/<save id>.json`` written last (the manifest with the prefix); ``<save id>`` is
#: ``step-00000030.<token>``.
COMMITS = "commits"
DATA = "data"
_COMMIT = re.compile(r"^step-(\d{8,})\.([A-Za-z0-9-]{1,80})\.json$")


def parse_commit_name(name: str) -> tuple[int, str] | None:
    """``(step, save id)`` of a commit object's name, ``None`` for anything else."""
    m = _COMMIT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_commit(store: RemoteStore, name: str) -> dict[str, Any]:
    """The checked manifest of the commit object ``name``; :class:`CheckpointCorruptError`
    when it is gone, damaged or names no data prefix."""
    where = f"commit {store.url}/{COMMITS}/{name}"
    raw = store.get_or(f"{COMMITS}/{name}", f"{where} disappeared while reading it")
    manifest = parse_marker(raw, where)
    if not isinstance(manifest.get("prefix"), str) or not manifest["prefix"].startswith(
            f"{DATA}/"):
        raise CheckpointCorruptError(f"{where} names no data prefix")
    return manifest


# -- the lease: one job writes to a location at a time -------------------------------------------
# ``LEASE.json`` (job id, host, pid, heartbeat renewed every ``timeout / 4`` s): another job
# refuses to write while it is fresh; a stale one, or one of the same job or a dead process of
# this host (a restart), is taken over.
LEASE_NAME = "LEASE.json"
#: Seconds without a heartbeat after which another job may take the lease over.
DEFAULT_LEASE_TIMEOUT = 120.0
JOB_ID_ENV = "REPLICATOR_JOB_ID"


_PROCESS_ID: dict[int, str] = {}


def default_job_id() -> str:
    """The job's id as its launcher knows it, else one for this process (host, pid)."""
    for var in (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "REPLICATOR_RUN_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":
            return value
    pid = os.getpid()
    if pid not in _PROCESS_ID:
        _PROCESS_ID[pid] = f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:6]}"
    return _PROCESS_ID[pid]


#: Leases whose heartbeat runs in this process, released when the interpreter exits.
_HELD: weakref.WeakSet[Lease] = weakref.WeakSet()


def _release_at_exit() -> None:
    """Stop every heartbeat and delete the lease, so a script that never closed its backups
    still ends at once and leaves no lease."""
    for lease in list(_HELD):
        lease.release()


atexit.register(_release_at_exit)


class Lease:
    """Hold ``LEASE.json`` in ``store`` for ``job_id`` (call :meth:`acquire` on one process)."""

    def __init__(self, store: RemoteStore, job_id: str | None = None,
                 timeout: float = DEFAULT_LEASE_TIMEOUT) -> None:
        if timeout <= 0:
            raise ValueError(f"lease_timeout must be a positive number of seconds, got "
                             f"{timeout!r}")
        self.store, self.timeout = store, float(timeout)
        self.job_id = job_id or default_job_id()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "host": self.host, "pid": self.pid,
                "heartbeat": time.time(), "timeout": self.timeout}

    def read(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.store.get(LEASE_NAME)))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"job_id": "?", "heartbeat": 0.0}  # damaged: treat as stale

    def _ours(self, held: dict[str, Any]) -> bool:
        return held.get("job_id") == self.job_id and held.get("pid") == self.pid \
            and held.get("host") == self.host

    def acquire(self) -> None:
        """Take the lease or raise :class:`StoreLeaseError`; start the heartbeat."""
        held = self.read()
        if held is not None and not self._ours(held):
            age = time.time() - float(held.get("heartbeat", 0.0))
            same_job = held.get("job_id") == self.job_id
            gone = held.get("host") == self.host and isinstance(held.get("pid"), int) \
                and not process_alive(held["pid"])
            who = (f"job {held.get('job_id')!r} (host {held.get('host')}, pid "
                   f"{held.get('pid')}, last heartbeat {age:.0f} s ago)")
            if not (same_job or gone) and age < self.timeout:
                raise StoreLeaseError(
                    f"{self.store.url} is being written by another {who}; this job "
                    f"({self.job_id!r}) refuses to write there, so neither overwrites the "
                    f"other's backups. HINT: give this job its own location, stop the other "
                    f"one, or wait: a lease with no heartbeat for {self.timeout:.0f} s "
                    "(lease_timeout) is taken over.")
            reason = ("the same job, restarted" if same_job else
                      "its process is gone" if gone else f"stale: older than "
                      f"{self.timeout:.0f} s")
            print(f"[replicator] taking over the lease of {self.store.url} from {who}: "
                  f"{reason}", file=sys.stderr, flush=True)
        self.store.put(LEASE_NAME, json.dumps(self._record()).encode())
        check = self.read()
        if check is None or not self._ours(check):
            raise StoreLeaseError(
                f"{self.store.url}: another job ({(check or {}).get('job_id')!r}) took the "
                "lease at the same moment; this one refuses to write there. HINT: give each "
                "job its own location.")
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="replicator-lease",
                                            daemon=True)
            self._thread.start()
            _HELD.add(self)

    def renew(self) -> None:
        """Write a fresh heartbeat, unless another job took the lease (then :attr:`lost`)."""
        held = self.read()
        if held is not None and not self._ours(held):
            self.lost = (f"job {held.get('job_id')!r} on {held.get('host')} took over the "
                         f"lease of {self.store.url}")
            return
        self.store.put(LEASE_NAME, json.dumps(self._record()).encode())

    def check(self) -> None:
        """Raise :class:`StoreLeaseError` when the lease was taken over by another job."""
        if self.lost:
            raise StoreLeaseError(f"{self.lost}; this job stops writing backups there. "
                                  "HINT: two jobs must not share one backup location.")

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout / 4):
            try:
                self.renew()
            except OSError:
                pass  # the store is unreachable for now: the next beat tries again
            if self.lost:
                return

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        _HELD.discard(self)
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        try:
            held = self.read()
            if held is not None and self._ours(held):
                self.store.remove(LEASE_NAME)
        except OSError:
            pass
