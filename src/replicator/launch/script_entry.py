"""``python -m replicator.launch.script_entry script.py args...``: how the launcher runs a script:
as ``__main__``, a failure written to the rank's error file for the launcher to report once."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from replicator.cluster.env_names import ERROR_DIR_ENV, RESTART_COUNT_ENV
from replicator.cluster.process_group import configure_threads, shutdown
from replicator.cluster.worker_errors import (
    ScriptNotFoundError,
    error_path,
    install_stack_dump,
    record_exception,
    record_finished,
)
from replicator.launch.forked_start import become_worker
from replicator.launch.launcher import check_script
from replicator.launch.malloc_tuning import tune_malloc

#: Threads whose work a failing worker waits for before it leaves (at most
#: ``_FINISH_SECONDS``): the background deletions of ``checkpoint.atomic``, so that a failed
#: run leaves no ``.trash-`` directory in its backup directory.
_FINISH_THREADS = ("replicator-prune",)
_FINISH_SECONDS = 30.0


def _finish_threads() -> None:
    deadline = time.monotonic() + _FINISH_SECONDS
    for thread in threading.enumerate():
        if thread.name in _FINISH_THREADS:
            thread.join(max(0.0, deadline - time.monotonic()))


def quiet_shutdown() -> None:
    """Leave the process group; a failure to leave does not change how the worker ends."""
    try:
        shutdown()
    except Exception:  # noqa: BLE001
        pass


def _clean_exit(code: int) -> None:
    """Finish like a normal exit, then leave without C++ static destructors, whose order with
    still-running backend threads can abort a worker that already succeeded."""
    import atexit

    quiet_shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_reported(body: Callable[[], None]) -> None:
    """Run a worker's ``body``: a failure written to the rank's error file (when the launcher
    set one), a normal finish noted and left with exit code 0."""
    rank = int(os.environ.get("RANK", "0"))
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        install_stack_dump(error_dir, rank)  # asked for when the launch is stopped
        path = error_path(error_dir, rank, int(os.environ.get(RESTART_COUNT_ENV, "0")))
    try:
        tune_malloc()  # a step's large buffers stay in the heap (malloc_tuning)
        body()
        record_finished(rank)  # before leaving the group: a peer still waiting can say so
        _clean_exit(0)
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            record_finished(rank)
            raise
        if error_dir:
            record_exception(RuntimeError(code) if isinstance(code, str) else exc, rank, path)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then exit 1
        if not error_dir:
            raise
        record_exception(exc, rank, path)
        _finish_threads()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        quiet_shutdown()


def run_as_main(script: str, args: list[str]) -> None:
    """Run ``script`` with ``args`` as ``__main__`` as ``python script args`` would, reported."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

    def body() -> None:
        check_script(script, ScriptNotFoundError)  # a restart would not find it either
        runpy.run_path(script, run_name="__main__")

    run_reported(body)


def leave_as_interpreter(run: Callable[[], None]) -> None:
    """Call ``run``, then leave as an interpreter does: a traceback printed, the exit code."""
    code: int = 0
    try:
        run()
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the interpreter's own report
        traceback.print_exc()
        code = 1
    _clean_exit(code)


def forked_entry(script: str, args: list[str], env: dict[str, str], cwd: str,
                 streams: Any) -> None:
    """A forked worker: the script runs, and the process leaves, as in a fresh ``python -u``."""
    become_worker(env, cwd, streams)
    sys.path.insert(0, cwd)  # ``python -m`` puts the working directory first, then the script's
    configure_threads(int(env.get("LOCAL_WORLD_SIZE", "1")))  # OMP_NUM_THREADS, read at import
    leave_as_interpreter(lambda: run_as_main(script, args))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m replicator.launch.script_entry SCRIPT [ARGS...]")
    run_as_main(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
