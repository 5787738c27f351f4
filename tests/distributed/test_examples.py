"""The shipped demo and examples run end to end on 2 local workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_demo_trains_digits_to_at_least_95_percent():
    out = subprocess.run([sys.executable, "-m", "replicator.cli", "demo"], capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    lines = [ln.removeprefix("[rank 0] ") for ln in out.stdout.splitlines()]  # the relay's prefix
    line = next(ln for ln in lines if ln.startswith("test accuracy"))
    accuracy = float(line.split()[2])
    assert accuracy >= 0.95, out.stdout
    assert "replicas 2" in line and "wall time" in line


#: Examples that launch their own replicas and have their own smoke test (``--quick``).
SELF_LAUNCHING = {"large_batch.py"}  # tests/distributed/test_large_batch.py


@pytest.mark.timeout(90)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                           if p.name not in SELF_LAUNCHING))
def test_example_runs_two_steps_on_two_workers(example):
    out = subprocess.run([sys.executable, "-m", "replicator.cli", "run", "--nproc", "2",
                          str(ROOT / "examples" / example), "--steps", "2"],
                         capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
