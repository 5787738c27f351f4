"""Shared-memory segments mapped by every rank of a group, unlinked once all mapped them (or any
failed); and :class:`FlagBarrier`, which spins on per-rank counters in one (x86 only)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import platform
import secrets
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from replicator.cluster.env_names import SHM_DIR_ENV
from replicator.cluster.processes import process_alive
from replicator.comm.collective_tracker import group_tag
from replicator.comm.groups import (
    finished_peer_error,
    group_rank,
    group_ranks,
    group_size,
    unregistered,
)
from replicator.errors import ClusterConfigError, ReplicaTimeoutError, ReplicatorError

#: Where segments are created unless ``REPLICATOR_SHM_DIR`` says otherwise.
DEFAULT_SHM_DIR = "/dev/shm"


def shm_dir() -> str:
    """``REPLICATOR_SHM_DIR`` (a missing path turns shared memory off), else ``/dev/shm``; read
    at each call (forked workers)."""
    return os.environ.get(SHM_DIR_ENV, "") or DEFAULT_SHM_DIR


#: The room ``/dev/shm`` must have per local replica for ``"auto"`` to use it: the 4 MB transfer
#: slots and the buckets of a small model (docs/collectives.md).
MIN_SHM_BYTES_PER_REPLICA = 16 << 20
NAME_PREFIX = "replicator-shm-"
ALIGN = 64
_PAYLOAD = 256
_LINE = 8  # int64 per cache line: one flag line per rank
#: Waiting for other ranks: flag checks while spinning, seconds of yielding, sleep bounds.
SPIN_CHECKS = 40
YIELD_SECONDS = 200e-6
MIN_PAUSE_SECONDS = 20e-6
MAX_PAUSE_SECONDS = 1e-3


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def flag_barrier_is_safe() -> bool:
    """True on CPUs whose stores become visible in program order (x86, total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def shared_memory_problem(local_replicas: int = 0) -> str:
    """Why this process cannot use a same-host shared-memory all-reduce ('' when it can); with
    ``local_replicas``, also whether the flag barrier works and ``/dev/shm`` has room for them."""
    shm = shm_dir()
    if os.name != "posix" or not hasattr(os, "posix_fallocate"):
        return f"shared-memory segments need a POSIX system ({os.name})"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        return f"{shm} does not exist or is not writable"
    if not local_replicas:
        return ""
    if not flag_barrier_is_safe():
        return (f"the shared-memory barrier needs an x86 CPU (total store order); this one "
                f"is {platform.machine() or 'unknown'}")
    try:
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
    except OSError as exc:
        return f"cannot read the free space of {shm} ({exc})"
    need = MIN_SHM_BYTES_PER_REPLICA * local_replicas
    if free < need:
        return (f"{shm} has {free / 1e6:.0f} MB free, less than the {need / 1e6:.0f} MB "
                f"wanted for {local_replicas} replica(s) (docker: --shm-size)")
    return ""


def host_id() -> int:
    """A 63-bit number identifying this host and boot (equal for processes on one machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}|{boot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def all_on_this_host(group: dist.ProcessGroup | None, usable: bool = True) -> bool:
    """True on every rank (a collective) when all ranks of ``group`` run here and say ``usable``."""
    here = host_id()
    votes = torch.tensor([here, -here, int(usable)], dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    return int(votes[0]) == -int(votes[1]) and int(votes[2]) == 1


def check_same_host(group: dist.ProcessGroup | None, who: str) -> None:
    """Raise on every rank unless all ranks of ``group`` run on this host."""
    if not all_on_this_host(group):
        raise ClusterConfigError(
            f"{who} needs every replica on one host, but the replicas of this group run on "
            "several hosts. HINT: use rp.comm.HierarchicalAllReduce() or rp.comm.NativeAllReduce() "
            "across machines.")


class SharedSegment:
    """A mapping of one shared-memory segment; :meth:`create` is a collective over a group."""

    def __init__(self, mm: mmap.mmap, name: str) -> None:
        self.mm = mm
        self.nbytes = len(mm)
        self.name = name
        self.base = torch.frombuffer(mm, dtype=torch.uint8, count=self.nbytes)

    @classmethod
    def create(cls, nbytes: int, group: dist.ProcessGroup | None, who: str) -> SharedSegment:
        """Create (first rank), map (every rank) and unlink a segment of ``nbytes``."""
        nbytes = max(ALIGN, align(nbytes, mmap.PAGESIZE))
        first = group_rank(group) == 0
        payload = torch.zeros(_PAYLOAD, dtype=torch.uint8)
        segment: SharedSegment | None = None
        try:
            if first:
                try:
                    segment = cls.create_named(nbytes, group_tag(group_ranks(group)))
                    message, ok = segment.name, 1
                except Exception as exc:  # noqa: BLE001 - every rank must hear about it
                    message, ok = f"{type(exc).__name__}: {exc}", 0
                raw = message.encode()[:_PAYLOAD - 2]
                payload[0], payload[1] = ok, len(raw)
                payload[2:2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            dist.broadcast(payload, group_src=0, group=group)
            ok, length = int(payload[0]), int(payload[1])
            message = bytes(payload[2:2 + length].tolist()).decode(errors="replace")
            if not ok:
                raise ReplicatorError(
                    f"{who}: rank {group_ranks(group)[0]} could not create a {nbytes / 1e6:.1f} "
                    f"MB shared-memory segment in {shm_dir()} ({message}). HINT: {shm_dir()} may "
                    "be full or small (docker: --shm-size); or use rp.comm.NativeAllReduce().")
            error = ""
            if not first:
                try:
                    segment = cls(_map(message, nbytes, create=False), message)
                except Exception as exc:  # noqa: BLE001 - every rank must hear about it
                    error = f"{type(exc).__name__}: {exc}"
            status = torch.tensor([0 if error else 1], dtype=torch.int64)
            dist.all_reduce(status, op=dist.ReduceOp.MIN, group=group)
            if error or int(status) == 0 or segment is None:
                raise ReplicatorError(
                    f"{who}: a rank could not map the shared-memory segment {message!r}"
                    f"{' (' + error + ')' if error else ''}. HINT: every replica of the group "
                    "must run on this host with access to /dev/shm.")
        finally:
            if first and segment is not None:
                unlink_segment(segment.name)
        return segment

    @classmethod
    def create_named(cls, nbytes: int, tag: str) -> SharedSegment:
        """Create and map a segment for one peer to open by name; unlinked once the peer answers."""
        name = f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
        return cls(_map(name, nbytes, create=True), name)

    @classmethod
    def open_named(cls, name: str, nbytes: int) -> SharedSegment:
        """Map and unlink the segment a peer made with :meth:`create_named`; refuses other names."""
        if not name.startswith(NAME_PREFIX) or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a replicator shared-memory segment name")
        try:
            return cls(_map(name, nbytes, create=False), name)
        finally:
            unlink_segment(name)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` (a multiple of the element size)."""
        return self.base[offset:offset + numel * dtype.itemsize].view(dtype)


def unlink_segment(name: str) -> None:
    """Remove a segment's name from :func:`shm_dir` (mappings stay valid); idempotent."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(shm_dir(), name))


def _map(name: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map segment ``name`` of :func:`shm_dir`, ``nbytes`` page-rounded (``create``: a new one)."""
    nbytes = max(ALIGN, align(nbytes, mmap.PAGESIZE))
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(os.path.join(shm_dir(), name), flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)  # fails now (ENOSPC) instead of SIGBUS later
        return mmap.mmap(fd, nbytes)
    except BaseException:
        if create:  # a half-made segment leaves no name behind
            unlink_segment(name)
        raise
    finally:
        os.close(fd)


class FlagBarrier:
    """Per-rank cache-line counters in shared memory: ``arrive(c)`` bumps this rank's ``c``,
    ``wait_for(n, c)`` waits for all."""

    #: The counters: inputs announced, and sums finished.
    INPUTS, SUMS = 2, 0
    #: Fingerprints (:meth:`post` / :meth:`collect`): posted and read counters, and the value.
    POSTED, READ, VALUE = 3, 4, 5
    #: Seconds between checks that the ranks we wait for still exist.
    LIVENESS_EVERY = 0.5

    def __init__(self, segment: SharedSegment, offset: int, group: dist.ProcessGroup | None,
                 timeout_seconds: float, who: str) -> None:
        self.world = group_size(group)
        self.rank = group_rank(group)
        self.ranks = group_ranks(group)
        self.group = group
        self.timeout_seconds = timeout_seconds
        self.who = who
        self._lines = np.frombuffer(segment.mm, dtype=np.int64, count=self.world * _LINE,
                                    offset=offset)
        counters = (self.INPUTS, self.SUMS, self.POSTED, self.READ)
        self._counts = {c: int(self._lines[self.rank * _LINE + c]) for c in counters}
        self._views = {c: self._lines[c::_LINE] for c in counters}
        self._pids = self._lines[1::_LINE]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        self._spin = flag_barrier_is_safe() and cores >= self.world
        self._use_flags = flag_barrier_is_safe()
        self._pids[self.rank] = os.getpid()

    @staticmethod
    def nbytes(world: int) -> int:
        return world * _LINE * 8

    def arrive(self, counter: int = SUMS) -> int:
        """Bump this rank's ``counter``; return its new value."""
        self._counts[counter] += 1
        if self._use_flags:
            self._views[counter][self.rank] = self._counts[counter]
        return self._counts[counter]

    def post(self, value: int) -> int:
        """Publish ``value`` as this rank's fingerprint; return its number."""
        if not self._use_flags:
            raise ReplicatorError(f"{self.who}: fingerprints in shared memory need a CPU with "
                                  "ordered stores (x86)")
        number = self._counts[self.POSTED] + 1
        self.wait_for(number - 1, "fingerprint read", self.READ)
        self._lines[self.rank * _LINE + self.VALUE] = value
        self.arrive(self.POSTED)  # stores are seen in order: the value before the counter
        return number

    def collect(self, number: int) -> list[int]:
        """Every rank's fingerprint number ``number``, in group-rank order (waits for it)."""
        self.wait_for(number, "fingerprints posted", self.POSTED)
        values = [int(v) for v in self._lines[self.VALUE::_LINE]]
        self._counts[self.READ] = number
        self._views[self.READ][self.rank] = number
        return values

    def ready(self, value: int, counter: int = SUMS) -> bool:
        """True when every rank's ``counter`` reached ``value`` (never blocks; no flags: False)."""
        return self._use_flags and bool(self._views[counter].min() >= value)

    def wait_for(self, value: int, what: str, counter: int = SUMS) -> None:
        """Block until every rank's ``counter`` reached ``value``."""
        if not self._use_flags:
            dist.barrier(group=self.group)
            return
        flags = self._views[counter]
        if flags.min() >= value:
            return
        # Spin a few microseconds (peers in step arrive that fast), then yield the core for a
        # while, then sleep with a growing pause: a waiting rank must not take the CPU that
        # the rank it waits for needs (the host may run more processes than it has cores).
        for _ in range(SPIN_CHECKS if self._spin else 0):
            if flags.min() >= value:
                return
        start = time.monotonic()
        next_check = start + self.LIVENESS_EVERY
        pause = MIN_PAUSE_SECONDS
        while flags.min() < value:
            now = time.monotonic()
            if now - start < YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_SECONDS)
            if now >= next_check:
                next_check = now + self.LIVENESS_EVERY
                self._check_alive(flags, value, what)
                if now - start > self.timeout_seconds:
                    missing = [str(self.ranks[i]) for i in range(self.world) if flags[i] < value]
                    raise ReplicaTimeoutError(
                        f"{self.who} ({what}) on rank {self.ranks[self.rank]} waited "
                        f"{self.timeout_seconds:g} s for rank(s) {', '.join(missing)}. "
                        "HINT: those ranks may be on another code path or stuck; every rank "
                        "must make the same collective calls in the same order.")

    def _check_alive(self, flags: np.ndarray, value: int, what: str) -> None:
        for i in range(self.world):
            pid = int(self._pids[i])
            if flags[i] >= value or pid <= 0:
                continue
            if not process_alive(pid):
                # the launcher's exit records name global ranks, which an unregistered
                # group's positions are not
                finished = None if unregistered(self.group) else finished_peer_error(
                    f"{self.who} ({what})", self.ranks[self.rank], [self.ranks[i]])
                if finished is not None:
                    raise finished
                raise ReplicatorError(
                    f"{self.who} ({what}) on rank {self.ranks[self.rank]}: rank {self.ranks[i]} "
                    f"(pid {pid}) exited while the others waited for it. HINT: look for that "
                    "rank's own error; the launcher reports the first failure.")

