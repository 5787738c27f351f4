"""The process group across replica groups sums through shared memory when every group runs on
this host, gives gloo's numbers, keeps what it cannot sum on gloo, and fails (never hangs) when
a member dies mid-sum. Real processes and a real TCPStore on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replicator.testing.live_groups import free_port
from tests.live_helpers import needs_torchft

MEMBER = Path(__file__).resolve().parents[1] / "scripts" / "live_process_group_member.py"
ROOT = Path(__file__).resolve().parents[2]


def _members(world: int, *extra: str) -> dict[int, list[dict]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}",
               OMP_NUM_THREADS="1")
    procs = {r: subprocess.Popen([sys.executable, str(MEMBER), "--rank", str(r), "--world",
                                  str(world), "--port", str(port), *extra],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
             for r in range(world)}
    reports: dict[int, list[dict]] = {}
    for r, proc in procs.items():
        out, err = proc.communicate(timeout=150)
        reports[r] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        reports[r].append({"exit": proc.returncode, "stderr": err[-3000:]})
    return reports


@pytest.mark.timeout(180)
@needs_torchft
@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_sums_match_on_either_transport(transport):
    world = 3
    reports = _members(world, "--transport", transport)
    scale = world * (world + 1) / 2
    for r in range(world):
        first, end = reports[r][0], reports[r][-1]
        assert end["exit"] == 0, end["stderr"]
        assert first["shared"] is (transport == "auto")
        assert first["floats_0"] == scale and first["floats_last"] == 3_000_000 * scale
        assert first["ints"] == scale  # an integer sum goes through gloo on both


@pytest.mark.timeout(180)
@needs_torchft
def test_a_member_killed_mid_sum_fails_the_others_promptly():
    reports = _members(3, "--die-in-sum", "2")
    assert reports[2][-1]["exit"] == -9
    for r in (0, 1):
        lines = {k: v for line in reports[r] for k, v in line.items()}
        assert lines.get("exit") == 0, lines.get("stderr")
        assert lines["shared"] is True
        # the flag barrier saw the process gone: not a timeout of the 60 s collective
        assert "exited while the others waited" in lines["sum_after_death"], lines
        assert "failed before in this quorum" in lines["second_sum"], lines
