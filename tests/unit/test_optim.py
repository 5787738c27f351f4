"""LARS, LAMB (hand-computed trust ratios, exclusions) and the gradient accumulator's count."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import replicator as rp
from replicator.optim import full_norm, trust_ratio


def _param(values, grad) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    p.grad = torch.tensor(grad, dtype=torch.float32)
    return p


def test_trust_ratio_is_one_when_a_norm_is_zero():
    assert trust_ratio(torch.tensor(0.0), torch.tensor(2.0)).item() == 1.0
    assert trust_ratio(torch.tensor(3.0), torch.tensor(0.0)).item() == 1.0
    assert trust_ratio(torch.tensor(3.0), torch.tensor(2.0), 0.5).item() == pytest.approx(0.75)
    assert full_norm(torch.tensor([[3.0, 4.0]])).item() == pytest.approx(5.0)


def test_lars_trust_ratio_by_hand():
    # |w| = 5, |g| = 1: local_lr = 0.001 * 5 / 1 = 0.005
    w = _param([[3.0, 4.0]], [[0.6, 0.8]])
    rp.optim.LARS([w], lr=1.0, momentum=0.0).step()
    torch.testing.assert_close(w.detach(), torch.tensor([[3.0 - 0.003, 4.0 - 0.004]]))
    # with weight decay 0.1: ratio = 0.001 * 5 / (1 + 0.1 * 5); step = ratio * (g + 0.1 w)
    w = _param([[3.0, 4.0]], [[0.6, 0.8]])
    rp.optim.LARS([w], lr=2.0, momentum=0.0, weight_decay=0.1).step()
    ratio = 0.001 * 5 / 1.5
    expected = torch.tensor([[3.0 - 2 * ratio * 0.9, 4.0 - 2 * ratio * 1.2]])
    torch.testing.assert_close(w.detach(), expected)


def test_lars_excluded_parameters_take_plain_momentum_sgd():
    torch.manual_seed(0)
    bias_a = torch.nn.Parameter(torch.randn(5))
    bias_b = torch.nn.Parameter(bias_a.detach().clone())
    lars = rp.optim.LARS([bias_a], lr=0.1, momentum=0.9, weight_decay=0.5)
    sgd = torch.optim.SGD([bias_b], lr=0.1, momentum=0.9)  # no weight decay for biases
    for i in range(3):
        g = torch.randn(5, generator=torch.Generator().manual_seed(i))
        bias_a.grad, bias_b.grad = g.clone(), g.clone()
        lars.step()
        sgd.step()
    torch.testing.assert_close(bias_a, bias_b)


def test_lars_group_override_and_exclude_none():
    w1 = _param([[3.0, 4.0]], [[0.6, 0.8]])
    # the group says "exclude": plain SGD step of lr * g
    rp.optim.LARS([{"params": [w1], "exclude": True}], lr=1.0, momentum=0.0).step()
    torch.testing.assert_close(w1.detach(), torch.tensor([[2.4, 3.2]]))
    b = _param([3.0, 4.0], [0.6, 0.8])
    rp.optim.LARS([b], lr=1.0, momentum=0.0, exclude=None).step()  # a 1-D one adapts now
    torch.testing.assert_close(b.detach(), torch.tensor([3.0 - 0.003, 4.0 - 0.004]))


def test_lamb_trust_ratio_by_hand():
    # first step: m_hat = g, v_hat = g^2, so r = g / |g| = (1, -1); |w| = 5, |u| = sqrt(2)
    w = _param([[3.0, 4.0]], [[0.6, -0.8]])
    rp.optim.LAMB([w], lr=0.01, weight_decay=0.0, eps=1e-12).step()
    step = 0.01 * 5 / math.sqrt(2)
    torch.testing.assert_close(w.detach(), torch.tensor([[3.0 - step, 4.0 + step]]))
    # weight decay joins the update before the ratio: u = (1, -1) + 0.1 * (3, 4)
    w = _param([[3.0, 4.0]], [[0.6, -0.8]])
    rp.optim.LAMB([w], lr=0.01, weight_decay=0.1, eps=1e-12).step()
    u = torch.tensor([[1.3, -0.6]])
    expected = torch.tensor([[3.0, 4.0]]) - 0.01 * 5 / u.norm() * u
    torch.testing.assert_close(w.detach(), expected)


def test_lamb_trust_clip():
    w = _param([[3.0, 4.0]], [[0.6, -0.8]])
    rp.optim.LAMB([w], lr=0.01, weight_decay=0.0, eps=1e-12, max_trust=1.0).step()
    torch.testing.assert_close(w.detach(), torch.tensor([[2.99, 4.01]]))


def test_lamb_excluded_parameters_equal_adam_without_decay():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(7))
    b = torch.nn.Parameter(a.detach().clone())
    lamb = rp.optim.LAMB([a], lr=0.01, weight_decay=0.3, eps=1e-6)
    adam = torch.optim.Adam([b], lr=0.01, eps=1e-6)
    for i in range(4):
        g = torch.randn(7, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        lamb.step()
        adam.step()
    torch.testing.assert_close(a, b)


def test_optimizers_skip_parameters_without_gradients_and_save_state():
    for cls in (rp.optim.LARS, rp.optim.LAMB):
        w = torch.nn.Parameter(torch.ones(2, 2))
        opt = cls([w])
        opt.step()  # no gradient: nothing happens, no state
        assert torch.equal(w.detach(), torch.ones(2, 2)) and not opt.state
        w.grad = torch.ones(2, 2)
        opt.step()
        state = opt.state_dict()
        again = cls([w])
        again.load_state_dict(state)
        assert again.state_dict()["state"].keys() == state["state"].keys()
        assert not torch.equal(w.detach(), torch.ones(2, 2))


@pytest.mark.parametrize("cls,kwargs,match", [
    (rp.optim.LARS, dict(lr=-1.0), "lr"),
    (rp.optim.LARS, dict(momentum=1.5), "momentum"),
    (rp.optim.LARS, dict(exclude="bias"), "callable"),
    (rp.optim.LAMB, dict(betas=(0.9, 1.0)), "beta2"),
    (rp.optim.LAMB, dict(weight_decay=-0.1), "weight_decay"),
])
def test_optimizers_reject_bad_hyperparameters(cls, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_accumulator_counts_cycles_and_uses_no_sync_on_all_but_the_last():
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append("no_sync")
        yield

    accum = rp.optim.GradientAccumulator(3, no_sync)
    ready = []
    for _ in range(6):
        with accum:
            pass
        ready.append(accum.ready)
    assert ready == [False, False, True, False, False, True]
    assert entered == ["no_sync"] * 4
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        rp.optim.GradientAccumulator(0, no_sync)


def test_accumulator_on_one_device_equals_the_large_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    strategy = rp.OneDeviceStrategy("cpu")
    accum = strategy.accumulate(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        with accum:
            accum.backward(torch.nn.functional.mse_loss(model(x[i * 8:(i + 1) * 8]),
                                                        y[i * 8:(i + 1) * 8]))
        stepped = accum.step(opt)
        assert stepped == (i == 3)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
