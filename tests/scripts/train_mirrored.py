"""A training script written once: run it with python, `replicator run` or torchrun.

Usage: train_mirrored.py OUT_FILE [--strategy NAME] [--steps N]
Rank 0 writes the final parameters (safetensors) to OUT_FILE.
"""

import argparse

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="mirrored")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    strategy = rp.get_strategy(args.strategy)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        xb, yb = batch
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = iter(strategy.distribute_dataset(loader))
    for _ in range(args.steps):
        strategy.run(step, args=(next(data),))
    if strategy.is_chief:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
    print(f"rank {strategy.replica_id} of {strategy.num_replicas_in_sync} done", flush=True)


if __name__ == "__main__":
    main()
