"""Replica groups on loopback for tests and benchmarks: ``replicator run --replica-groups N``
written small, so tests can kill, restart and stop single groups: :func:`start_lighthouse` on a
free 127.0.0.1 port, :func:`start_group` forked from the launcher's warm forkserver."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from weakref import WeakSet

from replicator.cluster.env_names import (
    LIGHTHOUSE_ENV,
    MIN_REPLICAS_ENV,
    REPLICA_GROUP_ENV,
    REPLICA_GROUPS_ENV,
)
from replicator.errors import LighthouseError
from replicator.launch.launcher import WorkerProcess
from replicator.launch.lighthouse import LighthouseSettings, lighthouse_command, wait_reachable
from replicator.launch.script_launch import script_starter


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_file(path: Path, timeout: float, what: str, alive: Group | None = None) -> str:
    """Wait until ``path`` exists and return its text; ``TimeoutError`` naming ``what`` (also
    when the group ``alive`` exits before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text()):
            return text
        if alive is not None and all(c is not None for c in alive.poll()):
            raise TimeoutError(f"{what}: replica group {alive.group} exited first "
                               f"({alive.poll()})")
        time.sleep(0.02)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s ({path})")


@dataclass
class Lighthouse:
    """A running ``torchft_lighthouse`` (stop it with :meth:`stop`)."""

    process: subprocess.Popen
    port: int

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_lighthouse(min_replicas: int = 1, *, join_timeout_ms: int = 1000,
                     heartbeat_timeout_ms: int = 2000, quorum_tick_ms: int = 50,
                     log: Path | None = None) -> Lighthouse:
    """Start a lighthouse on a free loopback port and wait until it answers."""
    port = free_port()
    settings = LighthouseSettings(min_replicas, join_timeout_ms / 1000,
                                  heartbeat_timeout_ms / 1000, quorum_tick_ms / 1000)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(lighthouse_command() + settings.argv(f"127.0.0.1:{port}"),
                               stdout=out, stderr=subprocess.STDOUT)
    lighthouse = Lighthouse(process, port)
    try:
        wait_reachable(lighthouse.address, 60, "torchft_lighthouse")
    except LighthouseError:
        process.kill()
        raise
    return lighthouse


@dataclass(eq=False)  # identity: groups are kept in a weak set
class Group:
    """The processes of one replica group."""

    group: int
    processes: list[WorkerProcess] = field(default_factory=list)

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.processes]

    def wait(self, timeout: float) -> list[int]:
        """Wait for every process; ``TimeoutError`` naming the group when one is still up."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.1, deadline - time.monotonic()))
        codes = self.poll()
        if any(c is None for c in codes):
            raise TimeoutError(f"replica group {self.group} did not finish within {timeout:.0f} s")
        return [int(c) for c in codes if c is not None]

    def signal(self, sig: int) -> None:
        for p in self.processes:
            p.signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        for p in self.processes:
            p.join(30)


#: Every group started here and not yet ended: killed at exit, as a test that failed before
#: its ``kill()`` would otherwise leave them to multiprocessing's exit, which waits for them.
_STARTED: WeakSet[Group] = WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_STARTED):
        group.kill()


def group_env(group: int, groups: int, lighthouse: str, min_replicas: int, rank: int,
              nproc: int, master_port: int | None) -> dict[str, str]:
    """The environment of rank ``rank`` of replica group ``group`` (see the module doc)."""
    env = {REPLICA_GROUP_ENV: str(group), REPLICA_GROUPS_ENV: str(groups),
           LIGHTHOUSE_ENV: lighthouse, MIN_REPLICAS_ENV: str(min_replicas),
           "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1"}
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    return env


def start_group(script: str | Path, group: int, groups: int, lighthouse: str, *,
                min_replicas: int = 1, nproc: int = 1, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None, log_dir: Path | None = None,
                start_method: str = "forkserver") -> Group:
    """Start replica group ``group`` of ``nproc`` processes running ``script`` (forked from the
    warm forkserver; ``start_method="spawn"``: fresh interpreters); each rank's output goes to
    ``log_dir/group<g>_rank<r>.log``, or nowhere without ``log_dir``."""
    master_port = free_port() if nproc > 1 else None
    starter = script_starter(str(script), list(args), start_method)
    out = Group(group)
    for rank in range(nproc):
        full = {**os.environ, **(env or {}),
                **group_env(group, groups, lighthouse, min_replicas, rank, nproc, master_port)}
        full.setdefault("OMP_NUM_THREADS", "1")
        if log_dir is None:
            proc = starter.start(rank, full, quiet=True)
        else:
            log = os.open(Path(log_dir) / f"group{group}_rank{rank}.log",
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                proc = starter.start(rank, full, output=log)
            finally:
                os.close(log)
        out.processes.append(WorkerProcess(rank, proc))
    _STARTED.add(out)
    return out


__all__ = ["Lighthouse", "Group", "start_lighthouse", "start_group", "group_env", "free_port",
           "wait_for_file"]
