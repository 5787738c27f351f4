"""The local launcher: N worker processes (and actors) on this machine around one hosted store
(on a port the OS picks, so none is taken in between). A failure stops the others after a grace
and is reported once; preempted workers (exit 75) get a longer grace to save their backup."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from replicator.cluster.cpu_scheduling import usable_cores
from replicator.cluster.env_names import (
    ACTOR_INDEX_ENV,
    ERROR_DIR_ENV,
    LAUNCHER_ENV,
    NUM_ACTORS_ENV,
    NUM_LEARNERS_ENV,
    NUM_PS_ENV,
    PREEMPTION_EXIT_CODE,
    PREEMPTION_GRACE_ENV,
    REJOIN_ENV,
    REJOIN_KEY,
    RESTART_COUNT_ENV,
    RL_STORE_ENV,
    STORE_HOSTED_ENV,
    TIMEOUT_ENV,
)
from replicator.cluster.ports import LOOPBACK, check_port, listen
from replicator.cluster.timeouts import resolve_timeout
from replicator.cluster.worker_errors import (
    STACK_DUMP_SIGNAL,
    error_path,
    read_backup,
    read_error,
    read_stacks,
)
from replicator.errors import ClusterConfigError, PreemptedError, WorkerFailedError
from replicator.launch.failure_report import (
    RankEnd,
    describe_codes,
    describe_exit,
    failure_for,
    restart_refusal,
    resume_hint,
    root_of,
)
from replicator.launch.output import OutputRelay

#: Seconds the other workers get to stop by themselves after one fails, before SIGTERM.
FAILURE_GRACE_SECONDS = 5.0
#: Seconds between SIGTERM and SIGKILL.
KILL_GRACE_SECONDS = 3.0
#: Seconds a running worker gets to write its stacks when a launch is stopped from outside.
STACK_DUMP_SECONDS = 2.0
#: Seconds preempted workers get to save their backup and exit (override with the variable).
PREEMPTION_GRACE_SECONDS = 120.0
#: The learners' rendezvous variables an actor must not see (it would join their group).
_LEARNER_ONLY = ("WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_count(value: Any, flag: str, minimum: int = 0, hint: str = "") -> int:
    """``value`` if it is an integer of at least ``minimum``, else an error with ``hint``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ClusterConfigError(f"{flag} must be {what}, got {value!r}"
                                 + (f". HINT: {hint}" if hint else ""))
    return value


def check_num_replicas(n: Any, flag: str = "num_replicas") -> int:
    """Validate a number of workers: a positive integer, else a clear error."""
    return check_count(n, flag, 1, "use 1 for a single replica.")


def check_script(script: str, error: type[Exception] = ClusterConfigError) -> str:
    """``script`` if it names a file, else ``error`` saying where it was looked for."""
    if not Path(script).is_file():
        raise error(f"script {script!r} not found (looked in {Path.cwd()}). HINT: give the path "
                    "of a Python file.")
    return str(script)


def check_num_ps(num_ps: Any, world: int) -> int:
    """Validate ``--num-ps`` / ``num_ps=``: at least one process must be left as a worker."""
    if check_count(num_ps, "num_ps") >= world:
        raise ClusterConfigError(
            f"--num-ps {num_ps} leaves no worker among {world} process(es). HINT: --nproc counts "
            f"servers and workers together; use --nproc {num_ps + 1} or more.")
    return num_ps


def _preemption_grace() -> float:
    try:
        return float(os.environ.get(PREEMPTION_GRACE_ENV, PREEMPTION_GRACE_SECONDS))
    except ValueError:
        return PREEMPTION_GRACE_SECONDS


def check_num_actors(num_actors: Any, num_ps: int = 0) -> int:
    """Validate ``--num-actors`` / ``num_actors=``: an integer >= 0, not beside servers."""
    check_count(num_actors, "num_actors", hint="--num-actors 2 starts two actor processes.")
    if num_actors and num_ps:
        raise ClusterConfigError("--num-actors and --num-ps cannot be combined: actors feed "
                                 "a synchronous learner, not parameter servers. HINT: drop "
                                 "one of them.")
    return num_actors


def actor_env(learner_env: dict[str, str], index: int, world: int, num_actors: int,
              store: str, restarts: int) -> dict[str, str]:
    """Actor ``index``'s environment, id ``world + index``: no rank among the learners (a gloo
    group cannot lose or regain a member), whom it finds through the launcher's store."""
    env = {k: v for k, v in learner_env.items() if k not in _LEARNER_ONLY}
    env.update({"RANK": str(world + index), "LOCAL_WORLD_SIZE": str(world + num_actors),
                ACTOR_INDEX_ENV: str(index), NUM_ACTORS_ENV: str(num_actors),
                NUM_LEARNERS_ENV: str(world), RL_STORE_ENV: store,
                REJOIN_ENV: str(restarts), "OMP_NUM_THREADS": "1"})
    return env


class WorkerProcess:
    """One child process, started either from a function (multiprocessing) or a command."""

    def __init__(self, rank: int, proc: Any) -> None:
        self.rank = rank
        self.proc = proc
        self.detected_at: float | None = None

    @property
    def pid(self) -> int | None:
        return getattr(self.proc, "pid", None)

    def poll(self) -> int | None:
        return self.proc.poll() if isinstance(self.proc, subprocess.Popen) else self.proc.exitcode

    def signal(self, sig: int) -> None:
        pid = self.pid
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
    failure: WorkerFailedError | None = None  # None: every learner finished
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    #: The failing rank's exception class and its bases (from its error file), if any.
    error_types: tuple[str, ...] = ()


def oversubscription_warning(nproc: int, cores: int) -> str | None:
    """The warning for more workers than cores (``None`` when they fit)."""
    if nproc <= cores:
        return None
    return (f"[replicator] warning: --nproc {nproc} is more than the {cores} CPU core(s) of this "
            f"machine: each worker gets one thread and the {nproc} workers take turns on the "
            f"cores, so training is slower than with --nproc {cores}. HINT: use --nproc {cores} "
            "or fewer unless you are testing the distributed code itself.")


@contextlib.contextmanager
def forward_sigterm(handler: Callable[[], None]) -> Iterator[None]:
    """Run ``handler`` on SIGTERM inside the block (main thread only), then put back the
    previous handler."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handler()) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class LocalGroup:
    """Start, watch and (re)start a group of local workers around one hosted store; ``name``
    marks a group beside others (restarted alone), ``restart_preempted=False`` ends it instead."""

    def __init__(self, world: int, start: Callable[[int, dict[str, str]], Any], *,
                 master_port: int | None = None, timeout_seconds: float | None = None,
                 max_restarts: int = 0, env: dict[str, str] | None = None,
                 output: OutputRelay | None = None, num_ps: int = 0,
                 name: str | None = None, restart_preempted: bool = True,
                 store_addr: str = LOOPBACK, num_actors: int = 0) -> None:
        import torch.distributed as dist

        self.world = check_num_replicas(world, "the number of workers")
        master_port = check_port(master_port)
        check_count(max_restarts, "max_restarts", hint="0 turns restarts off.")
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
        self.workers: list[WorkerProcess] = []
        self.attempt = 0
        self.signalled = False

    def run(self) -> None:
        """Run to completion, restarting up to ``max_restarts`` times; raise on final failure."""
        with forward_sigterm(self._on_sigterm):
            for attempt in range(self.max_restarts + 1):
                self.attempt = attempt
                outcome = self._run_once(attempt)
                if outcome.failure is None:
                    self._check_servers_ran(attempt)
                    return
                self._restart_or_raise(outcome.failure, outcome)

    def _on_sigterm(self) -> None:
        self.say("[replicator] received SIGTERM: asking every worker to save a backup and stop")
        self.terminate()

    def terminate(self) -> None:
        """Ask every worker to save a backup and stop; the group restarts no more."""
        self.signalled = True
        for w in list(self.workers):
            w.signal(signal.SIGTERM)

    def say(self, line: str) -> None:
        """Print a launcher message on stderr, between whole lines of the workers."""
        if self.output is not None:
            self.output.emit(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _restart_or_raise(self, failure: WorkerFailedError, outcome: _Outcome) -> None:
        """Say that the failed attempt is restarted, else raise the job's error."""
        attempt = self.attempt
        if self.signalled:
            raise PreemptedError(
                "the job received SIGTERM: the workers were asked to save a backup and stop "
                f"({describe_codes(outcome.exitcodes)}).\n"
                f"{self._resume_hint(outcome.exitcodes)}", rank=failure.rank,
                exit_code=PREEMPTION_EXIT_CODE) from failure
        if isinstance(failure, PreemptedError) and not self.restart_preempted:
            raise failure
        if attempt >= self.max_restarts - self.worker_restarts:
            raise failure
        who = f"{self.name}: " if self.name else ""
        refusal = restart_refusal(outcome.error_types)
        if refusal is not None:
            self.say(f"[replicator] {who}{refusal}; {self.max_restarts - attempt} "
                     "restart(s) left unused")
            raise failure
        what = f"{self.name} alone" if self.name else "all workers"
        self.say(f"[replicator] {who}{str(failure).splitlines()[0]}; restarting "
                 f"{what} (restart {attempt + 1} of {self.max_restarts})")

    def _check_servers_ran(self, attempt: int) -> None:
        """With ``--num-ps``: warn when a server rank never started a parameter server."""
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
        return resume_hint(read_backup(self.error_dir, range(self.world)), codes)

    def _run_once(self, attempt: int) -> _Outcome:
        self.workers = []
        self.lost = set()
        self.rank_restarts = {}
        try:
            for rank in range(self.world + self.num_actors):  # one by one: stop_all sees them
                self.workers.append(self._start_actor(rank - self.world, 0) if rank >= self.world
                                    else WorkerProcess(rank, self.start_fn(rank, self._env(rank))))
            if self.signalled:  # SIGTERM came while these workers were starting
                self.terminate()
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
        first_failed: WorkerProcess | None = None
        while True:
            now = time.time()
            codes = {w.rank: w.poll() for w in self.workers}
            for w in self.workers:
                if codes[w.rank] is not None and w.detected_at is None:
                    w.detected_at = now
            if self._note_lost_workers(codes):
                continue  # a worker was restarted alone: look again
            if all(c == 0 for r, c in codes.items() if r not in self.lost and r < self.world):
                actors = self.workers[self.world:]  # the learners are done: a grace, then stop
                self._await_ends(actors, FAILURE_GRACE_SECONDS)
                self.stop_all(actors)
                return _Outcome(exitcodes=codes)
            failed = [w for w in self.workers
                      if codes[w.rank] not in (None, 0) and w.rank not in self.lost]
            if failed:
                first_failed = min(failed, key=lambda w: w.detected_at or now)
                break
            time.sleep(0.02)
        saving = self.signalled or first_failed.poll() == PREEMPTION_EXIT_CODE
        self._await_ends(self.workers, _preemption_grace() if saving else FAILURE_GRACE_SECONDS)
        terminated = [w.rank for w in self.workers if w.poll() is None]
        self.stop_all()
        failure, types = self._failure(attempt, first_failed, terminated)
        return _Outcome(failure=failure, error_types=types,
                        exitcodes={w.rank: w.poll() for w in self.workers})

    def _note_lost_workers(self, codes: dict[int, int | None]) -> bool:
        """A killed non-chief worker (with servers) or an actor that ended restarts alone while
        restarts remain, else a killed one is lost; True on a restart."""
        restarted = False
        ranks = [*range(1, self.world - self.num_ps if self.num_ps else 1),
                 *range(self.world, self.world + self.num_actors)]
        for rank in ranks:
            code, actor = codes.get(rank), rank >= self.world
            if code is None or code == 0 or rank in self.lost or (code > 0 and not actor):
                continue
            name = f"actor {rank - self.world}" if actor else f"worker rank {rank}"
            peers = "learners" if actor else "parameter servers"
            if self.max_restarts - self.attempt - self.worker_restarts > 0:
                self.worker_restarts += 1
                self.rank_restarts[rank] = self.rank_restarts.get(rank, 0) + 1
                self.say(f"[replicator] {name} {'ended' if actor else 'was lost'} "
                         f"({describe_exit(code)}); restarting it alone to rejoin the {peers} "
                         f"(restart {self.worker_restarts + self.attempt} of {self.max_restarts})")
                self.workers[rank] = (self._start_actor(rank - self.world, self.rank_restarts[rank])
                                      if actor else self._rejoin(rank))
                restarted = True
            elif code < 0:
                self.lost.add(rank)
                self.say(f"[replicator] {name} was lost ({describe_exit(code)}); the "
                         f"{'learners' if actor else 'parameter servers and the other workers'} "
                         "go on without it")
        return restarted

    def _env(self, rank: int) -> dict[str, str]:
        """Worker ``rank``'s environment: torchrun's variable names plus replicator's own."""
        env = dict(os.environ if self.base_env is None else self.base_env)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.world), "GROUP_RANK": "0",
            "MASTER_ADDR": self.store_addr, "MASTER_PORT": str(self.port),
            LAUNCHER_ENV: "local", STORE_HOSTED_ENV: "1", RESTART_COUNT_ENV: str(self.attempt),
            ERROR_DIR_ENV: self.error_dir,
        })
        share = (usable_cores() // (self.world + self.num_actors) if self.num_actors
                 else (os.cpu_count() or 1) // self.world)
        env.setdefault("OMP_NUM_THREADS", str(max(1, share)))  # cores shared with any actors
        if self.store_addr == LOOPBACK:  # a local job never listens on the network
            try:
                lo = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
            except OSError:
                lo = None
            if lo:
                env.setdefault("GLOO_SOCKET_IFNAME", lo)
        if self.timeout_seconds is not None:
            env[TIMEOUT_ENV] = str(self.timeout_seconds)
        if self.num_ps:
            env[NUM_PS_ENV] = str(self.num_ps)
        if self.num_actors:
            env[NUM_ACTORS_ENV] = str(self.num_actors)
        return env

    def _start_actor(self, index: int, restarts: int) -> WorkerProcess:
        env = actor_env(self._env(0), index, self.world, self.num_actors,
                        f"{self.store_addr}:{self.port}", restarts)
        return WorkerProcess(self.world + index, self.start_fn(self.world + index, env))

    def _rejoin(self, rank: int) -> WorkerProcess:
        """Worker ``rank`` started again alone, to rejoin the running parameter servers."""
        self.store.set(f"replicator/attempt_{self.attempt}/" + REJOIN_KEY.format(rank=rank),
                       str(self.rank_restarts[rank]))
        return WorkerProcess(rank, self.start_fn(rank, {**self._env(rank), REJOIN_ENV: "1"}))

    @staticmethod
    def _await_ends(workers: list[WorkerProcess], seconds: float) -> None:
        """Wait at most ``seconds`` for ``workers`` to end, noting when each end was seen
        (which orders the causes of a failure)."""
        deadline = time.time() + seconds
        while time.time() < deadline and any(w.poll() is None for w in workers):
            time.sleep(0.02)
            for w in workers:
                if w.detected_at is None and w.poll() is not None:
                    w.detected_at = time.time()

    def _failure(self, attempt: int, first: WorkerProcess, terminated: list[int]
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
        """``"parameter server K"``, ``"actor K"`` or ``""`` (a worker)."""
        if rank >= self.world:
            return f"actor {rank - self.world}"
        first_server = self.world - self.num_ps
        return f"parameter server {rank - first_server}" if rank >= first_server else ""

    def _dump_running_stacks(self) -> None:
        """Print the stacks of workers still running when the launch is stopped from outside."""
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

    def stop_all(self, workers: list[WorkerProcess] | None = None) -> None:
        """SIGTERM ``workers`` (default: all), then SIGKILL those left after a grace."""
        workers = self.workers if workers is None else workers
        for w in workers:
            w.signal(signal.SIGTERM)
        deadline = time.time() + KILL_GRACE_SECONDS
        for w in workers:
            w.join(max(0.0, deadline - time.time()))
        for w in workers:
            w.signal(signal.SIGKILL)
            w.join(1.0)

    def close(self) -> None:
        self._dump_running_stacks()
        self.stop_all()
        shutil.rmtree(self.error_dir, ignore_errors=True)
