"""Live recovery across replica groups on torchft's real lighthouse: groups of one process
killed with SIGKILL mid-step, one restarted (it heals from a live peer, no file is read), and
the final parameters equal an uninterrupted run and one device with the same global batch."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from replicator.testing import assert_params_close
from tests.live_helpers import needs_torchft, one_device, run_groups

pytestmark = needs_torchft


def _check_killed_run(tmp: Path, optimizer: str, args: list[str], kill_1: int, kill_2: int):
    args = ["--optimizer", optimizer, *args]
    reference = one_device(tmp, args)
    clean = run_groups(tmp, "clean", args)
    for g, r in clean.items():
        assert r["codes"] == [0], f"group {g}: {r['codes']}\n{r['log'][-3000:]}"
        assert_params_close(reference, r["params"], atol=1e-5, label=f"clean group {g}: ")
    hurt = run_groups(tmp, "killed", args, kills={1: kill_1, 2: kill_2}, restart=(1,))
    assert hurt[0]["codes"] == [0], hurt[0]["log"][-3000:]
    assert hurt[1]["codes"] == [-signal.SIGKILL, 0], hurt[1]["log"][-3000:]
    assert hurt[2]["codes"] == [-signal.SIGKILL], hurt[2]["log"][-3000:]
    assert "healed from a live peer" in hurt[1]["log"]
    for g in (0, 1):
        assert_params_close(reference, hurt[g]["params"], atol=1e-5, label=f"group {g}: ")
        assert_params_close(clean[0]["params"], hurt[g]["params"], atol=1e-5)
    # each failure costs the survivor at most one redone step
    assert 1 <= hurt[0]["summary"]["redone"] <= 2, hurt[0]["summary"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", [pytest.param("sgd", marks=pytest.mark.slow), "adam"])
def test_killed_groups_equal_one_device(tmp_path, optimizer):
    # 30 steps of a global batch of 24 (3 epochs of 10); group 1 dies in step 8 and is
    # restarted, group 2 dies in step 20
    _check_killed_run(tmp_path, optimizer, ["--samples", "240", "--epochs", "3"], 8, 20)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_killed_groups_equal_one_device_120_steps(tmp_path, optimizer):
    _check_killed_run(tmp_path, optimizer, ["--samples", "960", "--epochs", "3"], 30, 80)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_soak_1000_steps_with_a_kill_every_50_steps(tmp_path):
    # 1,000 steps (10 epochs of 100 global batches of 24); groups 1 and 2 die in turn every
    # 50 steps and are restarted each time; the run still equals one device
    args = ["--optimizer", "adam", "--samples", "2400", "--epochs", "10"]
    reference = one_device(tmp_path, args)
    kills_1 = ",".join(str(s) for s in range(50, 1000, 100))
    kills_2 = ",".join(str(s) for s in range(100, 1000, 100))
    out = run_groups(tmp_path, "soak", args, kills={}, restart=(1, 2), max_restarts=20,
                     deadline=2800, extra={1: ["--kill-at-steps", kills_1],
                                           2: ["--kill-at-steps", kills_2]})
    assert out[0]["codes"] == [0], out[0]["log"][-3000:]
    kills = sum(out[g]["codes"].count(-signal.SIGKILL) for g in (1, 2))
    assert kills >= 15, [out[g]["codes"] for g in (1, 2)]
    finished = [g for g in range(3) if out[g]["codes"][-1] == 0]
    assert len(finished) >= 2  # a group killed near the end is not restarted
    for g in finished:
        assert_params_close(reference, out[g]["params"], atol=1e-5, label=f"group {g}: ")
    assert 1 <= out[0]["summary"]["redone"] <= kills
