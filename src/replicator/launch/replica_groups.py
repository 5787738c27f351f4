"""Replica groups for live recovery on torchft: ``replicator run --replica-groups N --nproc K``.

N :class:`~replicator.launch.launcher.LocalGroup` s around one lighthouse, each on its own
thread, store and restarts: a group that dies restarts alone and heals from a live peer; one out
of restarts is lost while the others go on. Exit 0 when ``--min-replicas`` groups completed.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replicator.cluster.cpu_scheduling import usable_cores
from replicator.cluster.env_names import (
    LIGHTHOUSE_ENV,
    LIVE_BIND_ENV,
    MIN_REPLICAS_ENV,
    REPLICA_GROUP_ENV,
    REPLICA_GROUPS_ENV,
)
from replicator.cluster.ports import (
    LOOPBACK,
    choose_gloo_interface,
    is_loopback,
    local_address_towards,
)
from replicator.errors import (
    ClusterConfigError,
    LighthouseError,
    PreemptedError,
    ReplicaGroupFailedError,
    WorkerFailedError,
)
from replicator.launch.forked_start import check_start_method
from replicator.launch.launcher import (
    LocalGroup,
    check_count,
    check_num_replicas,
    check_script,
    forward_sigterm,
)
from replicator.launch.lighthouse import (
    Lighthouse,
    LighthouseSettings,
    foreign_replicas,
    parse_address,
    require_torchft,
    seen_group_ids,
    url_of,
    wait_reachable,
)
from replicator.launch.output import OutputRelay
from replicator.launch.script_launch import script_starter

#: Seconds to wait for a lighthouse given with ``--lighthouse``/``--join`` to answer.
REACH_TIMEOUT_SECONDS = 30.0


@dataclass
class ReplicaGroupsConfig:
    """A checked ``--replica-groups`` command line (see :func:`run_replica_groups`)."""

    groups: int
    nproc: int
    min_replicas: int = 1
    #: An existing lighthouse (``--lighthouse`` / ``--join``) as ``(host, port)``.
    lighthouse: tuple[str, int] | None = None
    #: Where a lighthouse of this launcher listens (``--lighthouse-bind``).
    bind: tuple[str, int] = (LOOPBACK, 0)
    #: Derive unused group ids from the lighthouse (``--join``).
    join: bool = False
    first_id: int | None = None
    max_restarts: int = 0
    timeout_seconds: float | None = None
    quiet_workers: bool = False
    settings: LighthouseSettings = field(default_factory=LighthouseSettings)
    #: How each worker starts: ``"forkserver"`` or ``"spawn"`` (see ``launch.script_launch``).
    start_method: str = "forkserver"


def check_config(*, groups: Any, nproc: Any, min_replicas: Any = 1,
                 lighthouse: str | None = None, lighthouse_bind: str | None = None,
                 join: str | None = None, group_id: Any = None, max_restarts: Any = 0,
                 timeout_seconds: float | None = None, quiet_workers: bool = False,
                 settings: LighthouseSettings | None = None,
                 start_method: str = "forkserver") -> ReplicaGroupsConfig:
    """Validate the replica-group flags together; clear errors with the fix."""
    require_torchft()
    if groups is None and join is not None:
        groups = 1
    groups = check_num_replicas(groups, "--replica-groups")
    nproc = check_num_replicas(nproc, "--nproc")
    min_replicas = check_num_replicas(min_replicas, "--min-replicas")
    check_count(max_restarts, "--max-restarts", hint="with --replica-groups it counts per group.")
    if group_id is not None:
        check_count(group_id, "--replica-group-id")
    if join is not None and lighthouse is not None:
        raise ClusterConfigError("--join and --lighthouse both name a running lighthouse. "
                                 "HINT: --join HOST:PORT adds groups with unused ids; "
                                 "--lighthouse HOST:PORT starts groups 0..N-1 (or from "
                                 "--replica-group-id). Give one.")
    existing = join if join is not None else lighthouse
    if existing is not None and lighthouse_bind is not None:
        raise ClusterConfigError("--lighthouse-bind says where a lighthouse started by this "
                                 "command listens; with --lighthouse/--join none is started. "
                                 "HINT: leave out --lighthouse-bind.")
    if existing is None and min_replicas > groups:
        raise ClusterConfigError(
            f"--min-replicas {min_replicas} is more than --replica-groups {groups}: no step "
            f"could ever commit. HINT: use --min-replicas {groups} or less (1 lets the job go "
            "on with any one group alive).")
    cfg = ReplicaGroupsConfig(
        groups=groups, nproc=nproc, min_replicas=min_replicas, join=join is not None,
        first_id=group_id, max_restarts=max_restarts, timeout_seconds=timeout_seconds,
        quiet_workers=quiet_workers, settings=settings or LighthouseSettings(),
        start_method=check_start_method(start_method))
    cfg.settings.min_replicas = min_replicas
    if existing is not None:
        cfg.lighthouse = parse_address(existing, "--join" if join is not None else
                                       "--lighthouse")
    elif lighthouse_bind is not None:
        cfg.bind = parse_address(lighthouse_bind, "--lighthouse-bind", default_port=0)
    return cfg


class ReplicaGroups:
    """N :class:`LocalGroup` s side by side around one lighthouse; see the module doc."""

    def __init__(self, script: str, script_args: Sequence[str], cfg: ReplicaGroupsConfig,
                 lighthouse_url: str, address: str, ids: list[int],
                 output: OutputRelay, lighthouse: Lighthouse | None = None) -> None:
        self.cfg = cfg
        self.url = lighthouse_url
        self.address = address
        self.ids = ids
        self.output = output
        self.say = output.emit
        self.lighthouse = lighthouse
        self.starter = script_starter(script, script_args, cfg.start_method)
        self.signalled = False
        self.groups: dict[int, LocalGroup] = {}
        #: Each group's thread, and the error of a group whose run raised.
        self.threads: dict[int, threading.Thread] = {}
        self.errors: dict[int, BaseException] = {}

    def base_env(self, group: int) -> dict[str, str]:
        """The environment every process of ``group`` starts from."""
        env = {**os.environ, REPLICA_GROUP_ENV: str(group),
               REPLICA_GROUPS_ENV: str(self.cfg.groups), LIGHTHOUSE_ENV: self.url,
               MIN_REPLICAS_ENV: str(self.cfg.min_replicas), LIVE_BIND_ENV: self.address,
               "TORCHFT_LIGHTHOUSE": self.url}
        total = self.cfg.groups * self.cfg.nproc
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // total)))
        env.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
        if not is_loopback(self.address) and self.cfg.lighthouse is not None:
            choose_gloo_interface(self.cfg.lighthouse[0], env)
        return env

    def _starter(self, group: int) -> Any:
        name = f"replica group {group}"

        def start(rank: int, env: dict[str, str]) -> Any:
            if self.cfg.quiet_workers and rank != 0:
                return self.starter.start(rank, env, quiet=True)
            return self.starter.start(rank, env, relay=self.output,
                                      label=f"group {group} rank {rank}", group=name)

        return start

    def run(self) -> None:
        """Run every group to its end; raise for a group that failed after its restarts."""
        for g in self.ids:
            self.groups[g] = LocalGroup(
                self.cfg.nproc, self._starter(g), timeout_seconds=self.cfg.timeout_seconds,
                max_restarts=self.cfg.max_restarts, env=self.base_env(g), output=self.output,
                name=f"replica group {g}", restart_preempted=False, store_addr=self.address)
        with forward_sigterm(self._on_sigterm):
            try:
                for g in self.groups:
                    self.threads[g] = threading.Thread(target=self._run_group, args=(g,),
                                                       name=f"replicator-group-{g}", daemon=True)
                    self.threads[g].start()
                self._watch()
            except BaseException:
                self._stop_everything()
                raise
        self._conclude()

    def _run_group(self, g: int) -> None:
        try:
            self.groups[g].run()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self.errors[g] = exc

    def _on_sigterm(self) -> None:
        self.signalled = True
        self.say("[replicator] received SIGTERM: asking every replica group to leave at a step "
                 "boundary")
        for group in self.groups.values():
            group.terminate()

    def _watch(self) -> None:
        reported: set[int] = set()
        while True:
            for g, thread in self.threads.items():
                if not thread.is_alive() and g not in reported:
                    reported.add(g)
                    self._report_end(g)
            if not any(thread.is_alive() for thread in self.threads.values()):
                return
            if self.lighthouse is not None and not self.lighthouse.alive():
                code = self.lighthouse.proc.poll() if self.lighthouse.proc else None
                self.say(f"[replicator] the lighthouse exited (exit code {code}); stopping "
                         "every replica group")
                self._stop_everything()
                raise LighthouseError(
                    f"the lighthouse at {self.url} exited while the job ran (exit code "
                    f"{code}); no quorum can form without it, so every replica group was "
                    f"stopped. Its last lines:\n{self.lighthouse.tail()}")
            time.sleep(0.05)

    def _report_end(self, g: int) -> None:
        """One line when a group ends while others still run."""
        error = self.errors.get(g)
        if self.signalled or not any(t.is_alive() for o, t in self.threads.items() if o != g):
            return
        if isinstance(error, PreemptedError):
            self.say(f"[replicator] replica group {g} left the job (its processes received "
                     "SIGTERM); the other groups go on without it")
        elif isinstance(error, WorkerFailedError):
            self.say(f"[replicator] replica group {g} failed after {self.groups[g].attempt} "
                     f"restart(s) (--max-restarts {self.cfg.max_restarts} per group): "
                     f"{str(error).splitlines()[0]}; the other groups go on without it")

    def _stop_everything(self) -> None:
        """Stop every group for good (no restarts), then wait for their threads."""
        for group in self.groups.values():
            group.signalled = True  # a group that sees its workers end does not restart
            group.stop_all()
        for thread in self.threads.values():
            thread.join(30.0)

    def _conclude(self) -> None:
        errors = {g: self.errors[g] for g in self.threads if g in self.errors}
        for error in errors.values():
            if not isinstance(error, WorkerFailedError):
                raise error
        if self.signalled:
            if errors:
                raise self._preempted(errors)
            return
        failed = {g: e for g, e in errors.items() if not isinstance(e, PreemptedError)}
        if not failed:
            return
        first = min(failed, key=lambda g: (self.groups[g].attempt, g))
        error = failed[first]
        assert isinstance(error, WorkerFailedError)  # filtered above
        lost = ReplicaGroupFailedError(first, error, self.groups[first].attempt,
                                       self.cfg.max_restarts)
        finished = sorted(g for g in self.threads if g not in self.errors)
        if len(finished) >= self.cfg.min_replicas:  # the job finished: exit 0
            hint = ("" if self.cfg.max_restarts else " HINT: --max-restarts N restarts a lost "
                    "group alone, and it heals from a live peer.")
            self.say(f"[replicator] the training finished on replica group(s) "
                     f"{', '.join(map(str, finished))} (--min-replicas {self.cfg.min_replicas} "
                     f"held); replica group(s) {', '.join(map(str, sorted(failed)))} were lost: "
                     f"{str(lost).splitlines()[0]}.{hint}")
            return
        if len(failed) > 1:
            self.say("[replicator] replica groups " + ", ".join(map(str, sorted(failed))) +
                     " failed after their restarts")
        raise lost

    def _preempted(self, errors: dict[int, BaseException]) -> PreemptedError:
        """The launcher's error after SIGTERM: which groups left, which failed meanwhile."""
        left = sorted(g for g, e in errors.items() if isinstance(e, PreemptedError))
        failed = sorted(g for g in errors if g not in left)
        parts = [f"replica group(s) {', '.join(map(str, left))} left at a step boundary "
                 "(exit code 75)"] if left else []
        parts += [f"replica group {g} failed meanwhile: {str(errors[g]).splitlines()[0]}"
                  for g in failed]
        hint = str(errors[left[0]]).splitlines()[1:] if left else []
        message = "the job received SIGTERM: " + "; ".join(parts)
        first = errors[(left or failed)[0]]
        return PreemptedError("\n".join([message, *hint]), rank=getattr(first, "rank", 0))

    def close(self) -> None:
        for group in self.groups.values():
            group.close()


def _group_ids(cfg: ReplicaGroupsConfig, page: str | None) -> list[int]:
    """The ids of this command's groups: ``--replica-group-id`` on, past the lighthouse's
    (``--join``), else 0..N-1."""
    if cfg.first_id is not None:
        return list(range(cfg.first_id, cfg.first_id + cfg.groups))
    if cfg.join and page is not None:
        seen = seen_group_ids(page)
        if not seen and foreign_replicas(page):
            raise ClusterConfigError(
                "the lighthouse lists replica groups that replicator did not start, so the "
                "ids in use are unknown. HINT: give this command's first group id with "
                "--replica-group-id G.")
        start = max(seen) + 1 if seen else 0
        return list(range(start, start + cfg.groups))
    return list(range(cfg.groups))


def _advertised_address(cfg: ReplicaGroupsConfig) -> str:
    """The address other groups reach these groups on (see ``LIVE_BIND_ENV``)."""
    host = cfg.lighthouse[0] if cfg.lighthouse is not None else cfg.bind[0]
    if is_loopback(host):
        return LOOPBACK
    if cfg.lighthouse is not None:
        try:
            return local_address_towards(host)
        except OSError as exc:
            raise ClusterConfigError(
                f"no route from this machine to the lighthouse host {host!r} ({exc}). HINT: "
                "give an address of the lighthouse's machine that this machine can reach."
            ) from None
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return LOOPBACK
    return host


def run_replica_groups(script: str, script_args: Sequence[str] = (), *,
                       cfg: ReplicaGroupsConfig, output: OutputRelay | None = None) -> None:
    """Run ``script`` in ``cfg.groups`` replica groups of ``cfg.nproc`` processes (see the
    module doc)."""
    check_script(script)
    relay = output or OutputRelay()
    lighthouse: Lighthouse | None = None
    page: str | None = None
    if cfg.lighthouse is not None:
        url = url_of(*cfg.lighthouse)
        page = wait_reachable(url, REACH_TIMEOUT_SECONDS, "--join" if cfg.join else
                              "--lighthouse")
    else:
        lighthouse = Lighthouse(cfg.bind[0], cfg.bind[1], cfg.settings)
        url = lighthouse.start()
    runner: ReplicaGroups | None = None
    try:
        ids = _group_ids(cfg, page)
        address = _advertised_address(cfg)
        where = "loopback only" if is_loopback(address) else f"reachable at {address}"
        relay.emit(f"[replicator] {'using the' if lighthouse is None else 'started a'} torchft "
                   f"lighthouse at {url} ({where}); replica groups "
                   f"{', '.join(map(str, ids))} of {cfg.nproc} process(es) each, "
                   f"--min-replicas {cfg.min_replicas}")
        total, cores = cfg.groups * cfg.nproc, usable_cores()
        if total > cores:
            relay.emit(f"[replicator] warning: {cfg.groups} replica groups x --nproc "
                       f"{cfg.nproc} = {total} workers on {cores} CPU core(s): each worker "
                       "gets one thread and they take turns on the cores, so every step waits "
                       "for the slowest. HINT: fine for trying recovery out; for speed keep "
                       "groups x --nproc within the cores of each machine.")
        runner = ReplicaGroups(str(script), script_args, cfg, url, address, ids, relay,
                               lighthouse)
        runner.run()
    finally:
        if runner is not None:
            runner.close()
        if lighthouse is not None:
            lighthouse.stop()
        relay.drain()


__all__ = ["ReplicaGroups", "ReplicaGroupsConfig", "check_config", "run_replica_groups"]
