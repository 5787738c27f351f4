"""URLs and :class:`FsspecStorage`: the store's calls and the checkpoint storage protocol over
them (commit objects written last, under a lease). A URL fsspec does not know is an error, never
a local directory named ``s3:``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from replicator.checkpoint import serialization
from replicator.checkpoint.lease import DEFAULT_LEASE_TIMEOUT as DEFAULT_LEASE_TIMEOUT
from replicator.checkpoint.lease import LEASE_NAME as LEASE_NAME
from replicator.checkpoint.lease import Lease
from replicator.checkpoint.manifest import (
    FileEntry,
    check_bytes,
    check_file_name,
    parse_marker,
    seal,
)
from replicator.errors import CheckpointCorruptError, StorageURLError

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
        def call(self: FsspecStorage, *args: Any, **kwargs: Any) -> T:
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
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def read_url(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes | None:
    """The bytes of the object at ``url`` (``None`` when there is none)."""
    store = FsspecStorage(url, storage_options, "the file")
    try:
        return store.get("")
    except FileNotFoundError:
        return None


def write_url(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write the object at ``url`` in one call (a reader sees the old or the new one whole)."""
    store = FsspecStorage(url, storage_options, "the file")
    store.put_path(store.root, data)


def upload_tree(local: str | os.PathLike[str], url: str,
                storage_options: Mapping[str, Any] | None = None) -> None:
    """Copy every file under the local directory ``local`` to the same names under ``url``."""
    store = FsspecStorage(url, storage_options, "the directory")
    base = Path(local)
    for path in sorted(base.rglob("*")):
        if path.is_file():
            store.put(path.relative_to(base).as_posix(), path.read_bytes())


# -- commit objects: a save in a store (no atomic rename) becomes visible by the one written last
COMMITS = "commits"
DATA = "data"
_COMMIT = re.compile(r"^step-(\d{8,})\.([A-Za-z0-9-]{1,80})\.json$")


def parse_commit_name(name: str) -> tuple[int, str] | None:
    """``(step, save id)`` of a commit object's name, ``None`` for anything else."""
    m = _COMMIT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FsspecStorage:
    """Saves in an fsspec store, committed by a commit object written last, under a lease.

    ``data/step-00000030.<id>/`` holds one save's objects and ``commits/step-00000030.<id>.json``
    commits it; an upload without a commit is never read, and is deleted once a save of the same
    or a later step commits. Listings bypass fsspec's cache; :meth:`open` takes the lease.
    """

    retries_later = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 what: str = "the checkpoint location", *, job_id: str | None = None,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> None:
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
        self.location = self.url
        self.job_id, self.lease_timeout = job_id, lease_timeout
        self._lease: Lease | None = None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

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
        named = [(str(e["name"]).rstrip("/"), e) for e in entries]
        return sorted((full[len(base):], int(e.get("size") or 0)) for full, e in named
                      if e.get("type") != "directory" and full.startswith(base))

    @_io("listing")
    def folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under ``prefix``."""
        base, entries = self._listing(prefix)
        return sorted(str(e["name"]).rstrip("/")[len(base):] for e in entries
                      if e.get("type") == "directory" and str(e["name"]).startswith(base))

    @_io("deleting")
    def remove(self, name: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(self.path(name), recursive=recursive, **self._limit)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path(name))

    # -- the storage protocol (``storage.py``) --------------------------------------------------
    @property
    def lease(self) -> Lease:
        if self._lease is None:
            self._lease = Lease(self, self.job_id, self.lease_timeout)
        return self._lease

    def open(self) -> None:
        self.lease.acquire()

    def check(self) -> None:
        self.lease.check()

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()

    def staging(self, step: int, save_id: str) -> str:
        return f"{DATA}/step-{step:08d}.{save_id}"

    def begin(self, staging: str) -> None:
        """Nothing to create: objects make their own folders."""

    def write(self, staging: str, fname: str, tensors: Mapping[str, torch.Tensor],
              metadata: Mapping[str, str]) -> FileEntry:
        return self._upload(f"{staging}/{fname}", serialization.to_bytes(tensors, metadata))

    def _upload(self, name: str, data: bytes) -> FileEntry:
        self.put(name, data)
        return FileEntry(bytes=len(data), sha256=hash_bytes(data))

    def dest(self, staging: str, fname: str) -> str:
        return self.path(f"{staging}/{fname}")

    def folder(self, staging: str) -> Path:
        """A scratch folder of this process that :meth:`publish` uploads and deletes."""
        return Path(tempfile.mkdtemp(prefix="replicator-shards-"))

    def publish(self, staging: str, folder: Path, rank: int) -> dict[str, FileEntry]:
        """Upload this rank's scratch folder, hashing as it goes, then delete it."""
        try:
            return {p.name: self._upload(f"{staging}/{p.name}", p.read_bytes())
                    for p in sorted(folder.iterdir()) if p.is_file()}
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def commit(self, step: int, staging: str, manifest: dict[str, Any],
               before: Callable[[Any], None] | None = None) -> str:
        """Check every object's size in the store, ``before(url)``, then write the commit."""
        name = f"{staging.split('/', 1)[1]}.json"
        try:
            listed = dict(self.objects(staging))
            for fname, entry in manifest["files"].items():
                if listed.get(fname) != entry["bytes"]:
                    raise OSError(f"{self.name_url(staging)}/{fname} is "
                                  f"{'missing' if fname not in listed else 'the wrong size'} "
                                  "in the store after its upload")
            manifest["prefix"] = staging
            marker = seal(manifest)
            if before is not None:
                before(self.name_url(staging))
            self.check()
            self.put(f"{COMMITS}/{name}", marker)
        except BaseException:
            self.discard(staging)
            raise
        return name

    def discard(self, staging: str) -> None:
        """Delete an upload that will not be committed; a later save's pruning retries."""
        try:
            self.remove(staging, recursive=True)
        except OSError:
            pass

    def saves(self) -> list[tuple[int, str]]:
        """``(step, commit object name)`` of every commit object, oldest first."""
        return sorted((parsed[0], name) for name, _ in self.objects(COMMITS)
                      if (parsed := parse_commit_name(name)) is not None)

    def committed(self) -> list[int]:
        return sorted({s for s, _ in self.saves()})

    def manifest(self, ref: str) -> dict[str, Any]:
        """The checked manifest of the commit object ``ref`` (:class:`CheckpointCorruptError`)."""
        where = f"commit {self.url}/{COMMITS}/{ref}"
        raw = self.get_or(f"{COMMITS}/{ref}", f"{where} disappeared while reading it")
        manifest = parse_marker(raw, where)
        if not isinstance(manifest.get("prefix"), str) or not manifest["prefix"].startswith(
                f"{DATA}/"):
            raise CheckpointCorruptError(f"{where} names no data prefix")
        return manifest

    def read(self, ref: str, manifest: Mapping[str, Any], fname: str) -> np.ndarray:
        where = f"commit {COMMITS}/{ref}"
        if fname not in manifest["files"]:
            raise CheckpointCorruptError(f"{where} does not list {fname!r}")
        check_file_name(fname, where)
        url = f"{self.name_url(manifest['prefix'])}/{fname}"
        data = self.get_or(f"{manifest['prefix']}/{fname}", f"{where}: object {url} is missing")
        check_bytes(where, f"object {url}", manifest["files"][fname], len(data),
                    hash_bytes(data))
        return np.frombuffer(bytearray(data), dtype=np.uint8)

    def fetch_all(self, ref: str) -> Path:
        """Every object of the save, verified, in a scratch folder (the caller deletes it)."""
        manifest = self.manifest(ref)
        into = Path(tempfile.mkdtemp(prefix="replicator-shards-"))
        try:
            for fname in manifest["files"]:
                (into / fname).write_bytes(self.read(ref, manifest, fname).tobytes())
        except BaseException:
            shutil.rmtree(into, ignore_errors=True)
            raise
        return into

    def where(self, ref: str) -> str:
        return f"{self.url}/{COMMITS}/{ref}"

    def prune(self, step: int, newest: str, keep: int, wait: bool = False) -> None:
        """Keep the newest ``keep`` commits up to ``step``; delete older ones, their data and
        uploads without a commit up to ``step`` (later ones may be the next save's, uploading)."""
        self._drop(lambda commits: {*[n for s, n in commits if s <= step][-keep:], newest},
                   step, "old checkpoints")

    def cleanup(self, after: int | None = None) -> list[str]:
        """With ``after`` (the chief, while no save runs): delete every save newer than it and
        every upload without a commit. Without: nothing (the next commit's pruning does it)."""
        if after is None:
            return []
        return self._drop(lambda commits: {n for s, n in commits if s <= after}, None,
                          "interrupted saves")

    def _drop(self, keep: Callable[[list[tuple[int, str]]], set[str]], upto: int | None,
              what: str) -> list[str]:
        """Delete every commit but ``keep(commits)`` and the data of none of those up to step
        ``upto``; returns the data folders removed (a store that fails: warned, none)."""
        try:
            commits = self.saves()
            kept = keep(commits)
            for _, name in commits:
                if name not in kept:
                    self.remove(f"{COMMITS}/{name}")
            kept_ids = {n.removesuffix(".json") for n in kept}
            removed = []
            for folder in self.folders(DATA):
                parsed = parse_commit_name(f"{folder}.json")
                if folder not in kept_ids and parsed and (upto is None or parsed[0] <= upto):
                    self.remove(f"{DATA}/{folder}", recursive=True)
                    removed.append(folder)
            return removed
        except OSError as exc:
            warnings.warn(f"could not remove {what} in {self.url}: {exc}", RuntimeWarning,
                          stacklevel=4)
            return []

    def delete_all(self) -> None:
        for _, name in self.saves():
            self.remove(f"{COMMITS}/{name}")
        self.remove(DATA, recursive=True)
        self.remove(COMMITS, recursive=True)
        self.release()


#: The store's former name, kept for code that names it.
RemoteStore = FsspecStorage
