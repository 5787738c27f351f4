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
#: actor-learner examples: one learner beside actors, not two data-parallel workers
ACTOR_EXAMPLES = {"rl_d4pg.py", "rl_impala.py"}
NOT_SCRIPTS = {"rl_plot.py"}  # a module the RL examples import


@pytest.mark.timeout(90)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                           if p.name not in SELF_LAUNCHING | ACTOR_EXAMPLES
                                           | NOT_SCRIPTS))
def test_example_runs_two_steps_on_two_workers(example):
    out = subprocess.run([sys.executable, "-m", "replicator.cli", "run", "--nproc", "2",
                          str(ROOT / "examples" / example), "--steps", "2"],
                         capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("example", sorted(ACTOR_EXAMPLES))
def test_actor_example_runs_two_learner_steps_beside_an_actor(example, tmp_path):
    out = subprocess.run([sys.executable, "-m", "replicator.cli", "run", "--nproc", "1",
                          "--num-actors", "1", str(ROOT / "examples" / example), "--steps", "2",
                          "--plot", str(tmp_path / "returns.png")],
                         capture_output=True, text=True, timeout=140, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "learner_steps" in out.stdout, out.stdout
