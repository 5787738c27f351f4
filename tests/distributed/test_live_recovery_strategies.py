"""CentralStorageStrategy and FSDPStrategy in replica groups of two processes: inside a group
as always (gradients reduced to one replica, or sharded: HSDP), across groups through torchft's
Manager, with --min-replicas 2. A group killed mid-step is restarted (the other waits for it),
heals from its peer rank by rank, and the final parameters equal one device with the same
global batch."""

from __future__ import annotations

import signal

import pytest

from replicator.testing import assert_params_close
from tests.live_helpers import needs_torchft, one_device, run_groups

pytestmark = needs_torchft


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["central_storage", "fsdp"])
def test_strategy_in_groups_of_two_survives_a_killed_group(tmp_path, strategy):
    args = ["--optimizer", "adam", "--samples", "240", "--epochs", "2"]  # 20 steps of 24
    reference = one_device(tmp_path, args)
    out = run_groups(tmp_path, "killed", [*args, "--strategy", strategy], groups=2,
                     min_replicas=2, nproc=2, kills={1: 6}, restart=(1,))
    assert out[0]["codes"] == [0], out[0]["log"][-4000:]
    assert out[1]["codes"] == [-signal.SIGKILL, 0], out[1]["log"][-4000:]
    assert "replica group 1, rank 0 healed from a live peer" in out[1]["log"]
    assert out[0]["summary"]["redone"] == 1, out[0]["summary"]
    for g in (0, 1):
        assert_params_close(reference, out[g]["params"], atol=1e-5, label=f"group {g}: ")


@pytest.mark.timeout(600)
def test_mirrored_groups_of_two_start_from_one_model(tmp_path):
    # each group initialises its model with another seed: torchft's first-step healing
    # gives some ranks of a group a peer's model, and the group then takes its rank 0's,
    # so all four processes train one model
    out = run_groups(tmp_path, "seeds", ["--samples", "120", "--epochs", "1",
                                          "--seed-by-group"], groups=2, min_replicas=2,
                     nproc=2)
    assert out[0]["codes"] == [0] and out[1]["codes"] == [0], out[0]["log"][-3000:]
    import torch

    run = tmp_path / "seeds"
    finals = [torch.load(run / name) for name in
              ("final_g0.pt", "final_g0r1.pt", "final_g1.pt", "final_g1r1.pt")]
    for other in finals[1:]:
        assert_params_close(finals[0], other, atol=1e-6)
