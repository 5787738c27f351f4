"""A loop ported from tf.distribute reports TensorFlow's numbers and trains like one device.

The loop of docs/migration/tf_distribute.md: ``rp.compute_average_loss(per_example,
global_batch_size=GLOBAL_BATCH)`` in the step and ``strategy.reduce("sum", per_replica)``
outside must report the mean loss over the global batch at every step (TensorFlow's value),
on 1, 2 and 3 replicas (the last batch of 9 rows splits unevenly over 2), and the weights
must equal one device's. PyTorch's spelling (a mean loss, ``reduce("mean")``) too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.testing import assert_params_close, run_distributed

GLOBAL_BATCH = 60
STEPS = 6  # five full batches and a last one of 9 rows


def _guide_loop(strategy_name: str, spelling: str, global_batch_size: bool = True,
                rows: int = GLOBAL_BATCH * (STEPS - 1) + 9) -> list:
    """The guide's loop on ``rows`` samples; returns the reported loss of each step and the
    final weights."""
    kwargs = {"device": "cpu"} if strategy_name == "one_device" else {}
    strategy = rp.get_strategy(strategy_name, **kwargs)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if spelling == "tf":
            per_example = F.cross_entropy(model(x), y, reduction="none")
            loss = rp.compute_average_loss(
                per_example, global_batch_size=GLOBAL_BATCH if global_batch_size else None)
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    x = torch.randn(rows, 20, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())
    dist = strategy.distribute_dataset(
        DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=True), seed=0)
    losses = []
    for x, y in dist:
        per_replica = strategy.run(step_fn, args=(x, y))
        reduced = strategy.reduce("sum" if spelling == "tf" else "mean", per_replica, axis=None)
        losses.append(float(reduced))
    return [losses, strategy.full_state_dict(model)]  # FSDP: full tensors on rank 0


def _compare(got: list, want: list, label: str) -> None:
    assert len(got[0]) == len(want[0]) == STEPS, (got[0], want[0])
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert a == pytest.approx(b, abs=1e-5), \
            f"{label}: step {step + 1} reports loss {a:.6f}, one device {b:.6f} ({a / b:.3f}x)"
    assert_params_close(want[1], got[1], atol=1e-5, label=f"{label}: ")


@pytest.mark.timeout(240)
def test_tf_spelling_reports_the_global_mean_and_trains_like_one_device() -> None:
    one = run_distributed(_guide_loop, 1, args=("one_device", "tf"))[0]
    assert one[0][-1] < one[0][0]  # it trains
    for n in (1, 2, 3):
        ranks = run_distributed(_guide_loop, n, args=("mirrored", "tf"))
        for rank, got in enumerate(ranks):
            _compare(got, one, f"mirrored x{n} rank {rank}")


@pytest.mark.timeout(240)
def test_tf_spelling_on_central_storage_and_fsdp() -> None:
    one = run_distributed(_guide_loop, 1, args=("one_device", "tf", False))[0]
    for name in ("central_storage", "fsdp"):
        got = run_distributed(_guide_loop, 3, args=(name, "tf", False))[0]
        _compare(got, one, f"{name} x3 (global_batch_size=None)")


@pytest.mark.timeout(240)
def test_pytorch_spelling_mean_loss_and_reduce_mean() -> None:
    """Full batches only: on an uneven one a mean loss is DDP's, not one device's (it warns)."""
    rows = GLOBAL_BATCH * STEPS
    one = run_distributed(_guide_loop, 1, args=("one_device", "torch", True, rows))[0]
    for n in (2, 3):
        got = run_distributed(_guide_loop, n, args=("mirrored", "torch", True, rows))[0]
        _compare(got, one, f"mirrored x{n} (mean loss, reduce mean)")
