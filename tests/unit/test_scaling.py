"""Learning-rate scaling rules and warmup (rp.scaling)."""

from __future__ import annotations

import math

import pytest
import torch

import replicator as rp


def _opt(lr: float = 1.0, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (i + 1)}
              for i in range(groups)]
    return torch.optim.SGD(params, lr=lr)


def _lrs(opt: torch.optim.Optimizer, sched, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scaled_lr_rules():
    assert rp.scaling.scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert rp.scaling.scaled_lr(0.1, 256, 8192, rule="sqrt") == pytest.approx(0.1 * math.sqrt(32))
    assert rp.scaling.scaled_lr(0.1, 256, 64, rule="linear") == pytest.approx(0.025)
    assert rp.scaling.scaled_lr(0.1, 256, 8192, rule="none") == 0.1


@pytest.mark.parametrize("kwargs,match", [
    (dict(base_lr=0.1, base_batch=0, global_batch=8), "base_batch"),
    (dict(base_lr=0.1, base_batch=8, global_batch=2.5), "global_batch"),
    (dict(base_lr=-1.0, base_batch=8, global_batch=8), "base_lr"),
    (dict(base_lr=0.1, base_batch=8, global_batch=8, rule="cubic"), "available: linear"),
])
def test_scaled_lr_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rp.scaling.scaled_lr(**kwargs)


def test_warmup_linear_from_start_lr_reaches_the_set_lr():
    opt = _opt(lr=1.6)
    sched = rp.scaling.warmup(opt, steps=4, start_lr=0.4)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert _lrs(opt, sched, 7) == pytest.approx([0.4, 0.7, 1.0, 1.3, 1.6, 1.6, 1.6])


def test_warmup_default_starts_at_one_over_steps_and_per_group():
    opt = _opt(lr=1.0, groups=2)
    sched = rp.scaling.warmup(opt, steps=4)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert [s[0] for s in seen] == pytest.approx([0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0])
    assert [s[1] for s in seen] == pytest.approx([0.5, 0.875, 1.25, 1.625, 2.0, 2.0])


def test_warmup_constant_mode():
    opt = _opt(lr=1.0)
    sched = rp.scaling.warmup(opt, steps=3, start_factor=0.1, mode="constant")
    assert _lrs(opt, sched, 5) == pytest.approx([0.1, 0.1, 0.1, 1.0, 1.0])


def test_warmup_composes_with_a_decay_by_sequential_and_chained():
    opt = _opt(lr=1.0)
    warm = rp.scaling.warmup(opt, steps=2, start_factor=0.5)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    chained = torch.optim.lr_scheduler.ChainedScheduler([warm, decay])
    # both multiply: warmup 0.5 -> 0.75 -> 1, decay halves every step
    assert _lrs(opt, chained, 4) == pytest.approx([0.5, 0.75 * 0.5, 1.0 * 0.25, 0.125])

    opt = _opt(lr=1.0)
    warm = rp.scaling.warmup(opt, steps=2, start_factor=0.5)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
    lrs = _lrs(opt, seq, 6)
    assert lrs[:3] == pytest.approx([0.5, 0.75, 1.0])
    assert lrs[3] < 1.0 and lrs[4] < lrs[3], "the cosine decay runs after the warmup"


def test_warmup_state_dict_round_trip():
    opt = _opt(lr=1.0)
    sched = rp.scaling.warmup(opt, steps=4)
    _lrs(opt, sched, 2)
    state = sched.state_dict()
    opt2 = _opt(lr=1.0)
    sched2 = rp.scaling.warmup(opt2, steps=4)
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert _lrs(opt2, sched2, 3) == pytest.approx(_lrs(opt, sched, 3))


@pytest.mark.parametrize("kwargs,match", [
    (dict(steps=-1), "steps"),
    (dict(steps=3, start_factor=0.0), "start factor"),
    (dict(steps=3, start_lr=0.1, start_factor=0.5), "not both"),
    (dict(steps=3, mode="cosine"), "mode"),
])
def test_warmup_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rp.scaling.warmup(_opt(), **kwargs)
