"""Elastic membership of replica groups: a group stopped with SIGTERM leaves at a step boundary
without a failed step; a group started later heals from a live peer and the run stays equal to
one device; a late group whose script loops epochs itself is stopped with an error naming the
fix."""

from __future__ import annotations

import json
import re
import signal

import pytest

from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.testing import assert_params_close
from replicator.testing.live_groups import start_group, start_lighthouse, wait_for_file
from tests.live_helpers import SCRIPT, env, needs_torchft, one_device

pytestmark = needs_torchft

ARGS = ["--samples", "240", "--epochs", "4"]  # 40 steps of a global batch of 24


@pytest.mark.timeout(600)
def test_sigterm_leaves_at_a_step_boundary(tmp_path):
    reference = one_device(tmp_path, ARGS)
    out = tmp_path / "run"
    out.mkdir()
    lighthouse = start_lighthouse(1, log=out / "lighthouse.log")
    groups = []
    try:
        groups = [start_group(SCRIPT, g, 2, lighthouse.address, env=env(), log_dir=out,
                              args=["--out", str(out), *ARGS, "--step-seconds", "0.02",
                                    *(["--hold-at-step", "12", "--hold-for", "sigterm_sent"]
                                      if g == 1 else [])])
                  for g in range(2)]
        wait_for_file(out / "progress_g1.txt", 300, "group 1's first step", groups[1])
        while int((out / "progress_g1.txt").read_text() or 0) < 12:
            assert groups[1].poll() == [None], (out / "group1_rank0.log").read_text()
            wait_for_file(out / "progress_g1.txt", 300, "group 1's steps", groups[1])
        groups[1].signal(signal.SIGTERM)
        (out / "sigterm_sent").write_text("1")
        assert groups[1].wait(300) == [PREEMPTION_EXIT_CODE]
        assert groups[0].wait(300) == [0], (out / "group0_rank0.log").read_text()[-3000:]
    finally:
        for g in groups:
            g.kill()
        lighthouse.stop()
    log = (out / "group1_rank0.log").read_text()
    assert "leaves at step" in log
    summary = json.loads((out / "summary_g0.json").read_text())
    assert summary["redone"] == 0, summary  # no failed step
    import torch

    assert_params_close(reference, torch.load(out / "final_g0.pt"), atol=1e-5)


def _late_group(tmp_path, late_args):
    out = tmp_path / "run"
    out.mkdir()
    lighthouse = start_lighthouse(1, join_timeout_ms=10000, log=out / "lighthouse.log")
    groups = []
    try:
        groups.append(start_group(SCRIPT, 0, 2, lighthouse.address, env=env(), log_dir=out,
                                  args=["--out", str(out), *ARGS, *late_args,
                                        "--hold-at-step", "15", "--hold-for",
                                        "started_g1.txt"]))
        wait_for_file(out / "progress_g0.txt", 300, "group 0's first step", groups[0])
        groups.append(start_group(SCRIPT, 1, 2, lighthouse.address, env=env(), log_dir=out,
                                  args=["--out", str(out), *ARGS, *late_args]))
        late = groups[1].wait(300)
        codes = [groups[0].wait(300), late]
    finally:
        for g in groups:
            g.kill()
        lighthouse.stop()
    return out, codes


@pytest.mark.timeout(600)
def test_a_group_started_later_heals_and_joins(tmp_path):
    reference = one_device(tmp_path, ARGS)
    out, codes = _late_group(tmp_path, [])
    logs = [(out / f"group{g}_rank0.log").read_text() for g in range(2)]
    assert codes == [[0], [0]], logs[1][-3000:] + logs[0][-3000:]
    assert re.search(r"replica group 1, rank 0 healed from a live peer at step [1-9]", logs[1])
    import torch

    for g in range(2):
        assert_params_close(reference, torch.load(out / f"final_g{g}.pt"), atol=1e-5)


@pytest.mark.timeout(600)
def test_a_script_that_loops_epochs_itself_is_refused_at_heal(tmp_path):
    out, codes = _late_group(tmp_path, ["--own-epoch-loop"])
    log = (out / "group1_rank0.log").read_text()
    assert codes[1] == [1], log[-3000:]
    assert "EpochLoopError: replica group 1, rank 0 heals at step" in log
    assert "epochs=E" in log and "backup.steps(dist, epochs=E)" in log
    assert codes[0] == [0], (out / "group0_rank0.log").read_text()[-3000:]
