"""A click-through model with a sparse embedding table on parameter servers, trained by a
ClusterCoordinator, on synthetic clicks from a known model (so its accuracy has a reference).

The data: users and items have a hidden bias and a hidden 4-dimensional vector; a user clicks
an item with probability sigmoid(1.5 (bias_user + bias_item) + 1.5 <user, item> / 2). The
best possible accuracy (predicting with the true probabilities) is printed beside the
model's, on the same held-out clicks.

    replicator run --nproc 5 --num-ps 2 examples/recommender.py    # chief, 2 workers, 2 servers
    replicator run --nproc 2 examples/recommender.py --steps 2     # chief + 1 server (quick)

With one process beside the servers the chief runs the scheduled steps itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp

USERS, ITEMS, HIDDEN, DIM, BATCH = 2_000, 1_000, 4, 16, 256


def true_vectors() -> tuple[torch.Tensor, torch.Tensor]:
    """Each user's and item's hidden vector; the first coordinate is its bias."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(USERS, HIDDEN + 1, generator=g), torch.randn(ITEMS, HIDDEN + 1,
                                                                     generator=g)


def clicks(seed: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` (user, item) pairs, their clicks drawn from the generating model, and the true
    click probabilities."""
    users, items = true_vectors()
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, USERS, (n,), generator=g)
    i = torch.randint(0, ITEMS, (n,), generator=g)
    bias = users[u, 0] + items[i, 0]
    affinity = (users[u, 1:] * items[i, 1:]).sum(1) / HIDDEN ** 0.5
    p = torch.sigmoid(1.5 * bias + 1.5 * affinity)
    return torch.stack([u, USERS + i], 1), torch.bernoulli(p, generator=g), p


class ClickModel(nn.Module):
    """One sparse table for users and items (rows 0..USERS-1 users, then items) and a dot
    product with a small MLP on top."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(USERS + ITEMS, DIM, sparse=True)
        nn.init.normal_(self.table.weight, std=0.1)
        self.head = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        rows = self.table(pairs)                       # [batch, 2, DIM]
        dot = (rows[:, 0] * rows[:, 1]).sum(1)
        return dot + self.head(rows.flatten(1)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()

    strategy = rp.ParameterServerStrategy(
        variable_partitioner=rp.ps.MaxSizePartitioner(max_shard_bytes=128 << 10))
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = ClickModel()
        # one optimizer: the table's rows get Adagrad row-wise on the servers
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)

    def input_fn(ctx: rp.InputContext):
        seed = 10_000 * (ctx.input_pipeline_id + 1)
        while True:  # each worker draws its own clicks
            seed += 1
            yield clicks(seed)[:2]

    def step(it):
        pairs, y = next(it)
        loss = F.binary_cross_entropy_with_logits(model(pairs), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    it = iter(coordinator.create_per_worker_dataset(input_fn))
    losses = [coordinator.schedule(step, args=(it,)) for _ in range(args.steps)]
    coordinator.join()
    last = losses[-1].fetch()

    if coordinator.is_chief:
        strategy.pull()
        pairs, y, p = clicks(seed=7, n=20_000)
        with torch.no_grad():
            accuracy = float(((model(pairs) > 0).float() == y).float().mean())
        best = float(((p > 0.5).float() == y).float().mean())
        stats = coordinator.stats()
        print(f"steps {args.steps}  last loss {float(last):.4f}  accuracy {accuracy:.3f}  "
              f"(generating model {best:.3f}, chance 0.5)  placement: "
              f"{sum(s['name'] == 'table.weight' for s in strategy.placement())} table shards "
              f"over {strategy.num_ps} server(s)  reruns {stats['reruns']}")


if __name__ == "__main__":
    main()
