"""The mixed-precision policy on one process: autocast in scope(), output casts, the scaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import replicator as rp


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_scope_applies_bf16_autocast_and_casts_outputs_back():
    strategy = rp.OneDeviceStrategy("cpu")
    with strategy.scope(precision="bf16"):
        model = _mlp()
    assert isinstance(strategy.precision, rp.MixedPrecision)
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, a, out: inner.append(out.dtype))
    out = model(torch.randn(2, 4))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # a deep copy (EMA, target network) runs its own parameters under the same policy
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.count_nonzero(twin(torch.randn(2, 4))) == 0
    assert torch.count_nonzero(model(torch.randn(2, 4))) > 0


def test_policy_given_once_per_strategy():
    strategy = rp.OneDeviceStrategy("cpu")
    with strategy.scope(precision=rp.MixedPrecision("bf16")):
        pass
    with strategy.scope(precision="bf16"):  # the same dtype by name: fine
        pass
    with pytest.raises(ValueError, match="already has the policy"):
        with strategy.scope(precision=rp.MixedPrecision("fp16")):
            pass
    with pytest.raises(TypeError, match="precision"):
        with rp.OneDeviceStrategy("cpu").scope(precision=3):  # type: ignore[arg-type]
            pass


def test_fp32_policy_changes_nothing_and_bad_names_fail():
    model = _mlp()
    forward = model.forward
    rp.MixedPrecision("fp32").apply(model)
    assert model.forward == forward
    with pytest.raises(ValueError, match="unknown dtype"):
        rp.MixedPrecision("int8")
    with pytest.raises(ValueError, match="loss_scale"):
        rp.MixedPrecision("fp16", loss_scale=-1.0)


def test_fixed_loss_scale_gives_the_unscaled_step():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    a, b = _mlp(), _mlp()
    policy = rp.MixedPrecision("fp32", loss_scale=64.0)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    policy.backward(F.cross_entropy(a(x), y))
    assert policy.step(opt_a)
    F.cross_entropy(b(x), y).backward()
    opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


def test_dynamic_scale_backs_off_on_inf_and_grows_after_clean_steps():
    model = _mlp()
    policy = rp.MixedPrecision("fp16", init_scale=8.0, growth_interval=2)
    assert policy.dynamic and policy.loss_scale == 8.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    scales, stepped = [], []
    for i in range(4):
        policy.backward(F.cross_entropy(model(x), y))
        if i == 0:
            model[0].weight.grad[0, 0] = float("nan")
        before = model[0].weight.detach().clone()
        stepped.append(policy.step(opt))
        assert torch.equal(before, model[0].weight.detach()) == (i == 0)
        opt.zero_grad()
        scales.append(policy.loss_scale)
    assert stepped == [False, True, True, True]
    assert scales == [4.0, 4.0, 8.0, 8.0]
    assert policy.skipped_steps == 1
    state = policy.state_dict()
    again = rp.MixedPrecision("fp16")
    again.load_state_dict(state)
    assert again.loss_scale == 8.0 and again.skipped_steps == 1


class _TwoReplicas:
    """A stand-in for a strategy of two replicas whose other replica saw inf gradients."""

    device = torch.device("cpu")
    num_replicas_in_sync = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reduce(self, op: str, value: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        self.calls.append(op)
        return torch.ones(())


def test_the_bound_strategy_decides_across_replicas_with_a_max():
    model = _mlp()
    policy = rp.MixedPrecision("fp16", init_scale=8.0)
    group = _TwoReplicas()
    policy.bind(group)  # anything with device, num_replicas_in_sync and reduce
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.backward(F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 3, (4,))))
    before = [p.detach().clone() for p in model.parameters()]
    assert not policy.step(opt)  # clean here, inf on the other replica: every replica skips
    assert group.calls == ["max"] and policy.skipped_steps == 1 and policy.loss_scale == 4.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_unbound_scaler_in_a_multi_process_job_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model = _mlp()
    policy = rp.MixedPrecision("fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.backward(F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 3, (4,))))
    with pytest.raises(rp.ReplicatorError, match=r"without a strategy.*scope\(precision=policy\)"):
        policy.step(opt)
