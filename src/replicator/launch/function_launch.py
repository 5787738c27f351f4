"""``rp.launch(fn, num_replicas=N)``: a Python function in N local worker processes, forked
from the warm forkserver; results come back through ``torch.save`` files in a private directory.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from replicator.cluster.ports import check_port
from replicator.launch.forked_start import (
    START_METHODS,
    StandardStreams,
    become_worker,
    check_start_method,
    forkserver_context,
)
from replicator.launch.launcher import LocalGroup, check_num_replicas


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
