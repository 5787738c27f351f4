"""``rp.launch(fn, num_replicas=N)``: run a Python function in N local worker processes.

Each worker runs ``fn(*args, **kwargs)`` with the same environment ``replicator run`` gives a
script; the return values come back in rank order. Return values travel through files in a
private temporary directory written by the workers themselves (pickled by ``torch.save``), so
they may hold tensors; nothing is read from the network.

By default (``start_method="forkserver"``, as ``replicator run``) each worker forks from a
server process that has already imported torch and replicator: a launch of two workers then
takes about 0.4 s instead of the 3-25 s two fresh interpreters take to import torch (quiet to
busy 2-core machine); ``"spawn"`` starts fresh interpreters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from replicator.cluster.env_names import ERROR_DIR_ENV, RESTART_COUNT_ENV
from replicator.cluster.ports import check_port
from replicator.cluster.stack_dump import install_stack_dump
from replicator.cluster.worker_errors import error_path, record_exception, record_finished
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
    rank = int(env["RANK"])
    attempt = int(env.get(RESTART_COUNT_ENV, "0"))
    code = 0
    install_stack_dump(env[ERROR_DIR_ENV], rank)  # asked for when the launch is stopped
    try:
        import torch

        from replicator.cluster.process_group import configure_threads
        from replicator.launch.malloc_tuning import tune_malloc

        tune_malloc()  # a step's large buffers stay in the heap (malloc_tuning)
        configure_threads(int(env["LOCAL_WORLD_SIZE"]))
        result = fn(*args, **kwargs)
        torch.save(result, result_file)
        record_finished(rank)  # before leaving the group: a peer still waiting can say so
    except SystemExit as exc:
        if exc.code in (None, 0):
            record_finished(rank)
        else:
            record_exception(exc, rank, error_path(env[ERROR_DIR_ENV], rank, attempt))
            code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        record_exception(exc, rank, error_path(env[ERROR_DIR_ENV], rank, attempt))
        code = 1
    finally:
        from replicator.cluster.process_group import shutdown

        try:
            shutdown()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(fn: Callable[..., Any], num_replicas: int = 2, args: Sequence[Any] = (),
           kwargs: dict[str, Any] | None = None, *, timeout_seconds: float | None = None,
           max_restarts: int = 0, start_method: str = "forkserver",
           master_port: int | None = None, num_ps: int = 0, num_actors: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_replicas`` local workers; return every result.

    ``fn`` must be importable by the workers (a module-level function) under the default
    ``start_method="forkserver"`` (workers start in a fraction of a second: they fork from a
    server that has imported torch and replicator once, as ``replicator run``'s do) and
    under ``"spawn"`` (a fresh interpreter each); ``"fork"`` also takes functions defined in
    a notebook.
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
