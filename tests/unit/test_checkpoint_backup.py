"""BackupAndRestore in one process: exact resume (model, optimizer, scheduler, RNG, input
position), epoch-end saves, preemption, the NaN stop, and the fault-injection helpers."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import replicator as rp
from replicator.checkpoint import CheckpointManager
from replicator.errors import NonFiniteLossError
from replicator.resume import PREEMPTION_EXIT_CODE, BackupAndRestore, Preempted


class _Crash(Exception):
    pass


class StatefulInput:
    """Batches in a seeded per-epoch order; state_dict records epoch and position."""

    def __init__(self, n: int = 44, batch: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids, self.x = torch.arange(n), torch.randn(n, 5, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.batch, self.epoch, self.position = batch, 0, 0

    def __len__(self) -> int:
        return len(self.ids) // self.batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(
            7 + self.epoch))
        while self.position < len(self):
            idx = order[self.position * self.batch:(self.position + 1) * self.batch]
            self.position += 1
            yield self.ids[idx], self.x[idx], self.y[idx]
        self.epoch, self.position = self.epoch + 1, 0


def _input(kind: str):
    if kind == "stateful":
        return StatefulInput()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(44, 5, generator=g)
    data = TensorDataset(torch.arange(44), x, (x[:, 0] > 0).long())
    if kind == "distributed":  # replicator's input, with its own state_dict
        return rp.OneDeviceStrategy("cpu").distribute_dataset(data, batch_size=4, shuffle=True,
                                                              seed=5)
    # A plain DataLoader without state: resuming replays the epoch from sampler.set_epoch.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    return DataLoader(data, batch_size=4, sampler=sampler)


def _train(backup_dir, kind="stateful", save_freq=5, epochs=3, crash_at=None, faults=(),
           nan_at=None, **options):
    """Train; return (params, optimizer state, per-step log). Seeds like a fresh process."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.97)
    backup = BackupAndRestore(backup_dir, save_freq=save_freq, delete_checkpoint=False,
                              **options)
    backup.track(model=model, optimizer=opt, scheduler=sched)
    log = []
    for step, (ids, x, y) in backup.steps(_input(kind), epochs=epochs):
        for fault in faults:
            fault(step)
        if step == crash_at:
            raise _Crash(step)
        loss = F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y) * (1 + random.random())
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        log.append((step, backup.epoch, ids.tolist(), float(np.random.rand()), loss.item()))
    return ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), log,
            backup)


def _assert_same(reference, resumed, resume_step):
    ref_params, ref_opt, ref_log, _ = reference
    params, opt, log, _ = resumed
    for key in ref_params:
        assert torch.equal(ref_params[key], params[key]), key
    for pid, state in ref_opt["state"].items():
        assert torch.equal(state["momentum_buffer"], opt["state"][pid]["momentum_buffer"])
    assert ref_opt["param_groups"][0]["lr"] == opt["param_groups"][0]["lr"]
    assert log[0][0] == resume_step + 1
    assert log == ref_log[resume_step:]


@pytest.mark.parametrize("kind,save_freq,crash_at,resume_step", [
    ("stateful", 5, 23, 20),       # mid-epoch, input state restored
    ("stateless", 5, 23, 20),      # mid-epoch, the epoch is replayed from set_epoch
    ("distributed", 5, 23, 20),
    ("distributed", "epoch", 25, 22),
    ("stateful", 11, 25, 22),      # saves on epoch ends (11 batches per epoch)
    ("stateless", "epoch", 25, 22),
    ("stateful", "epoch", 12, 11),
])
def test_resume_is_bit_identical(tmp_path, kind, save_freq, crash_at, resume_step):
    reference = _train(tmp_path / "ref", kind, save_freq)
    with pytest.raises(_Crash):
        _train(tmp_path / "run", kind, save_freq, crash_at=crash_at)
    resumed = _train(tmp_path / "run", kind, save_freq)
    _assert_same(reference, resumed, resume_step)
    assert resumed[3].restored.step == resume_step


def test_finished_run_resumes_to_nothing_and_delete_checkpoint_cleans_up(tmp_path):
    first = _train(tmp_path / "a", epochs=1)
    assert CheckpointManager(tmp_path / "a").committed_steps() == [10, 11]
    again = _train(tmp_path / "a", epochs=1)
    assert again[2] == [] and again[3].step == 11
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    backup = BackupAndRestore(tmp_path / "c", save_freq=4).track(model=model)
    for _ in backup.steps(StatefulInput(), epochs=1):
        pass
    assert not (tmp_path / "c").exists()
    assert first[3].step == 11


def test_sigterm_saves_the_agreed_step_and_exits_with_75(tmp_path):
    reference = _train(tmp_path / "ref")
    term = rp.testing.terminate_rank(0, at_step=17)
    received: list[int] = []

    def before(signum, frame):  # the handler a program had before training
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(Preempted) as info:
            _train(tmp_path / "run", faults=[term])
        assert received == [signal.SIGTERM]  # the backup's handler passed it on, once
        assert signal.getsignal(signal.SIGTERM) is before  # and put ours back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == PREEMPTION_EXIT_CODE and info.value.step == 17
    manifest = CheckpointManager(tmp_path / "run")
    assert manifest.committed_steps()[-1] == 17
    _assert_same(reference, _train(tmp_path / "run"), 17)


def test_nan_loss_stops_before_the_optimizer_step(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"at step 13 .*last backup: step 10"):
        _train(tmp_path / "run", nan_at=13)
    assert CheckpointManager(tmp_path / "run").committed_steps() == [5, 10]
    params, *_ = _train(tmp_path / "run", nan_at=None)  # the backup is intact and resumes
    assert all(torch.isfinite(p).all() for p in params.values())


def test_nan_check_can_be_turned_off(tmp_path):
    params, *_ = _train(tmp_path / "run", epochs=1, nan_at=3, terminate_on_nan=False)
    assert not all(torch.isfinite(p).all() for p in params.values())


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore("x", save_freq=0)
    with pytest.raises(ValueError, match="keep"):
        BackupAndRestore("x", keep=0)
    with pytest.raises(TypeError, match="state_dict"):
        BackupAndRestore("x").track(model=object())
    with pytest.raises(ValueError, match="epochs= or num_steps="):
        next(BackupAndRestore("x").steps([1, 2]))


def test_restore_needs_the_same_tracked_objects(tmp_path):
    _train(tmp_path / "run", epochs=1)
    backup = BackupAndRestore(tmp_path / "run").track(model=torch.nn.Linear(5, 2),
                                                      ema=torch.nn.Linear(5, 2))
    with pytest.raises(ValueError, match="no state for ema"):
        backup.restore()


def test_faults_fire_only_on_their_rank_and_first_attempt(monkeypatch):
    fired = []
    fault = rp.testing.Fault(lambda: fired.append(1), rank=1, at_step=3, once=True,
                             description="test")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")
    fault(2)
    fault(3)
    monkeypatch.setenv("REPLICATOR_RESTART_COUNT", "1")
    fault(3)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("REPLICATOR_RESTART_COUNT", "0")
    fault(3)
    assert fired == [1]
    assert os.environ["RANK"] == "0"


class _FakeCollectives:
    """Two 'ranks' where the other one reports a fixed step time and flag."""

    world_size, rank = 2, 0

    def __init__(self, other_step_time: float) -> None:
        self.other_step_time, self.other_flag, self.calls = other_step_time, 0.0, 0

    def all_reduce(self, tensor, op, what):
        self.calls += 1
        return torch.maximum(tensor, torch.tensor([self.other_flag, self.other_step_time],
                                                  dtype=tensor.dtype))


def test_preemption_checks_adapt_to_the_step_time_and_agree():
    from replicator.resume.preemption import PreemptionWatcher

    coll = _FakeCollectives(other_step_time=0.25)  # the slowest rank: 4 steps per second
    watcher = PreemptionWatcher(coll, check_seconds=1.0)
    assert [watcher.poll() for _ in range(9)] == [False] * 9
    assert coll.calls == 3  # at steps 1, 5 and 9: every 4 steps
    coll.other_flag = 1.0  # the other rank was signalled
    assert [watcher.poll() for _ in range(4)] == [False, False, False, True]  # step 13
    every = PreemptionWatcher(_FakeCollectives(0.25), check_seconds=0)
    assert [every.poll() for _ in range(3)] == [False] * 3 and every.collectives.calls == 3
