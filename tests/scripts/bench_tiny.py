"""A tiny training script written for ``replicator bench``: the strategy comes from
``REPLICATOR_STRATEGY`` (``bench`` sets it), the loop is a plain ``strategy.run`` loop that
reduces the loss every step, as most custom loops do.

Usage: bench_tiny.py [--epochs N] [--width W] [--batch B]
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    strategy = rp.get_strategy(os.environ.get("REPLICATOR_STRATEGY", "mirrored"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True)
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        xb, yb = batch
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = strategy.distribute_dataset(loader)
    for _ in range(args.epochs):
        for batch in data:
            strategy.reduce("mean", strategy.run(step, args=(batch,)))
    if strategy.is_chief:
        print("finished all epochs", flush=True)


if __name__ == "__main__":
    main()
