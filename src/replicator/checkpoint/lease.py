"""The lease on a store, ``LEASE.json`` (job id, host, pid, heartbeat every ``timeout / 4`` s):
one job writes to a location at a time; a stale lease, or one of the same job or of a dead
process of this host (a restart), is taken over.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Protocol

from replicator.cluster.processes import process_alive
from replicator.errors import StoreLeaseError


class LeaseStore(Protocol):
    """What a lease needs of its store (``store.FsspecStorage``)."""

    url: str

    def get(self, name: str) -> bytes: ...
    def put(self, name: str, data: bytes) -> None: ...
    def remove(self, name: str, recursive: bool = False) -> None: ...


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
    """Stop every heartbeat and delete the lease (of a script that never closed its backups)."""
    for lease in list(_HELD):
        lease.release()


atexit.register(_release_at_exit)


class Lease:
    """Hold ``LEASE.json`` in ``store`` for ``job_id`` (call :meth:`acquire` on one process)."""

    def __init__(self, store: LeaseStore, job_id: str | None = None,
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

    def _write(self) -> None:
        record = {"job_id": self.job_id, "host": self.host, "pid": self.pid,
                  "heartbeat": time.time(), "timeout": self.timeout}
        self.store.put(LEASE_NAME, json.dumps(record).encode())

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
        self._write()
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
        self._write()

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
