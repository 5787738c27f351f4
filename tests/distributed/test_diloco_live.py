"""DiLoCo under `replicator run --replica-groups 2 --nproc 2` on torchft's real lighthouse: each
replica group is one host. A process of group 1 is SIGKILLed in the middle of a round; group
0 trains that round again alone (every sample once), the launcher restarts group 1, which
heals from group 0 at a later round's start (outer weights, outer and inner optimizer state,
the step) and finishes with it: both end on the same outer weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from replicator.testing import assert_params_close
from tests.live_helpers import needs_torchft

pytestmark = needs_torchft

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "diloco_live_train.py")
SRC = str(Path(__file__).resolve().parents[2] / "src")
H, SAMPLES, BATCH, EPOCHS = 4, 64, 8, 3   # 8 steps per epoch, 24 steps: 6 rounds
KILL_AT, HOLD_AT = 6, 12                  # mid round 1; group 0 waits at round 3's start


def _records(out: Path) -> dict[tuple[int, int, int], dict[int, list[int]]]:
    """(group, rank, life) -> {global step: sample indices}, the last training of each step."""
    found = {}
    for path in out.glob("seen_g*r*_life*.jsonl"):
        g, rest = path.stem[len("seen_g"):].split("r", 1)
        r, life = rest.split("_life")
        steps: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                steps[entry["step"]] = entry["idx"]  # a round trained again overwrites
        found[(int(g), int(r), int(life))] = steps
    return found


@pytest.mark.timeout(240)
def test_a_group_killed_mid_round_heals_at_a_later_round_and_every_sample_is_trained_once(
        tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               REPLICATOR_LIVE_TIMEOUT_SECONDS="20", REPLICATOR_QUORUM_TIMEOUT_SECONDS="120")
    res = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "run", "--replica-groups", "2", "--nproc", "2",
         "--max-restarts", "1", SCRIPT, "--out", str(tmp_path), "--inner-steps", str(H),
         "--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS),
         "--kill-at-step", str(KILL_AT), "--hold-at-step", str(HOLD_AT)],
        capture_output=True, text=True, timeout=220, env=env)
    logs = f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    assert res.returncode == 0, logs
    records = _records(tmp_path)
    assert (1, 1, 0) in records and (1, 0, 1) in records, (sorted(records), logs)
    assert max(records[(1, 1, 0)]) == KILL_AT - 1  # killed inside step KILL_AT
    # group 1 healed at a round's start after the kill and trained to the end with group 0
    healed_at = int((tmp_path / "healed.txt").read_text())
    failed_round = KILL_AT // H * H
    assert healed_at >= failed_round and healed_at % H == 0, healed_at
    assert min(records[(1, 0, 1)]) == healed_at, sorted(records[(1, 0, 1)])
    summary_0 = json.loads((tmp_path / "summary_g0_life0.json").read_text())
    summary_1 = json.loads((tmp_path / "summary_g1_life1.json").read_text())
    assert summary_0["steps"] == summary_1["steps"] == EPOCHS * SAMPLES // BATCH
    assert summary_0["redone"] >= 1 and summary_0["participants"] == 2, summary_0
    # what was committed: group 1's first life up to the start of the round it died in
    for rank in (0, 1):
        records[(1, rank, 0)] = {s: i for s, i in records[(1, rank, 0)].items()
                                 if s < failed_round}
    steps_per_epoch = SAMPLES // BATCH
    for epoch in range(EPOCHS):
        seen = Counter(i for steps in records.values() for s, idx in steps.items()
                       if s // steps_per_epoch == epoch for i in idx)
        assert seen == Counter(range(SAMPLES)), f"epoch {epoch}: {seen}"
    # the same outer weights in both groups at the end (the last step closes a round)
    final = [torch.load(tmp_path / f"final_g{g}.pt") for g in (0, 1)]
    assert_params_close(final[0], final[1], atol=0, label="group 1 vs group 0: ")
