"""A custom training loop written once for one device, switched to N replicas by one line.

    python examples/custom_loop.py                          # one replica
    replicator run --nproc 2 examples/custom_loop.py        # two CPU workers
    torchrun --nproc-per-node 2 examples/custom_loop.py     # the same, under torchrun

It trains a small MLP on scikit-learn's breast-cancer data (569 samples, shipped with the
package) with TF-Replicator's input_fn + step_fn shape and prints the held-out accuracy.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

GLOBAL_BATCH = 32


def load_data() -> tuple[TensorDataset, TensorDataset]:
    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:100], order[100:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps")
    args = parser.parse_args()

    strategy = rp.MirroredStrategy()          # the one line that changes
    train_set, test_set = load_data()

    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def input_fn(ctx: rp.InputContext) -> DataLoader:
        shard = rp.data.shard(train_set, ctx.num_input_pipelines, ctx.input_pipeline_id)
        return DataLoader(shard, batch_size=ctx.get_per_replica_batch_size(GLOBAL_BATCH),
                          shuffle=True, generator=torch.Generator().manual_seed(1))

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = rp.compute_average_loss(per_example)  # exact even when shards are uneven
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    dataset = strategy.distribute_datasets_from_function(input_fn)
    step = 0
    for epoch in range(args.epochs):
        for batch in dataset:
            loss = strategy.reduce("sum", strategy.run(step_fn, args=(batch,)))  # the global mean
            step += 1
            if args.steps is not None and step >= args.steps:
                break
        if strategy.is_chief:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f}", flush=True)
        if args.steps is not None and step >= args.steps:
            break

    shard = rp.data.shard(test_set, strategy.num_replicas_in_sync, strategy.replica_id)
    x, y = shard[:]
    with torch.no_grad():
        correct = (model(x.to(strategy.device)).argmax(1) == y.to(strategy.device)).sum()
    totals = strategy.reduce("sum", torch.tensor([float(correct), float(len(y))]))
    if strategy.is_chief:
        print(f"held-out accuracy {float(totals[0] / totals[1]):.3f} with "
              f"{strategy.num_replicas_in_sync} replica(s)")


if __name__ == "__main__":
    main()
