"""A launch starts its forkserver as soon as it makes the context, before its own set-up: the
server's imports (torch and the rooms, 3-4 s) then overlap the launcher's. Started by the first
worker instead, a one-off launch of 2 workers was 1.15x slower than fresh interpreters
(``benchmarks/launch.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_processes

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: Makes the context, starts no worker, and waits until its stdin closes.
_CHILD = ("import sys\n"
          "from replicator.launch.forked_start import forkserver_context\n"
          "forkserver_context()\n"
          "print('ready', flush=True)\n"
          "sys.stdin.read()\n")


def _servers(pid: int) -> list[int]:
    return [child for child, cmd in child_processes(pid)
            if "multiprocessing.forkserver import main" in cmd]


@pytest.mark.timeout(120)
def test_the_forkserver_runs_once_its_context_is_made():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20  # the server's exec may lag on a busy machine
        while not _servers(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_servers(proc.pid)) == 1, child_processes(proc.pid)
    finally:
        proc.communicate(timeout=60)  # closes its stdin: it exits, and so does its server



#: Launches two workers that say whether ``wave`` and ``tabnanny`` (imported by neither torch
#: nor replicator) were imported before their function ran.
_PRELOADED = ("import sys\n"
              "import replicator as rp\n"
              "def f():\n"
              "    return ['wave' in sys.modules, 'tabnanny' in sys.modules]\n"
              "if __name__ == '__main__':\n"
              "    print(rp.launch(f, num_replicas=2))\n")


@pytest.mark.timeout(180)
def test_modules_named_in_replicator_preload_are_imported_once_by_the_server(tmp_path):
    script = tmp_path / "preloaded.py"
    script.write_text(_PRELOADED)
    env = dict(os.environ, REPLICATOR_PRELOAD="wave, no_such_module", PYTHONPATH=os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    # the named module is there, a module not named is not, a name that is no module is ignored
    assert out.stdout.strip().splitlines()[-1] == "[[True, False], [True, False]]"
