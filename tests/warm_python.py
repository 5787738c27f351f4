"""A Python interpreter that has already imported torch and replicator, forking one fresh
child per script: each script still runs as its own process, from its own directory, as
``__main__`` with its own exit code and output, without paying the 2-4 s of imports again.

The runner is a child process started with the environment the scripts get; it reads one
JSON request per line on stdin (``{"script", "cwd", "timeout"}``), forks, and answers one JSON
line (``{"code", "timed_out"}``). The forked child sends its stdout and stderr to
``stdout.txt`` and ``stderr.txt`` in ``cwd`` and exits like any interpreter (atexit handlers
and finalizers run). The runner holds no threads when it forks: if importing left any, it
refuses, and the caller runs the script in a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


class WarmPython:
    """The caller's side: ``run(script, cwd, timeout)`` -> ``(exit code, stdout, stderr)``;
    ``None`` when the warm interpreter cannot serve (the caller then starts a fresh one)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        ready = self._read_line(120)
        self.ok = ready == "ready"

    def _read_line(self, timeout: float) -> str | None:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            return None
        return self.proc.stdout.readline().strip() or None

    def run(self, script: Path, cwd: Path, timeout: float) -> tuple[int, str, str] | None:
        if not self.ok or self.proc.poll() is not None:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd),
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self._read_line(timeout + 60)
        if line is None:
            self.ok = False
            return None
        reply = json.loads(line)
        if reply.get("timed_out"):
            raise TimeoutError(f"{script} ran past {timeout:.0f} s")
        out = (cwd / "stdout.txt").read_text(errors="replace")
        err = (cwd / "stderr.txt").read_text(errors="replace")
        return int(reply["code"]), out, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _run_child(request: dict) -> None:
    """In the forked child: become the script's process, run it, exit with its code."""
    import runpy
    import traceback

    cwd = Path(request["cwd"])
    os.chdir(cwd)
    os.setpgrp()  # the runner can stop the script and anything it started
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        target = os.open(cwd / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [request["script"]]
    sys.path[0] = str(Path(request["script"]).parent)
    code: int | str | None = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as an interpreter would
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def _serve() -> None:
    import importlib
    import threading

    from replicator.launch.forked_start import FORKSERVER_PRELOAD

    for module in FORKSERVER_PRELOAD:  # the point: imported once, before forking, as the
        importlib.import_module(module)  # launcher's forkserver does

    if threading.active_count() > 1:
        print("threads", flush=True)  # forking now could deadlock a child: refuse
        return
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)  # raises SystemExit: the child ends as an interpreter does
        deadline = time.monotonic() + float(request["timeout"])
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                status = -9
                break
            time.sleep(0.02)
        code = os.waitstatus_to_exitcode(status) if not timed_out else -9
        print(json.dumps({"code": code, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    _serve()
