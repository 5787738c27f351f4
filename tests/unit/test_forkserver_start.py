"""A launch starts its forkserver as soon as it makes the context, before its own set-up: the
server's imports (torch and the rooms, 3-4 s) then overlap the launcher's. Started by the first
worker instead, a one-off launch of 2 workers was 1.15x slower than fresh interpreters
(``benchmarks/launch.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

_CHILD = textwrap.dedent("""
    import os
    import time
    from pathlib import Path

    from replicator.launch.forked_start import forkserver_context

    def servers():
        found = 0
        for entry in Path("/proc").iterdir():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            found += ppid == os.getpid() and b"multiprocessing.forkserver import main" in cmdline
        return found

    forkserver_context()  # no worker is ever started here
    deadline = time.monotonic() + 20  # the server's exec may lag on a busy machine
    while not servers() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(servers())
""")


@pytest.mark.timeout(120)
def test_the_forkserver_runs_once_its_context_is_made():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1", done.stdout + done.stderr[-2000:]
