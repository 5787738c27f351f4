"""DiLoCo keeps replicator's promises: every sample once per epoch across both hosts, a backup
taken mid-round (streamed int8 fragments in flight, inner momentum, error feedback) resumes
bit for bit in fresh processes, and host layouts that cannot work are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

SAMPLES, BATCH = 96, 16  # 6 steps per epoch


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True).sin(), torch.arange(SAMPLES))


def _train(backup_dir: str, num_steps: int) -> dict:
    strategy = rp.DiLoCoStrategy(inner_steps=5, fragments=2, sync_delay=1, compression="int8",
                                 hosts=2, block_size=16)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                                    torch.nn.Linear(12, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = strategy.distribute_dataset(_dataset(), batch_size=BATCH, shuffle=True, seed=1)
    backup = rp.BackupAndRestore(backup_dir, save_freq=7, delete_checkpoint=False)
    backup.track(model=model, optimizer=optimizer)
    seen: list[list[int]] = []

    def step_fn(batch: tuple[torch.Tensor, ...]) -> None:
        x, y, ids = batch
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(ids.tolist())

    for _, batch in backup.steps(data, num_steps=num_steps):
        strategy.run(step_fn, args=(batch,))
    out = {"params": {k: v.clone() for k, v in model.state_dict().items()},
           "outer": [o.detach().clone() for f in strategy._outer for o in f.outer],
           "step_in_round": strategy.step_in_round, "seen": seen,
           "momentum": [optimizer.state[p]["momentum_buffer"].clone()
                        for p in model.parameters()]}
    strategy.close()
    return out


def test_every_sample_once_per_epoch_and_mid_round_resume_is_bit_identical(tmp_path: Path):
    whole = run_distributed(_train, world_size=4, args=(str(tmp_path / "a"), 16),
                            timeout_seconds=60)
    first_epoch = sorted(i for r in whole for batch in r["seen"][:6] for i in batch)
    assert first_epoch == list(range(SAMPLES))
    # the two hosts trained apart since the last fragment update
    assert not torch.equal(whole[0]["params"]["0.weight"], whole[2]["params"]["0.weight"])

    cut = run_distributed(_train, world_size=4, args=(str(tmp_path / "b"), 7),
                          timeout_seconds=60)
    assert [r["step_in_round"] for r in cut] == [2] * 4  # saved mid-round, step 7 of H=5
    resumed = run_distributed(_train, world_size=4, args=(str(tmp_path / "b"), 16),
                              timeout_seconds=60)
    for r_whole, r_resumed in zip(whole, resumed):
        for key, value in r_whole["params"].items():
            assert torch.equal(value, r_resumed["params"][key]), key
        assert all(torch.equal(a, b) for a, b in zip(r_whole["outer"], r_resumed["outer"]))
        assert all(torch.equal(a, b) for a, b in zip(r_whole["momentum"],
                                                     r_resumed["momentum"]))
    # the resumed run read the rest of the input, not the start again
    assert [r["seen"] for r in resumed] == [r["seen"][7:] for r in whole]


def _layout(hosts: int | None, names: list[str] | None) -> str:
    import os

    if names is not None:
        os.environ["REPLICATOR_HOST"] = names[int(os.environ["RANK"])]
    try:
        rp.DiLoCoStrategy(inner_steps=4, hosts=hosts)
    except ClusterConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("hosts,names,match", [
    (3, None, "hosts=3 does not divide the job's 4 processes"),
    (None, ["a", "a", "a", "b"], "different numbers of processes"),
])
def test_host_layouts_that_cannot_work_are_refused(hosts, names, match):
    messages = run_distributed(_layout, world_size=4, args=(hosts, names), timeout_seconds=60)
    assert all(match in m and "HINT" in m for m in messages), messages
