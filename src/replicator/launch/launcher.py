"""The local launcher: N worker processes on this machine, the embedded default.

The launcher hosts the rendezvous store itself (on loopback, on a port the OS picks), so no
port can be taken between choosing it and using it. When a worker fails, the others get a short
grace to stop on their own, are then terminated, and the first failure is reported once, with
its rank and traceback. ``max_restarts`` restarts the whole group after a failure.

Preemption: a worker that exits with :data:`PREEMPTION_EXIT_CODE` (75) saved a backup after
SIGTERM, and the others are doing the same, so they get a longer grace to finish saving. A
preempted group is restarted like a failed one while restarts remain (the restart counts).
When the launcher itself receives SIGTERM, it forwards it to every worker, waits for their
backups, and raises :class:`~replicator.errors.PreemptedError` (exit code 75) without restarting.

Failures that a restart would only repeat (see :mod:`replicator.launch.restart_policy`) are
not restarted. ``replicator run`` relays each worker's output with a ``[rank R]`` prefix
(:mod:`replicator.launch.output`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from replicator.cluster.env_names import (
    ERROR_DIR_ENV,
    LAUNCHER_ENV,
    NUM_ACTORS_ENV,
    NUM_PS_ENV,
    PREEMPTION_GRACE_ENV,
    REJOIN_ENV,
    REJOIN_KEY,
    RESTART_COUNT_ENV,
    STORE_HOSTED_ENV,
    TIMEOUT_ENV,
)
from replicator.cluster.exit_codes import PREEMPTION_EXIT_CODE
from replicator.cluster.ports import LOOPBACK, check_port, listen
from replicator.cluster.stack_dump import STACK_DUMP_SIGNAL, read_stacks
from replicator.cluster.timeouts import resolve_timeout
from replicator.cluster.worker_errors import (
    error_path,
    read_backup,
    read_error,
)
from replicator.errors import ClusterConfigError, PreemptedError, WorkerFailedError
from replicator.launch.actors import actor_env, check_num_actors
from replicator.launch.failure_report import (
    RankEnd,
    describe_codes,
    describe_exit,
    failure_for,
    resume_hint,
    root_of,
)
from replicator.launch.output import OutputRelay
from replicator.launch.restart_policy import restart_refusal

#: Seconds the other workers get to stop by themselves after one fails, before SIGTERM.
FAILURE_GRACE_SECONDS = 5.0
#: Seconds between SIGTERM and SIGKILL.
KILL_GRACE_SECONDS = 3.0
#: Seconds a running worker gets to write its stacks when a launch is stopped from outside.
STACK_DUMP_SECONDS = 2.0
#: Seconds preempted workers get to save their backup and exit (override with the variable).
PREEMPTION_GRACE_SECONDS = 120.0


def check_num_ps(num_ps: Any, world: int) -> int:
    """Validate ``--num-ps`` / ``num_ps=``: at least one process must be left as a worker."""
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise ClusterConfigError(f"num_ps must be an integer >= 0, got {num_ps!r}")
    if num_ps >= world:
        raise ClusterConfigError(
            f"--num-ps {num_ps} leaves no worker among {world} process(es). HINT: --nproc counts "
            f"servers and workers together; use --nproc {num_ps + 1} or more.")
    return num_ps


def _preemption_grace() -> float:
    try:
        return float(os.environ.get(PREEMPTION_GRACE_ENV, PREEMPTION_GRACE_SECONDS))
    except ValueError:
        return PREEMPTION_GRACE_SECONDS


def check_num_replicas(n: Any, flag: str = "num_replicas") -> int:
    """Validate a number of workers: a positive integer, else a clear error."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ClusterConfigError(f"{flag} must be a positive integer, got {n!r}. "
                                 "HINT: use 1 for a single replica.")
    return n


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


def worker_env(rank: int, world: int, port: int, timeout_seconds: float | None,
               attempt: int, error_dir: str, base: dict[str, str] | None = None,
               master_addr: str = LOOPBACK) -> dict[str, str]:
    """The environment of one local worker: torchrun's variable names plus replicator's own.

    ``master_addr``: where the launcher's store listens (loopback, unless replica groups on
    other machines must reach it).
    """
    env = dict(os.environ if base is None else base)
    threads = max(1, (os.cpu_count() or 1) // world)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port), LAUNCHER_ENV: "local", STORE_HOSTED_ENV: "1",
        RESTART_COUNT_ENV: str(attempt), ERROR_DIR_ENV: error_dir,
    })
    env.setdefault("OMP_NUM_THREADS", str(threads))
    lo = _loopback_interface()
    if lo and master_addr == LOOPBACK:
        env.setdefault("GLOO_SOCKET_IFNAME", lo)  # a local job never listens on the network
    if timeout_seconds is not None:
        env[TIMEOUT_ENV] = str(timeout_seconds)
    return env


class _Worker:
    """One child process, started either from a function (multiprocessing) or a command."""

    def __init__(self, rank: int, proc: Any) -> None:
        self.rank = rank
        self.proc = proc
        self.detected_at: float | None = None

    def poll(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def signal(self, sig: int) -> None:
        pid = getattr(self.proc, "pid", None)
        if not isinstance(pid, int) or pid <= 0:
            return  # never a process group or every process (kill(0, ...), kill(-1, ...))
        try:
            if self.poll() is None:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def join(self, timeout: float) -> None:
        if isinstance(self.proc, subprocess.Popen):
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.proc.join(timeout)


@dataclass
class _Outcome:
    ok: bool
    failure: WorkerFailedError | None = None
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    #: The failing rank's exception class and its bases (from its error file), if any.
    error_types: tuple[str, ...] = ()


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def oversubscription_warning(nproc: int, cores: int) -> str | None:
    """The warning for more workers than cores (``None`` when they fit)."""
    if nproc <= cores:
        return None
    return (f"[replicator] warning: --nproc {nproc} is more than the {cores} CPU core(s) of this "
            f"machine: each worker gets one thread and the {nproc} workers take turns on the "
            f"cores, so training is slower than with --nproc {cores}. HINT: use --nproc {cores} "
            "or fewer unless you are testing the distributed code itself.")


class LocalGroup:
    """Start, watch and (re)start a group of local workers around one hosted store.

    ``name`` (``"replica group 2"``) marks a group that runs beside others: its messages name
    it, a restart restarts it alone, and its output is drained apart from the others'.
    ``restart_preempted=False`` ends the group instead of restarting it when its workers were
    preempted (they left on purpose). ``store_addr`` is where the store listens.
    """

    def __init__(self, world: int, start: Callable[[int, dict[str, str]], Any], *,
                 master_port: int | None = None, timeout_seconds: float | None = None,
                 max_restarts: int = 0, env: dict[str, str] | None = None,
                 output: OutputRelay | None = None, num_ps: int = 0,
                 name: str | None = None, restart_preempted: bool = True,
                 store_addr: str = LOOPBACK, num_actors: int = 0) -> None:
        import torch.distributed as dist

        self.world = check_num_replicas(world, "the number of workers")
        master_port = check_port(master_port)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
                or max_restarts < 0:
            raise ClusterConfigError(f"max_restarts must be an integer >= 0, got "
                                     f"{max_restarts!r}. HINT: 0 turns restarts off.")
        self.output = output
        self.name = name
        self.restart_preempted = restart_preempted
        self.store_addr = store_addr
        #: With parameter servers, a worker other than the chief that is killed by a signal is
        #: lost, not a failure: the servers and the other workers go on without it.
        self.num_ps = check_num_ps(num_ps, self.world)
        #: Actor processes after the workers (``--num-actors``), launcher ids world..world+A-1.
        self.num_actors = check_num_actors(num_actors, self.num_ps)
        self.lost: set[int] = set()
        self.worker_restarts = 0
        self.rank_restarts: dict[int, int] = {}
        self.start_fn = start
        self.timeout_seconds = timeout_seconds
        self.max_restarts = max_restarts
        self.base_env = env
        self.error_dir = tempfile.mkdtemp(prefix="replicator-errors-")
        sock = listen(store_addr, master_port or 0)
        self.port = sock.getsockname()[1]
        self.store = dist.TCPStore(store_addr, self.port, world, True,
                                   timeout=timedelta(seconds=resolve_timeout(timeout_seconds)),
                                   wait_for_workers=False, master_listen_fd=sock.detach())
        self.workers: list[_Worker] = []
        self.attempt = 0
        self.signalled = False

    def run(self) -> None:
        """Run to completion, restarting up to ``max_restarts`` times; raise on final failure."""
        previous = self._install_sigterm()
        try:
            self._run_attempts()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _install_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None

        def forward(signum: int, frame: Any) -> None:
            self.signalled = True
            self.say("[replicator] received SIGTERM: asking every worker to save a backup and "
                     "stop")
            for w in self.workers:
                w.signal(signal.SIGTERM)

        return signal.signal(signal.SIGTERM, forward)

    def say(self, line: str) -> None:
        """Print a launcher message on stderr, between whole lines of the workers."""
        if self.output is not None:
            self.output.emit(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _run_attempts(self) -> None:
        for attempt in range(self.max_restarts + 1):
            self.attempt = attempt
            outcome = self._run_once(attempt)
            if outcome.ok:
                self._check_servers_ran(attempt)
                return
            if outcome.failure is None:
                raise RuntimeError("internal error: a failed attempt without its failure")
            if self.signalled:
                raise PreemptedError(
                    "the job received SIGTERM: the workers were asked to save a backup and stop "
                    f"({describe_codes(outcome.exitcodes)}).\n"
                    f"{self._resume_hint(outcome.exitcodes)}", rank=outcome.failure.rank,
                    exit_code=PREEMPTION_EXIT_CODE) from outcome.failure
            if isinstance(outcome.failure, PreemptedError) and not self.restart_preempted:
                raise outcome.failure
            if attempt < self.max_restarts - self.worker_restarts:
                who = f"{self.name}: " if self.name else ""
                refusal = restart_refusal(outcome.error_types)
                if refusal is not None:
                    self.say(f"[replicator] {who}{refusal}; {self.max_restarts - attempt} "
                             "restart(s) left unused")
                    raise outcome.failure
                what = f"{self.name} alone" if self.name else "all workers"
                self.say(f"[replicator] {who}{str(outcome.failure).splitlines()[0]}; restarting "
                         f"{what} (restart {attempt + 1} of {self.max_restarts})")
                continue
            raise outcome.failure

    def _check_servers_ran(self, attempt: int) -> None:
        """With ``--num-ps``: say so when a server rank never started a parameter server (the
        script built another strategy, so that rank ran it as one more replica)."""
        if not self.num_ps:
            return
        from replicator.ps.protocol import SERVER_ADDRESS_KEY

        prefix = f"replicator/attempt_{attempt}/"
        first = self.world - self.num_ps
        idle = [first + k for k in range(self.num_ps)
                if not self.store.check([prefix + SERVER_ADDRESS_KEY.format(index=k)])]
        if not idle:
            return
        ranks = ", ".join(map(str, idle))
        self.say(f"[replicator] warning: --num-ps {self.num_ps} was given, but rank(s) {ranks} "
                 "never started a parameter server: the script did not build "
                 f"rp.ParameterServerStrategy, so all {self.world} processes ran it as workers "
                 "of its own strategy (the servers' ranks included). HINT: drop --num-ps for "
                 "this script, or build rp.ParameterServerStrategy() in it.")

    def _resume_hint(self, codes: dict[int, int | None]) -> str:
        """What a rerun does: resume from a committed backup, or start over without one."""
        return resume_hint(read_backup(self.error_dir, range(self.world)), codes)

    def _run_once(self, attempt: int) -> _Outcome:
        self.workers = []
        self.lost = set()
        self.rank_restarts = {}
        try:
            for rank in range(self.world):
                env = worker_env(rank, self.world, self.port, self.timeout_seconds, attempt,
                                 self.error_dir, self.base_env, self.store_addr)
                if self.num_ps:
                    env[NUM_PS_ENV] = str(self.num_ps)
                if self.num_actors:
                    env[NUM_ACTORS_ENV] = str(self.num_actors)
                    if "OMP_NUM_THREADS" not in (self.base_env or os.environ):  # cores shared
                        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // (  # with actors
                            self.world + self.num_actors)))
                self.workers.append(_Worker(rank, self.start_fn(rank, env)))
            for k in range(self.num_actors):
                self.workers.append(self._start_actor(k, attempt, 0))
            if self.signalled:  # SIGTERM came while these workers were starting
                for w in self.workers:
                    w.signal(signal.SIGTERM)
            outcome = self._watch(attempt)
        except BaseException:  # stopped from outside (a timeout, an interrupt)
            self._dump_running_stacks()
            self.stop_all()
            raise
        finally:
            if self.output is not None:  # the workers' last lines come before any summary
                self.output.drain(group=self.name)
        return outcome

    def _watch(self, attempt: int) -> _Outcome:
        first_failed: _Worker | None = None
        while True:
            now = time.time()
            codes = {w.rank: w.poll() for w in self.workers}
            for w in self.workers:
                if codes[w.rank] is not None and w.detected_at is None:
                    w.detected_at = now
            if self._note_lost_workers(codes):
                continue  # a worker was restarted alone: look again
            if all(c == 0 for r, c in codes.items() if r not in self.lost and r < self.world):
                self._stop_actors()  # the learners are done: their actors follow
                return _Outcome(ok=True, exitcodes=codes)
            failed = [w for w in self.workers
                      if codes[w.rank] not in (None, 0) and w.rank not in self.lost]
            if failed:
                first_failed = min(failed, key=lambda w: w.detected_at or now)
                break
            time.sleep(0.02)
        saving = self.signalled or first_failed.poll() == PREEMPTION_EXIT_CODE
        deadline = time.time() + (_preemption_grace() if saving else FAILURE_GRACE_SECONDS)
        while time.time() < deadline and any(w.poll() is None for w in self.workers):
            time.sleep(0.02)
            for w in self.workers:  # when each end was seen orders the causes
                if w.detected_at is None and w.poll() is not None:
                    w.detected_at = time.time()
        terminated = [w.rank for w in self.workers if w.poll() is None]
        self.stop_all()
        failure, types = self._failure(attempt, first_failed, terminated)
        return _Outcome(ok=False, failure=failure, error_types=types,
                        exitcodes={w.rank: w.poll() for w in self.workers})

    def _note_lost_workers(self, codes: dict[int, int | None]) -> bool:
        """With parameter servers: a non-chief worker killed by a signal is restarted alone
        while restarts remain, else lost (once). True when a worker was restarted."""
        restarted = self._note_lost_actors(codes)
        if not self.num_ps:
            return restarted
        for rank in range(1, self.world - self.num_ps):
            code = codes.get(rank)
            if code is not None and code < 0 and rank not in self.lost:
                left = self.max_restarts - self.attempt - self.worker_restarts
                if left > 0:
                    self._restart_worker(rank, code)
                    restarted = True
                    continue
                self.lost.add(rank)
                self.say(f"[replicator] worker rank {rank} was lost ({describe_exit(code)}); "
                         "the parameter servers and the other workers go on without it")
        return restarted

    def _start_actor(self, index: int, attempt: int, restarts: int) -> _Worker:
        env = worker_env(0, self.world, self.port, self.timeout_seconds, attempt,
                         self.error_dir, self.base_env, self.store_addr)
        env = actor_env(env, index, self.world, self.num_actors,
                        f"{self.store_addr}:{self.port}", restarts)
        return _Worker(self.world + index, self.start_fn(self.world + index, env))

    def _note_lost_actors(self, codes: dict[int, int | None]) -> bool:
        """An actor that ended before its learners is restarted alone while restarts remain;
        one killed with none left is lost (a failing one fails the job). True on a restart."""
        restarted = False
        for index in range(self.num_actors):
            rank = self.world + index
            code = codes.get(rank)
            if code is None or code == 0 or rank in self.lost:
                continue
            if self.max_restarts - self.attempt - self.worker_restarts > 0:
                self.worker_restarts += 1
                self.rank_restarts[rank] = self.rank_restarts.get(rank, 0) + 1
                self.say(f"[replicator] actor {index} ended ({describe_exit(code)}); restarting "
                         f"it alone to rejoin the learners (restart "
                         f"{self.worker_restarts + self.attempt} of {self.max_restarts})")
                self.workers[rank] = self._start_actor(index, self.attempt,
                                                       self.rank_restarts[rank])
                restarted = True
            elif code < 0:
                self.lost.add(rank)
                self.say(f"[replicator] actor {index} was lost ({describe_exit(code)}); the "
                         "learners go on without it")
        return restarted

    def _stop_actors(self) -> None:
        """Give the actors a grace to leave after their learners ended, then stop them."""
        actors = [w for w in self.workers if w.rank >= self.world]
        deadline = time.time() + FAILURE_GRACE_SECONDS
        while time.time() < deadline and any(w.poll() is None for w in actors):
            time.sleep(0.02)
        for w in actors:
            w.signal(signal.SIGTERM)
            w.join(KILL_GRACE_SECONDS)
            w.signal(signal.SIGKILL)

    def _restart_worker(self, rank: int, code: int) -> None:
        """Start worker ``rank`` again alone; it rejoins the running parameter servers."""
        self.worker_restarts += 1
        used = self.worker_restarts + self.attempt
        self.say(f"[replicator] worker rank {rank} was lost ({describe_exit(code)}); restarting "
                 f"it alone to rejoin the parameter servers (restart {used} of "
                 f"{self.max_restarts})")
        self.rank_restarts[rank] = self.rank_restarts.get(rank, 0) + 1
        self.store.set(f"replicator/attempt_{self.attempt}/" + REJOIN_KEY.format(rank=rank),
                       str(self.rank_restarts[rank]))
        env = worker_env(rank, self.world, self.port, self.timeout_seconds, self.attempt,
                         self.error_dir, self.base_env, self.store_addr)
        env[NUM_PS_ENV] = str(self.num_ps)
        env[REJOIN_ENV] = "1"
        self.workers[rank] = _Worker(rank, self.start_fn(rank, env))

    def _failure(self, attempt: int, first: _Worker, terminated: list[int]
                 ) -> tuple[WorkerFailedError, tuple[str, ...]]:
        """The attempt's failure, its root cause first (see ``failure_report``)."""
        codes = {w.rank: w.poll() for w in self.workers}
        ends = [RankEnd(w.rank, codes[w.rank], w.detected_at,
                        read_error(error_path(self.error_dir, w.rank, attempt)),
                        w.rank in terminated) for w in self.workers]
        root = root_of(ends, first.rank)
        if root.code == PREEMPTION_EXIT_CODE:
            return PreemptedError(
                "the workers were preempted (SIGTERM reached a rank): they agreed on a step, "
                f"saved a backup and stopped with exit code {PREEMPTION_EXIT_CODE} "
                f"({describe_codes(codes)}).\n{self._resume_hint(codes)}", rank=root.rank,
                exit_code=PREEMPTION_EXIT_CODE), ()
        return failure_for(ends, first.rank, self._role,
                           read_backup(self.error_dir, range(self.world)))

    def _role(self, rank: int) -> str:
        """``"parameter server K"`` for the last ``num_ps`` ranks, ``"actor K"`` for actors,
        else ``""``."""
        if rank >= self.world:
            return f"actor {rank - self.world}"
        first_server = self.world - self.num_ps
        return f"parameter server {rank - first_server}" if rank >= first_server else ""

    def _dump_running_stacks(self) -> None:
        """Workers still running when the launch closes (it was stopped from outside: a
        timeout, an interrupt) print their threads' stacks before they are stopped."""
        running = [w for w in self.workers if w.poll() is None]
        if not running:
            return
        names = ", ".join(f"rank {w.rank}" + (f" ({self._role(w.rank)})"
                                               if self._role(w.rank) else "")
                          for w in running)
        for w in running:
            w.signal(STACK_DUMP_SIGNAL)
        self.say(f"[replicator] the launch stopped while {names} still ran; what each was "
                 "doing:")
        for w in running:
            stacks = read_stacks(self.error_dir, w.rank, STACK_DUMP_SECONDS)
            self.say(f"[replicator] rank {w.rank}'s threads:\n"
                     f"{stacks or '(none written: the worker did not answer)'}")

    def stop_all(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGTERM)
        deadline = time.time() + KILL_GRACE_SECONDS
        for w in self.workers:
            w.join(max(0.0, deadline - time.time()))
        for w in self.workers:
            w.signal(signal.SIGKILL)
            w.join(1.0)

    def close(self) -> None:
        self._dump_running_stacks()
        self.stop_all()
        import shutil

        shutil.rmtree(self.error_dir, ignore_errors=True)
