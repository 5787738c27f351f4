"""DiLoCo under replica groups, every group lost at once: the run resumes from its backup.

Two replica groups (one process each, torchft's real lighthouse) train DiLoCo (H=4, Adam
inside, outer Nesterov SGD) through ``BackupAndRestore.steps``, a backup every 3 steps. Both
groups are SIGKILLed at once after a backup is on disk: inside step 10, the backup of step 9
taken one step into the round that started at step 8, or inside step 13, the backup of step 12
taken at a round's end. Restarted, they resume at that round's start (8 or 12; the backup
holds it: outer weights and outer optimizer, inner weights, Adam state, step) and train to
the end. The final weights equal DiLoCo written out by hand over the batches each group
committed (both groups taking the writing group's Adam state at the resumed round's start,
as healing would), every sample is trained once per epoch, and a run with another
``inner_steps`` is refused that backup. Streaming (``fragments=2``, rounds of 2 steps): the
backup of step 9 resumes at 8 and each group's weights equal streaming DiLoCo by hand, both
groups taking group 0's inner weights and Adam state there. This file is also the groups'
training script (``python <this file> ...``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.testing import assert_params_close
from replicator.testing.live_groups import start_group, start_lighthouse
from tests.live_helpers import diloco_round_by_hand, needs_torchft, streaming_diloco_by_hand

pytestmark = needs_torchft

ROOT = Path(__file__).resolve().parents[2]
H, SAMPLES, BATCH, EPOCHS = 4, 64, 8, 3  # 8 steps per epoch, 24 steps: 6 rounds
SAVE_FREQ = 3                            # backups at steps 3, 6, 9, 12, ...


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g),
                         torch.randn(SAMPLES, 4, generator=g), torch.arange(SAMPLES))


# -- the training script of one replica group --------------------------------------------------
def train(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backup", required=True)
    ap.add_argument("--life", type=int, default=0)
    ap.add_argument("--inner-steps", type=int, default=H)
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--fragments", type=int, default=1)
    a = ap.parse_args(argv)
    out = Path(a.out)
    group = int(os.environ["REPLICATOR_REPLICA_GROUP"])
    strategy = rp.DiLoCoStrategy(inner_steps=a.inner_steps, fragments=a.fragments)
    with strategy.scope():
        model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    live = strategy.live
    assert live is not None, "start with replica groups"
    backup = rp.BackupAndRestore(a.backup, save_freq=SAVE_FREQ)
    backup.track(model=model, optimizer=opt)
    seen = (out / f"seen_g{group}_life{a.life}.jsonl").open("a")

    def step_fn(batch: tuple[torch.Tensor, ...]) -> None:
        x, y, idx = batch
        step = live.committed_steps
        F.mse_loss(model(x), y).backward()
        if step == a.kill_at_step:
            backup.wait_for_save()  # the backup due before is on disk, however fast
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        seen.write(json.dumps({"step": step, "idx": idx.tolist()}) + "\n")
        seen.flush()

    dist = strategy.distribute_dataset(dataset(), batch_size=BATCH, shuffle=True)
    for _, batch in backup.steps(dist, epochs=EPOCHS):
        strategy.run(step_fn, (batch,))
    seen.close()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               out / f"final_g{group}.pt")
    strategy.close()


# -- the test ---------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "REPLICATOR_LIVE_TIMEOUT_SECONDS": "20",
            "REPLICATOR_QUORUM_TIMEOUT_SECONDS": "120"}


def _records(out: Path) -> dict[tuple[int, int], dict[int, list[int]]]:
    """(group, life) -> {global step: sample indices}, the last training of each step."""
    found = {}
    for path in out.glob("seen_g*_life*.jsonl"):
        g, life = path.stem[len("seen_g"):].split("_life")
        steps: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                steps[entry["step"]] = entry["idx"]
        found[(int(g), int(life))] = steps
    return found


def _by_hand(committed: dict[int, dict[int, list[int]]], resumed_at: int
             ) -> dict[str, torch.Tensor]:
    """DiLoCo in one process over the batches each group committed: each round both groups
    start from the outer weights and take H Adam steps on their batches, the outer Nesterov
    SGD (0.7, 0.9) steps with the mean pseudo-gradient; at the resumed round's start both
    groups take group 0's Adam state (the backup's, written by group 0)."""
    x, y, _ = dataset().tensors
    outer_model = build_model()
    outer_opt = torch.optim.SGD(outer_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    inner = {}
    for g in (0, 1):
        model = build_model()
        inner[g] = (model, torch.optim.Adam(model.parameters(), lr=0.01))
    for start in range(0, EPOCHS * SAMPLES // BATCH, H):
        if start == resumed_at:
            saved = copy.deepcopy(inner[0][1].state_dict())
            inner[1][1].load_state_dict(saved)
        batches = [[torch.tensor(committed[g][step]) for step in range(start, start + H)]
                   for g in (0, 1)]
        diloco_round_by_hand(outer_model, outer_opt, [inner[0], inner[1]], batches, x, y)
    return {k: v.detach().clone() for k, v in outer_model.state_dict().items()}


def _run(groups: list, lighthouse: str, out: Path, backup: Path, life: int,
         extra: list[str] | None = None) -> list:
    return [start_group(__file__, g, 2, lighthouse, min_replicas=2, env=_env(), log_dir=out,
                        args=["--out", str(out), "--backup", str(backup), "--life", str(life),
                              *(extra or [])]) for g in groups]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kill_at,backup_at,resumed_at,fragments", [
    (10, 9, 8, 1),   # the backup of step 9, one step into the round of 8: resumed at 8
    (13, 12, 12, 1),  # the backup of step 12, a round's end: resumed there
    (10, 9, 8, 2),   # streaming, rounds of 2 steps: the backup of step 9 resumes at 8
], ids=["mid_round", "round_end", "mid_round_fragments2"])
def test_every_group_lost_at_once_resumes_from_the_backup(tmp_path, kill_at, backup_at,
                                                         resumed_at, fragments):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    lighthouse = start_lighthouse(2, log=tmp_path / "lighthouse.log")
    logs = lambda g: (out / f"group{g}_rank0.log").read_text(errors="replace")[-4000:]  # noqa: E731
    try:
        streaming = ["--fragments", str(fragments)]
        first = _run([0, 1], lighthouse.address, out, backup, 0,
                     ["--kill-at-step", str(kill_at), *streaming])
        for g, grp in enumerate(first):
            assert grp.wait(180) == [-signal.SIGKILL], logs(g)
        kept = tmp_path / "backup_copy"  # for the refusal below (the run deletes its own)
        shutil.copytree(backup, kept)
        second = _run([0, 1], lighthouse.address, out, backup, 1, streaming)
        for g, grp in enumerate(second):
            assert grp.wait(180) == [0], logs(g)
        other_h = 3 if fragments == 1 else 6  # a multiple of the fragments
        refused = _run([0], lighthouse.address, out, kept, 2,
                       ["--inner-steps", str(other_h), *streaming])[0]
        assert refused.wait(120) != [0], logs(0)
    finally:
        lighthouse.stop()
    steps_per_epoch = SAMPLES // BATCH
    for g in (0, 1):
        log = (out / f"group{g}_rank0.log").read_text(errors="replace")
        assert re.search(rf"resuming from .*step-0+{backup_at} \(step {backup_at}, epoch "
                         rf"{backup_at // steps_per_epoch}\)", log), log[-3000:]
        again = f"resumes at step {resumed_at}, the start of the round the backup of step " \
            f"{backup_at} was taken in"
        assert (again in log) == (resumed_at != backup_at), log[-3000:]
    refusal = (out / "group0_rank0.log").read_text(errors="replace")
    expected = f"synchronises every {other_h // fragments} steps but the backup of step " \
        f"{backup_at} was written by a run that synchronised every {H // fragments}"
    assert expected in refusal and "HINT" in refusal, refusal[-3000:]

    records = _records(out)
    for g in (0, 1):  # the first life trained into step kill_at - 1; the second from the resume
        assert max(records[(g, 0)]) == kill_at - 1, sorted(records[(g, 0)])
        assert min(records[(g, 1)]) == resumed_at, sorted(records[(g, 1)])
    committed = {g: {**{s: i for s, i in records[(g, 0)].items() if s < resumed_at},
                     **records[(g, 1)]} for g in (0, 1)}
    for g in (0, 1):
        assert sorted(committed[g]) == list(range(EPOCHS * steps_per_epoch))
    for epoch in range(EPOCHS):
        seen = Counter(i for g in (0, 1) for s, idx in committed[g].items()
                       if s // steps_per_epoch == epoch for i in idx)
        assert seen == Counter(range(SAMPLES)), f"epoch {epoch}: {seen}"
    final = [torch.load(out / f"final_g{g}.pt") for g in (0, 1)]
    if fragments == 1:
        assert_params_close(final[0], final[1], atol=0, label="group 1 vs group 0: ")
        assert_params_close(_by_hand(committed, resumed_at), final[0], atol=1e-6,
                            label="by hand vs run: ")
        return
    # streaming: each group's weights (the fragments not exchanged last are its own) are
    # those of streaming DiLoCo by hand, both groups taking group 0's state at the resume
    by_hand = streaming_diloco_by_hand({(g, 0): committed[g] for g in (0, 1)}, resumed_at,
                                       fragments, h=H, steps=EPOCHS * steps_per_epoch)
    for g in (0, 1):
        assert_params_close(by_hand[g], final[g], atol=1e-6, label=f"by hand vs group {g}: ")


if __name__ == "__main__":
    train(sys.argv[1:])
