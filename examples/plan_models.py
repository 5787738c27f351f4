"""Three models to check ``replicator plan`` against: written once, run under any strategy.

The strategy comes from ``REPLICATOR_STRATEGY`` (``replicator bench`` and ``plan --validate``
set it; plain ``python`` or ``replicator run`` default to mirrored), the loop is an ordinary
``strategy.run`` loop that reduces the loss every step. Each model is an ``nn.Sequential`` so
that ``PipelineStrategy`` can cut it into stages.

* ``--model tiny``: a 10k-parameter MLP (distributing does not pay);
* ``--model mlp``: 4 x Linear(512, 512), 1M parameters (communication-heavy);
* ``--model cnn``: convolutions on 32x32 images, 60k parameters (compute-bound).

Run: ``replicator plan examples/plan_models.py --workers 1,2,3,4 --per-host 4 --validate --
--model cnn`` (script arguments after ``--``).
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """The model and the shape of one input sample."""
    if name == "tiny":
        return nn.Sequential(nn.Linear(20, 100), nn.ReLU(), nn.Linear(100, 64), nn.ReLU(),
                             nn.Linear(64, 10)), (20,)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(512, 512), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(512, 10)), (512,)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), (3, 32, 32)
    raise SystemExit(f"unknown --model {name!r}: tiny, mlp or cnn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch (default 64 for tiny, 512 for mlp, 128 for cnn)")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many steps (default: every epoch's batches)")
    args = parser.parse_args()
    batch = args.batch or {"tiny": 64, "mlp": 512, "cnn": 128}.get(args.model, 64)
    strategy = rp.get_strategy(os.environ.get("REPLICATOR_STRATEGY", "mirrored"))
    torch.manual_seed(0)
    shape = build(args.model)[1]
    x = torch.randn(batch * 8, *shape)
    y = torch.randint(0, 10, (batch * 8,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
    with strategy.scope():
        torch.manual_seed(0)
        model, _ = build(args.model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = b
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = strategy.distribute_dataset(loader)
    done = 0
    for _ in range(args.epochs):
        for b in data:
            loss = strategy.reduce("mean", strategy.run(step, args=(b,)))
            done += 1
            if done == args.steps:
                break
        if done == args.steps:
            break
    if strategy.is_chief:
        print(f"done: loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
