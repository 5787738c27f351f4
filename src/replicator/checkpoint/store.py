"""Where training state goes: a local directory, or an fsspec URL (an object store or a
distributed file system).

``s3://bucket/run``, ``gs://bucket/run``, ``memory://run`` (tests) and the other schemes that
fsspec knows are opened through fsspec (the optional extra ``replicator[remote]``; ``s3://``
needs ``s3fs``, ``gs://`` needs ``gcsfs``); ``file://`` URLs and plain paths are local
directories and keep the local code path (atomic renames, fsync). Anything that looks like a
URL but cannot be opened is an error, never a local directory named ``s3:``.

S3 credentials and endpoint come from the usual places: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (or a profile), and ``FSSPEC_S3_ENDPOINT_URL`` for an
S3-compatible server; or pass ``storage_options`` (for example
``{"client_kwargs": {"endpoint_url": ...}}``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from replicator.errors import StorageURLError

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
            f"{what} {url!r} has the unknown URL scheme {scheme!r}; nothing was written (it "
            f"is not read as a local directory named '{scheme}:'). HINT: use a local path, or "
            "a scheme fsspec knows: s3://, gs://, az://, hdfs://, memory://, file://.")
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        hint = known_implementations.get(scheme, {}).get("err", "")
        raise StorageURLError(
            f"{what} {url!r} needs a package that implements {scheme}://, which is not "
            f"installed ({hint or exc}); nothing was written. HINT: install it (for s3:// "
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
    """A root URL on an fsspec file system, with the few calls the checkpoint room needs.

    Names are ``/``-separated paths relative to the root. Listings always bypass fsspec's
    directory cache, since other processes write here too.
    """

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


def open_store(target: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
               what: str = "the checkpoint location") -> Path | RemoteStore:
    """A local :class:`Path` for a path or ``file://`` URL, a :class:`RemoteStore` for any
    other URL fsspec can open; :class:`StorageURLError` for the rest."""
    if isinstance(target, RemoteStore):
        return target
    if is_remote(target):
        return RemoteStore(os.fspath(target), storage_options, what)
    return local_path(target)


def backup_location(target: str | os.PathLike[str]) -> Any:
    """``target`` checked and normalised: a local :class:`Path`, or the URL as a string
    (:class:`StorageURLError` now, at construction, for a URL that cannot be opened)."""
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"a backup location is a path or a URL string, got "
                        f"{type(target).__name__}")
    check_location(target, "the backup location")
    return os.fspath(target).rstrip("/") if is_remote(target) else local_path(target)


def join_location(base: Any, name: str) -> Any:
    """``base / name`` for a local path, ``base + "/" + name`` for a URL."""
    return f"{base}/{name}" if isinstance(base, str) and is_remote(base) else Path(base) / name


def remove_location(target: Any) -> None:
    """Delete a directory, local (never half-deleted under its name) or in a store."""
    if isinstance(target, str) and is_remote(target):
        RemoteStore(target).remove("", recursive=True)
        return
    from replicator.checkpoint.atomic import remove_tree

    remove_tree(target)


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
