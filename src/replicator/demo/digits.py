"""Train a small CNN on scikit-learn's 8x8 handwritten digits with MirroredStrategy.

Run it with ``replicator demo`` (2 local workers) or ``replicator run --nproc N`` on this file.
The dataset ships inside scikit-learn (1,797 images), so nothing is downloaded."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.cluster.terminal import is_live_terminal
from replicator.demo.options import add_arguments


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a pooling step and two dense layers: ~40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _digits_arrays() -> tuple[Any, Any]:
    """The 1,797 digits as (pixels of 64 values in 0..16, labels), read from the file that
    scikit-learn ships: importing scikit-learn takes 1-5 s in every worker, the file 10 ms."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    origin = spec.origin if spec is not None else None
    csv = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if csv is None or not csv.is_file():  # a layout this reader does not know: the real API
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]

        digits = load_digits()
        return digits.data, digits.target
    table = np.loadtxt(csv, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0
                      ) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (1, 8, 8) float images in [0, 1], split the same way on every worker."""
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _progress(enabled: bool):
    """A rich progress bar on a live terminal (also one ``replicator run`` relays the chief's
    output to, see ``is_live_terminal``); ``None`` (plain lines) otherwise."""
    if not enabled or not is_live_terminal():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[speed]:.1f} steps/s  loss {task.fields[loss]:.4f}"),
                    TimeElapsedColumn())


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    strategy = rp.get_strategy(args.strategy)
    train_set, test_set = load_digits_split()
    torch.manual_seed(0)
    with strategy.scope():
        model = DigitsCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    dist_train = strategy.distribute_dataset(train_loader, seed=0)
    steps_per_epoch = len(dist_train)
    total = steps_per_epoch * args.epochs if args.steps is None else \
        min(args.steps, steps_per_epoch * args.epochs)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = rp.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    if strategy.is_chief:
        print(f"replicator demo: {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
              f"replica(s) on {strategy.device}, {len(train_set)} training digits, global batch "
              f"{args.batch_size}, {total} steps", flush=True)
    progress = _progress(strategy.is_chief)
    task = progress.add_task("train", total=total, speed=0.0, loss=0.0) if progress else None
    step, loss, t0 = 0, torch.tensor(0.0), time.perf_counter()
    with progress or contextlib.nullcontext():  # a rich Progress starts and stops the bar
        for epoch in range(args.epochs):
            first = step
            for batch in dist_train:
                loss = strategy.reduce("sum", strategy.run(train_step, args=(batch,)))
                step += 1
                speed = step / (time.perf_counter() - t0)
                if progress:
                    progress.update(task, advance=1, speed=speed, loss=float(loss))
                if step >= total:
                    break
            # asynchronous parameter-server workers share an epoch's batches (the fastest
            # takes more): this worker ran fewer than the epoch's, and says so
            shared = step < total and step - first < steps_per_epoch
            if progress and shared:  # the bar counts this worker's batches, not the epoch's
                progress.update(task, total=step + (args.epochs - epoch - 1) * (step - first))
            if strategy.is_chief and not progress:
                count = (f"{step - first} of the epoch's {steps_per_epoch} batches on this "
                         "worker (the others took the rest)") if shared else f"{step}/{total}"
                print(f"epoch {epoch + 1}/{args.epochs}  step {count}  "
                      f"loss {float(loss):.4f}  {speed:.1f} steps/s", flush=True)
            if step >= total:
                break

    accuracy = evaluate(strategy, model, test_set)
    wall = time.perf_counter() - start
    if strategy.is_chief:
        print(f"test accuracy {accuracy:.4f} on {len(test_set)} held-out digits | "
              f"wall time {wall:.1f} s | replicas {strategy.num_replicas_in_sync}", flush=True)
    rp.plan.print_plan_line(strategy, DigitsCNN, train_set, args.batch_size, script=__file__,
                            script_args="--strategy {strategy}")
    return accuracy


def evaluate(strategy: rp.Strategy, model: nn.Module, dataset: TensorDataset) -> float:
    """Accuracy over ``dataset``: each replica scores its shard, the counts are summed."""
    shard = rp.data.shard(dataset, strategy.num_replicas_in_sync, strategy.replica_id)
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=256):
            x, y = x.to(strategy.device), y.to(strategy.device)
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    counts = strategy.reduce("sum", torch.tensor([correct, total], dtype=torch.float64))
    return float(counts[0] / counts[1])


if __name__ == "__main__":
    main()
