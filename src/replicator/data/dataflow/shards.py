"""Sharded datasets in WebDataset's layout: tar files whose members ``<key>.<ext>`` that share a
key (consecutive, the part of the name before its first dot) make one sample, read from local
paths or any fsspec URL (``s3://``, ``gs://``, ``https://``...).

Each sample is a dict of the members' extensions to their bytes, with ``"__key__"`` and
``"__url__"`` (the shard). A remote shard is fetched into a local cache folder shared by the
processes of a host (a lock per shard, so the replicas of one host fetch it once) and kept
there, the least recently used shards leaving when the cache exceeds its size limit; the next
``prefetch_shards`` shards are fetched while the current one is read. A shard read to its end
is remembered by its sample count, so a resumed pass skips whole shards without fetching them.

Bad input never shortens an epoch silently: a missing or unreachable shard (after retries), or
a truncated or damaged one, raises :class:`ShardError` naming the shard (and the sample reached);
with ``on_error="skip"`` it is skipped, counted in ``stats()`` and logged once.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from replicator.data.dataflow.graph import UNKNOWN, Ctx, Node
from replicator.data.errors import InputPipelineError

RETRIES = 3
#: Short timeouts and few retries of the store's client (a shard is tried RETRIES times here).
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                      "retries": {"max_attempts": 2, "mode": "standard"}},
}


class ShardError(InputPipelineError):
    """A shard is missing, unreachable, truncated or damaged."""


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def store_options(url: str) -> dict[str, Any]:
    """fsspec's configuration for ``url``'s protocol, read from the environment now
    (``FSSPEC_S3_ENDPOINT_URL`` and the like may be set after fsspec was imported)."""
    if _is_local(url):
        return {}
    import fsspec.config  # type: ignore[import-untyped]

    fresh: dict[str, dict[str, Any]] = {}
    fsspec.config.set_conf_env(fresh)
    scheme = url.split("://", 1)[0]
    base = dict(S3_DEFAULTS) if scheme in ("s3", "s3a") else {}
    return {**base, **fsspec.config.conf.get(scheme, {}), **fresh.get(scheme, {})}


def expand_urls(pattern_or_urls: str | Sequence[str]) -> list[str]:
    """A glob pattern's matches (sorted, with the URL's protocol kept), or the list given."""
    if isinstance(pattern_or_urls, (str, os.PathLike)):
        pattern = os.fspath(pattern_or_urls)
        if not any(c in pattern for c in "*?["):
            return [pattern]
        import fsspec  # type: ignore[import-untyped]

        fs, path = fsspec.core.url_to_fs(pattern, **store_options(pattern))
        found = sorted(fs.glob(path))
        if not found:
            raise FileNotFoundError(f"no file matches {pattern!r}. HINT: check the pattern, "
                                    "and for a store its credentials and endpoint")
        if _is_local(pattern):
            return [str(p) for p in found]
        return [fs.unstrip_protocol(p) for p in found]
    urls = [os.fspath(u) for u in pattern_or_urls]
    if not urls:
        raise ValueError("the list of files is empty")
    return urls


# -- writing ------------------------------------------------------------------------------------
def _as_bytes(key: str, ext: str, value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(f"sample {key!r}: the value of {ext!r} is a {type(value).__name__}; shards "
                    "hold bytes. HINT: encode it first (an image as JPEG bytes, a tensor with "
                    "torch.save into io.BytesIO)")


def _sample_members(index: int, sample: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    key = str(sample.get("__key__", f"{index:09d}"))
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} may not contain '.' or '/' (the member name "
                         "<key>.<ext> is split at its first dot)")
    for ext, value in sample.items():
        if not ext.startswith("__"):
            yield f"{key}.{ext}", _as_bytes(key, ext, value)


def write_shards(samples: Iterable[dict[str, Any]], url_prefix: str,
                 samples_per_shard: int = 1000) -> list[str]:
    """Write ``samples`` (dicts of extension -> bytes/str/number, with an optional
    ``"__key__"``) into tar shards ``{url_prefix}-000000.tar``, ... at a local path or an fsspec
    URL; returns the shards' URLs."""
    import fsspec  # type: ignore[import-untyped]

    if isinstance(samples_per_shard, bool) or not isinstance(samples_per_shard, int) \
            or samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be a positive integer, got "
                         f"{samples_per_shard!r}")
    if _is_local(url_prefix):
        os.makedirs(os.path.dirname(os.path.abspath(_local_path(url_prefix))), exist_ok=True)
    urls: list[str] = []
    out: Any = None
    tar: tarfile.TarFile | None = None
    try:
        for index, sample in enumerate(samples):
            if index % samples_per_shard == 0:
                if tar is not None:
                    tar.close()
                    out.close()
                urls.append(f"{url_prefix}-{len(urls):06d}.tar")
                out = fsspec.open(urls[-1], "wb", **store_options(urls[-1])).open()
                tar = tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT)
            assert tar is not None
            for name, data in _sample_members(index, sample):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o444, 0
                tar.addfile(info, io.BytesIO(data))
    finally:
        if tar is not None:
            tar.close()
        if out is not None:
            out.close()
    return urls


# -- reading ------------------------------------------------------------------------------------
def read_shard(path: str, url: str) -> Iterator[dict[str, Any]]:
    """The samples of one local tar file (``url`` names it in samples and errors)."""
    count, last = 0, None
    try:
        with tarfile.open(path, "r:") as tar:
            sample: dict[str, Any] = {}
            for member in tar:
                if not member.isfile():
                    continue
                base = os.path.basename(member.name)
                key, _, ext = base.partition(".")
                key = os.path.join(os.path.dirname(member.name), key)
                if sample and key != sample["__key__"]:
                    yield sample
                    count, last, sample = count + 1, sample["__key__"], {}
                f = tar.extractfile(member)
                data = f.read() if f is not None else b""
                if len(data) != member.size:
                    raise tarfile.ReadError("unexpected end of data")
                sample.setdefault("__key__", key)
                sample.setdefault("__url__", url)
                sample[ext] = data
            end = tar.offset
            if os.path.getsize(path) < end + 1024:  # the two zero blocks of a whole archive
                raise tarfile.ReadError("the archive ends without its end-of-archive blocks")
            if sample:
                yield sample
    except (tarfile.TarError, EOFError, OSError) as exc:
        where = f"after sample {last!r} (the {count}th)" if last is not None else \
            "before its first sample"
        raise ShardError(f"shard {url} is truncated or damaged {where}: {type(exc).__name__}: "
                         f"{exc}. HINT: write it again, or pass from_shards(..., "
                         "on_error='skip') to skip what cannot be read") from exc


# A flock belongs to the open file, which a forked child (a decode worker) shares: the child
# would keep a shard locked after this process released it, blocking its eviction (and a
# fetch) for the child's lifetime. Lock files are therefore tracked, and a child points them
# at /dev/null as soon as it is forked.
_lock_fds: set[int] = set()
_lock_fds_guard = threading.Lock()


def _open_lock(path: str) -> IO[str]:
    lock = open(path + ".lock", "a+")  # noqa: SIM115 - closed by _close_lock
    with _lock_fds_guard:
        _lock_fds.add(lock.fileno())
    return lock


def _close_lock(lock: IO[str]) -> None:
    """Close a lock file (which drops its lock unless a forked child still had it)."""
    with _lock_fds_guard:
        _lock_fds.discard(lock.fileno())
    lock.close()


def _drop_inherited_locks() -> None:
    global _lock_fds_guard
    _lock_fds_guard = threading.Lock()  # a parent's thread may have held it at the fork
    null = os.open(os.devnull, os.O_RDWR)
    for fd in _lock_fds:
        os.dup2(null, fd)  # the lock's file is no longer open here; the number stays valid
    os.close(null)
    _lock_fds.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class ShardCache:
    """Local copies of remote shards in ``folder``, shared by a host's processes, least recently
    used ones removed beyond ``limit_bytes``.

    Each shard has a lock file: a fetch holds it exclusively (the host's replicas fetch a shard
    once), a reader holds it shared until the shard is read (so no process of the host evicts a
    shard that one of them still reads), and eviction removes only shards whose lock it gets.
    """

    def __init__(self, folder: str | None, limit_bytes: int | None, timeout_s: float) -> None:
        self.folder = folder or os.path.join(tempfile.gettempdir(), "replicator-shards")
        os.makedirs(self.folder, exist_ok=True)
        if limit_bytes is None:
            limit_bytes = max(1 << 30, shutil.disk_usage(self.folder).free // 2)
        self.limit, self.timeout_s = limit_bytes, timeout_s
        self.held: dict[str, tuple[IO[str], int]] = {}  # shard path -> (its shared lock, uses)
        self._lock = threading.Lock()

    def path_of(self, url: str) -> str:
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        return os.path.join(self.folder, f"{digest}-{os.path.basename(url)}")

    def get(self, url: str, counters: Any) -> str:
        """The local path of ``url``'s shard, fetched unless a process of this host has; it stays
        in the cache until :meth:`release`."""
        path = self.path_of(url)
        with self._lock:
            if path in self.held:  # this process already reads it (and holds its lock)
                lock, uses = self.held[path]
                self.held[path] = (lock, uses + 1)
                counters("shard_cache_hits")
                return path
        fetched = False
        lock = _open_lock(path)  # held until release()
        try:
            deadline = time.monotonic() + self.timeout_s
            # Readers share the lock: a shard that is there is read beside any other reader;
            # only a fetch (and an eviction) holds it alone.
            self._flock(lock, fcntl.LOCK_SH, deadline, url)
            while not os.path.exists(path):
                self._flock(lock, fcntl.LOCK_EX, deadline, url)
                if not os.path.exists(path):  # no process of this host fetched it meanwhile
                    self._fetch(url, path)
                    counters("shard_fetches")
                    fetched = True
                # Linux converts a lock by dropping it first: another process may evict the
                # shard in that gap, so it is checked again under the shared lock.
                self._flock(lock, fcntl.LOCK_SH, deadline, url)
            if not fetched:
                os.utime(path)
                counters("shard_cache_hits")
        except BaseException:
            _close_lock(lock)
            raise
        with self._lock:
            if path in self.held:  # another thread of this process got it meanwhile
                held, uses = self.held[path]
                self.held[path] = (held, uses + 1)
                _close_lock(lock)
            else:
                self.held[path] = (lock, 1)
        self._evict()
        return path

    def release(self, path: str) -> None:
        """The shard at ``path`` was read: it may leave the cache when room is needed."""
        with self._lock:
            lock, uses = self.held.get(path, (None, 1))
            if uses > 1 and lock is not None:
                self.held[path] = (lock, uses - 1)
                lock = None
            else:
                self.held.pop(path, None)
        if lock is not None:
            _close_lock(lock)  # closing the file drops its lock
        self._evict()

    def _flock(self, lock: IO[str], kind: int, deadline: float, url: str) -> None:
        while True:
            try:
                fcntl.flock(lock, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ShardError(f"waited {self.timeout_s:.0f} s for another process "
                                     f"fetching shard {url}") from None
                time.sleep(0.05)

    def _fetch(self, url: str, path: str) -> None:
        import fsspec  # type: ignore[import-untyped]

        tmp = f"{path}.part-{os.getpid()}"
        for attempt in range(RETRIES):
            try:
                with fsspec.open(url, "rb", **store_options(url)) as src, \
                        open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(tmp, path)
                return
            except FileNotFoundError as exc:
                raise ShardError(f"shard {url} does not exist. HINT: check the URL list (and "
                                 "list_files' pattern)") from exc
            except Exception as exc:  # noqa: BLE001 - a store's errors vary; retried, then named
                if attempt == RETRIES - 1:
                    raise ShardError(f"could not fetch shard {url} after {RETRIES} tries: "
                                     f"{type(exc).__name__}: {exc}. HINT: is the store "
                                     "reachable (endpoint, credentials)?") from exc
                time.sleep(0.5 * 2 ** attempt)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)

    def _evict(self) -> None:
        """Remove least recently used shards beyond the limit, skipping any a process reads."""
        entries = []
        for name in os.listdir(self.folder):
            if name.endswith(".lock") or ".part-" in name:
                continue
            f = os.path.join(self.folder, name)
            try:
                st = os.stat(f)
                entries.append((st.st_mtime, st.st_size, f))
            except FileNotFoundError:
                continue
        total = sum(size for _, size, _ in entries)
        for _, size, f in sorted(entries):
            if total <= self.limit:
                return
            if self._remove_unless_read(f):
                total -= size

    @staticmethod
    def _remove_unless_read(path: str) -> bool:
        lock = _open_lock(path)  # a new open file: its lock conflicts with ours
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # fetched or read by some process of this host
            try:
                os.remove(path)
                return True
            except FileNotFoundError:
                return False
        finally:
            _close_lock(lock)


class ShardSource(Node):
    """The samples of a list of shards (or of a dataset of shard URLs, e.g. a shuffled
    ``list_files``), shard after shard."""

    name = "from_shards"

    def __init__(self, urls: str | Sequence[str] | Node, *, on_error: str,
                 cache_dir: str | None, cache_limit_bytes: int | None,
                 prefetch_shards: int) -> None:
        self.inputs = (urls,) if isinstance(urls, Node) else ()
        self.urls = None if isinstance(urls, Node) else expand_urls(urls)
        self.on_error, self.prefetch_shards = on_error, prefetch_shards
        self.cache_dir, self.cache_limit = cache_dir, cache_limit_bytes
        self.sizes: dict[str, int] = {}  # samples of each shard read to its end

    def describe(self) -> str:
        n = f"{len(self.urls)} shards" if self.urls is not None else self.inputs[0].describe()
        return f"from_shards({n})"

    def cardinality(self) -> int:
        return UNKNOWN

    def order_varies(self) -> bool:
        return bool(self.inputs) and self.inputs[0].order_varies()

    def _cache(self, ctx: Ctx) -> ShardCache:
        key = id(self)
        if key not in ctx.runtime.caches:
            # The fetch threads ask at once: setdefault keeps one cache, so no thread's held
            # locks sit in a cache that is dropped (its files closed, its shards evictable).
            ctx.runtime.caches.setdefault(key, ShardCache(
                self.cache_dir, self.cache_limit, ctx.runtime.options.timeout_seconds))
        return ctx.runtime.caches[key]  # type: ignore[no-any-return]

    def _fetch(self, ctx: Ctx, url: str) -> str:
        if _is_local(url):
            path = _local_path(url)
            if not os.path.exists(path):
                raise ShardError(f"shard {url} does not exist. HINT: check the list of shards "
                                 "(and list_files' pattern)")
            return path
        return self._cache(ctx).get(url, ctx.runtime.count)

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        urls = self.urls if self.urls is not None else list(self.inputs[0].iterate(ctx))
        while urls and skip and self.sizes.get(urls[0], -1) in range(0, skip + 1):
            skip -= self.sizes[urls[0]]  # a whole shard skipped without fetching it
            urls = urls[1:]
        pool = ThreadPoolExecutor(max(1, self.prefetch_shards),
                                  thread_name_prefix="replicator-shard-fetch")
        ahead: dict[int, Future[str]] = {}
        try:
            for i, url in enumerate(urls):
                for j in range(i, min(len(urls), i + 1 + self.prefetch_shards)):
                    if j not in ahead:
                        ahead[j] = pool.submit(self._fetch, ctx, urls[j])
                for sample in self._read(ctx, url, ahead.pop(i)):
                    if skip:
                        skip -= 1
                        continue
                    yield sample
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for j, left in ahead.items():  # fetched ahead, never read: let other processes in
                if not _is_local(urls[j]):
                    left.add_done_callback(self._release_unread(ctx))

    def _release_unread(self, ctx: Ctx) -> Callable[[Future[str]], None]:
        def release(fetched: Future[str]) -> None:
            if not fetched.cancelled() and fetched.exception() is None:
                self._cache(ctx).release(fetched.result())
        return release

    def _read(self, ctx: Ctx, url: str, fetched: Future[str]) -> Iterator[dict[str, Any]]:
        count = 0
        path = None
        try:
            path = fetched.result()
            for sample in read_shard(path, url):
                count += 1
                yield sample
        except ShardError as exc:
            if self.on_error != "skip":
                raise
            ctx.runtime.count("skipped_shards")
            ctx.runtime.warn_once("shard", f"skipped the rest of a shard after {count} "
                                           f"samples: {exc}")
            return
        finally:
            if path is not None and not _is_local(url):
                self._cache(ctx).release(path)
        self.sizes[url] = count
