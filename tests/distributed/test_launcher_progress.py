"""``replicator run`` on a terminal: the chief's ``Trainer.fit`` draws a live progress bar
through the launcher's relay (the launcher's stdout is a real pseudo-terminal here)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_on_a_terminal(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``cmd`` with its stdout on a pseudo-terminal; (exit code, terminal text, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, COLUMNS="120"))
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal's other side closed
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        _, err = proc.communicate(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


@pytest.mark.timeout(180)
def test_fit_draws_a_live_bar_under_replicator_run_on_a_terminal() -> None:
    code, out, err = run_on_a_terminal(
        [sys.executable, "-m", "replicator.cli", "run", "--nproc", "2",
         str(SCRIPTS / "fit_progress.py")], timeout=150)
    assert code == 0, err
    # rich's bar (colour codes around it), drawn behind the chief's prefix
    assert re.search(r"\[rank 0\] epoch 1/2 (\x1b\[[0-9;]*m)?━", out), out
    assert "epoch 2/2  step 8/8" in out and "fit: 2 epochs" in out
