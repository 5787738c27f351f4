"""BackupAndRestore in a live-recovery job: ``backup.steps(dist, epochs=E)`` counts from the
committed step (a group killed and restarted heals from its peer and the run equals one
device), one group writes the backups, and losing every group at once resumes from disk at
the exact step, still equal to one device."""

from __future__ import annotations

import re
import signal

import pytest

from replicator.testing import assert_params_close
from tests.live_helpers import needs_torchft, one_device, run_groups

pytestmark = needs_torchft

ARGS = ["--optimizer", "adam", "--samples", "240", "--epochs", "2"]  # 20 steps of 24


@pytest.mark.timeout(900)
def test_backup_steps_with_a_killed_group(tmp_path):
    reference = one_device(tmp_path, ARGS)
    backup = tmp_path / "backup"
    out = run_groups(tmp_path, "killed", [*ARGS, "--backup", str(backup)], groups=2,
                     min_replicas=2, kills={1: 7}, restart=(1,))
    assert out[0]["codes"] == [0], out[0]["log"][-3000:]
    assert out[1]["codes"] == [-signal.SIGKILL, 0], out[1]["log"][-3000:]
    assert "replica group 1, rank 0 healed from a live peer at step 7" in out[1]["log"]
    for g in range(2):
        assert_params_close(reference, out[g]["params"], atol=1e-5, label=f"group {g}: ")


@pytest.mark.timeout(900)
def test_every_group_lost_at_once_resumes_from_disk(tmp_path):
    reference = one_device(tmp_path, ARGS)
    backup = tmp_path / "backup"
    # both groups die inside step 13 (12 committed), the writer once the backup due before
    # is on disk: step 10, the end of epoch 0, recorded as the start of epoch 1
    out = run_groups(tmp_path, "all_lost", [*ARGS, "--backup", str(backup)], groups=2,
                     min_replicas=2, kills={0: 12, 1: 12}, restart=(0, 1))
    for g in range(2):
        assert out[g]["codes"] == [-signal.SIGKILL, 0], out[g]["log"][-3000:]
        assert re.search(r"resuming from .*step-0+10 \(step 10, epoch 1\)",
                         out[g]["log"]), out[g]["log"][-3000:]
        assert_params_close(reference, out[g]["params"], atol=1e-5, label=f"group {g}: ")
