"""A live-recovery run says what happened and nothing else: no FutureWarning of the library's
own, no note about NCCL's flight recorder on a CPU torch, no HTTP access-log line for the state
a healing group fetched (two groups of one process, one killed at step 2 and restarted)."""

from __future__ import annotations

import signal

import pytest

from tests.live_helpers import needs_torchft, run_groups

pytestmark = needs_torchft

NOISE = ("FutureWarning", "reduce_op", "Unable to reset NCCL flight recorder",
         '"GET /checkpoint')


@pytest.mark.timeout(600)
def test_a_healed_live_run_prints_no_noise(tmp_path) -> None:
    out = run_groups(tmp_path, "quiet", ["--samples", "96", "--epochs", "1"], groups=2,
                     min_replicas=1, kills={1: 2}, restart=(1,))
    assert out[0]["codes"] == [0], out[0]["log"][-3000:]
    assert out[1]["codes"] == [-signal.SIGKILL, 0], out[1]["log"][-3000:]
    assert "healed from a live peer" in out[1]["log"]  # the state was fetched over HTTP
    for g, result in out.items():
        noisy = [line for line in result["log"].splitlines()
                 if any(n in line for n in NOISE)]
        assert noisy == [], f"group {g}:\n" + "\n".join(noisy)
