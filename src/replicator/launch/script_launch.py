"""Local launches on N workers forked from the warm forkserver
(:mod:`~replicator.launch.forked_start`) or, with ``start_method="spawn"``, fresh interpreters:
``replicator run`` (a script) and ``rp.launch`` (a function, whose results come back through
``torch.save`` files in a private directory)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from replicator.cluster.cpu_scheduling import usable_cores
from replicator.cluster.ports import check_port
from replicator.launch.forked_start import (
    START_METHODS,
    StandardStreams,
    become_worker,
    check_start_method,
    forkserver_context,
)
from replicator.launch.launcher import (
    LocalGroup,
    check_num_actors,
    check_num_ps,
    check_num_replicas,
    check_script,
    oversubscription_warning,
)
from replicator.launch.output import OutputRelay, terminal_env


class _ScriptStarter:
    """Starts each worker forked from the forkserver or, ``fresh``, as a ``python -u``."""

    def __init__(self, script: str, args: Sequence[str], fresh: bool) -> None:
        self.script = script
        self.args = list(args)
        self.ctx: Any = None if fresh else forkserver_context()

    def start(self, rank: int, env: dict[str, str], *, relay: OutputRelay | None = None,
              quiet: bool = False, label: str | None = None, group: str | None = None,
              output: int | None = None) -> Any:
        pipes: list[tuple[int, int]] = []
        ends: list[int] = []  # this side's copies of the worker's ends, closed once it started
        if output is not None:
            fds = (output, output)
        elif quiet:
            ends = [os.open(os.devnull, os.O_WRONLY)]
            fds = (ends[0], ends[0])
        elif relay is not None:
            pipes = [os.pipe(), os.pipe()]
            ends = [w for _, w in pipes]
            fds = (ends[0], ends[1])
        else:
            fds = (1, 2)
        try:
            proc = self._start(rank, env, fds)
        finally:
            for fd in ends:
                os.close(fd)
        if relay is not None:
            for (r, _), stream in zip(pipes, ("stdout", "stderr")):
                relay.attach(rank, os.fdopen(r, "rb"), stream, label=label, group=group)
        return proc

    def _start(self, rank: int, env: dict[str, str], fds: tuple[int, int]) -> Any:
        if self.ctx is None:
            return subprocess.Popen([sys.executable, "-u", "-m", "replicator.launch.script_entry",
                                     self.script, *self.args], env=env, stdout=fds[0],
                                    stderr=fds[1])
        # imported here: ``python -m replicator.launch.script_entry`` (the fresh path) warns
        # when importing the package has already imported that module
        from replicator.launch.script_entry import forked_entry

        proc = self.ctx.Process(target=forked_entry, name=f"replicator-rank{rank}",
                                args=(self.script, self.args, env, os.getcwd(),
                                      StandardStreams(0, *fds)))
        proc.start()
        return proc


def script_starter(script: str, args: Sequence[str], start_method: str = "forkserver") -> Any:
    """What starts the workers of ``script args``: ``start(rank, env, relay=, quiet=, label=,
    group=, output=)`` returns the process (``quiet``: output dropped; ``output``: stdout and
    stderr to that file descriptor, which the caller keeps; neither nor ``relay``: the
    launcher's)."""
    return _ScriptStarter(script, args, check_start_method(start_method) != "forkserver")


def run_script(script: str, script_args: Sequence[str] = (), nproc: int = 2, *,
               master_port: int | None = None, timeout_seconds: float | None = None,
               max_restarts: int = 0, quiet_workers: bool = False, num_ps: int = 0,
               num_actors: int = 0, start_method: str = "forkserver") -> None:
    """Run ``python script.py args`` in ``nproc`` local workers (``replicator run``), their
    output relayed with a ``[rank R]`` prefix (``quiet_workers``: the chief's only); the last
    ``num_ps`` are parameter servers, ``num_actors`` actors start beside them."""
    nproc = check_num_replicas(nproc, "--nproc")
    check_num_ps(num_ps, nproc)
    master_port = check_port(master_port)
    check_num_actors(num_actors, num_ps)
    starter = script_starter(check_script(script), script_args, start_method)
    relay = OutputRelay() if nproc + num_actors > 1 else None

    def start(rank: int, env: dict[str, str]) -> Any:
        if relay is None or (quiet_workers and rank != 0):
            return starter.start(rank, env, quiet=relay is not None)
        env.update(terminal_env(rank, nproc + num_actors))
        return starter.start(rank, env, relay=relay)

    group = LocalGroup(nproc, start, master_port=master_port, timeout_seconds=timeout_seconds,
                       max_restarts=max_restarts, output=relay, num_ps=num_ps,
                       num_actors=num_actors)
    warning = oversubscription_warning(nproc, usable_cores())
    if warning:
        group.say(warning)
    try:
        group.run()
    finally:
        group.close()


def _function_entry(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                    env: dict[str, str], cwd: str, result_file: str,
                    streams: Any = None) -> None:
    become_worker(env, cwd, streams)
    from replicator.launch.script_entry import leave_as_interpreter, run_reported

    def body() -> None:
        import torch

        from replicator.cluster.process_group import configure_threads

        configure_threads(int(env["LOCAL_WORLD_SIZE"]))
        torch.save(fn(*args, **kwargs), result_file)

    leave_as_interpreter(lambda: run_reported(body))


def launch(fn: Callable[..., Any], num_replicas: int = 2, args: Sequence[Any] = (),
           kwargs: dict[str, Any] | None = None, *, timeout_seconds: float | None = None,
           max_restarts: int = 0, start_method: str = "forkserver",
           master_port: int | None = None, num_ps: int = 0, num_actors: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_replicas`` local workers; return every result.

    ``fn`` must be importable by the workers (a module-level function) under the default
    ``start_method="forkserver"`` (workers fork from a server that imported torch and
    replicator once, as ``replicator run``'s do) and under ``"spawn"`` (a fresh interpreter
    each); ``"fork"`` also takes functions defined in a notebook.
    A worker that raises makes this raise :class:`replicator.WorkerFailedError` with that
    worker's rank and traceback, after the other workers were stopped. A failure that a
    restart would repeat (a NaN loss, replicas that disagree, an import error) is not restarted.
    ``num_ps``: the last ``num_ps`` processes are parameter servers; their result, and that of
    a worker lost during the job, is ``None``. ``num_actors``: actor processes beside the
    ``num_replicas`` learners (``rp.rl``); their results are not returned.
    """
    check_num_replicas(num_replicas)
    check_port(master_port, "master_port")
    if not callable(fn):
        raise TypeError(f"launch() needs a callable, got {type(fn).__name__}")
    check_start_method(start_method, START_METHODS + ("fork",))
    ctx: Any = (forkserver_context() if start_method == "forkserver"
                else mp.get_context(start_method))
    results_dir = Path(tempfile.mkdtemp(prefix="replicator-results-"))
    kwargs = dict(kwargs or {})

    def start(rank: int, env: dict[str, str]) -> Any:
        result_file = results_dir / f"rank{rank}.pt"
        result_file.unlink(missing_ok=True)
        proc = ctx.Process(
            target=_function_entry, name=f"replicator-rank{rank}",
            args=(fn, tuple(args), kwargs, env, os.getcwd(), str(result_file),
                  StandardStreams() if start_method == "forkserver" else None))
        proc.start()
        return proc

    group = LocalGroup(num_replicas, start, master_port=master_port,
                       timeout_seconds=timeout_seconds, max_restarts=max_restarts,
                       num_ps=num_ps, num_actors=num_actors)
    try:
        group.run()
        import torch

        return [torch.load(results_dir / f"rank{r}.pt", weights_only=False)
                if (results_dir / f"rank{r}.pt").exists() or not (num_ps or group.lost) else None
                for r in range(num_replicas)]
    finally:
        group.close()
        shutil.rmtree(results_dir, ignore_errors=True)
