"""``replicator run``: a script on N local workers (:func:`run_script`).

By default each worker is forked from a forkserver that imported torch and replicator once
(:mod:`replicator.launch.forked_start`): a launch, and every restart, then starts its workers in
a fraction of a second instead of the 3-25 s that fresh interpreters take to import torch
(quiet to busy 2-core machine). ``start_method="spawn"`` (``--start-method spawn``) starts a
fresh ``python`` per worker instead, for a script that needs one (interpreter flags, another
``sys.path`` than the launcher's).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicator.cluster.ports import check_port
from replicator.errors import ClusterConfigError
from replicator.launch.actors import check_num_actors
from replicator.launch.launcher import (
    LocalGroup,
    available_cores,
    check_num_ps,
    check_num_replicas,
    oversubscription_warning,
)
from replicator.launch.output import OutputRelay, terminal_env
from replicator.launch.script_workers import script_starter


def run_script(script: str, script_args: Sequence[str] = (), nproc: int = 2, *,
               master_port: int | None = None, timeout_seconds: float | None = None,
               max_restarts: int = 0, quiet_workers: bool = False, num_ps: int = 0,
               num_actors: int = 0, start_method: str = "forkserver") -> None:
    """Run ``python script.py args`` in ``nproc`` local workers (``replicator run``).

    With several workers, their output is relayed line by line with a ``[rank R]`` prefix;
    ``quiet_workers`` shows only the chief's (rank 0) output (failures are still reported).
    ``num_ps``: the last ``num_ps`` processes are parameter servers. ``num_actors``: actor
    processes started beside the ``nproc`` learners (see :mod:`replicator.launch.actors`).
    ``start_method``: ``"forkserver"`` (workers forked from a process that imported torch
    once) or ``"spawn"`` (a fresh interpreter per worker); see the module docstring.
    """
    nproc = check_num_replicas(nproc, "--nproc")
    check_num_ps(num_ps, nproc)
    master_port = check_port(master_port)
    path = Path(script)
    if not path.is_file():
        raise ClusterConfigError(f"script {script!r} not found (looked in {Path.cwd()}). "
                                 "HINT: give the path of a Python file.")
    check_num_actors(num_actors, num_ps)
    starter = script_starter(str(path), script_args, start_method)
    relay = OutputRelay() if nproc + num_actors > 1 else None

    def start(rank: int, env: dict[str, str]) -> Any:
        if relay is None or (quiet_workers and rank != 0):
            return starter.start(rank, env, quiet=relay is not None)
        env.update(terminal_env(rank, nproc + num_actors))
        return starter.start(rank, env, relay=relay)

    group = LocalGroup(nproc, start, master_port=master_port, timeout_seconds=timeout_seconds,
                       max_restarts=max_restarts, output=relay, num_ps=num_ps,
                       num_actors=num_actors)
    warning = oversubscription_warning(nproc, available_cores())
    if warning:
        group.say(warning)
    try:
        group.run()
    finally:
        group.close()
