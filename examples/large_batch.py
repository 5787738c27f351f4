"""Weak scaling on MNIST-1D: the same epochs at global batches 128, 1024 and 4096, with and
without the large-batch rules (linear learning-rate scaling + warmup; LARS and LAMB at 4096).

MNIST-1D (Greydanus 2020) is generated offline by the ``mnist1d`` package (nothing is
downloaded). The model is the paper's small CNN. Every configuration trains for the same number
of epochs with a cosine decay: SGD (momentum 0.9) at the learning rate tuned for batch 128,
unchanged ("no rule") or scaled by ``rp.scaling.scaled_lr`` and reached by
``rp.scaling.warmup`` ("linear+warmup"); at the largest batch also ``rp.optim.LARS`` (linear rule
+ warmup) and ``rp.optim.LAMB`` (square-root rule + warmup). The script prints a table (final
test accuracy, seconds and epochs to reach ``--target``) and writes a PNG plot.

    pip install mnist1d matplotlib          # or: pip install -e ".[examples]"
    python examples/large_batch.py                      # one process (OneDeviceStrategy)
    python examples/large_batch.py --replicas 2         # MirroredStrategy on 2 workers
    python examples/large_batch.py --quick              # seconds: a smoke test for CI
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

BASE_BATCH = 128


class MNIST1DConvNet(nn.Module):
    """The CNN of the MNIST-1D paper: three strided 1-D convolutions and a linear head."""

    def __init__(self, channels: int = 25) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.linear = nn.Linear(channels * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x.view(x.shape[0], 1, -1)))
        h = F.relu(self.conv2(h))
        h = F.relu(self.conv3(h))
        return self.linear(h.flatten(1))


def make_data(num_samples: int, seed: int = 42) -> dict[str, torch.Tensor]:
    """MNIST-1D generated locally (the package's own generator, 80/20 train/test split)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("this example needs the mnist1d package: pip install mnist1d "
                         "matplotlib (or pip install -e '.[examples]')") from e
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    d = make_dataset(args)
    return {"x": torch.tensor(d["x"], dtype=torch.float32),
            "y": torch.tensor(d["y"], dtype=torch.long),
            "x_test": torch.tensor(d["x_test"], dtype=torch.float32),
            "y_test": torch.tensor(d["y_test"], dtype=torch.long)}


def configs(batches: list[int], base_lr: float, lamb_lr: float,
            lars_trust: float) -> list[dict[str, Any]]:
    """The table's rows: the base batch, then per larger batch "no rule" and "linear+warmup",
    then LARS and LAMB at the largest batch."""
    small, *large = batches
    out = [dict(name=f"{small} (base)", batch=small, opt="sgd",
                lr=rp.scaling.scaled_lr(base_lr, BASE_BATCH, small), warmup=False)]
    for b in large:
        out.append(dict(name=f"{b} no rule", batch=b, opt="sgd", lr=base_lr, warmup=False))
        out.append(dict(name=f"{b} linear+warmup", batch=b, opt="sgd",
                        lr=rp.scaling.scaled_lr(base_lr, BASE_BATCH, b), warmup=True))
    out.append(dict(name=f"{large[-1]} LARS+warmup", batch=large[-1], opt="lars",
                    lr=rp.scaling.scaled_lr(base_lr, BASE_BATCH, large[-1]), warmup=True,
                    trust=lars_trust))
    out.append(dict(name=f"{large[-1]} LAMB+warmup", batch=large[-1], opt="lamb",
                    lr=rp.scaling.scaled_lr(lamb_lr, BASE_BATCH, large[-1], rule="sqrt"),
                    warmup=True))
    return out


def train_one(strategy: rp.Strategy, cfg: dict[str, Any], data: dict[str, torch.Tensor],
              epochs: int, warmup_epochs: float, base_lr: float) -> dict[str, Any]:
    """Train one configuration; returns its per-epoch test accuracy and training seconds."""
    torch.manual_seed(0)
    with strategy.scope():
        model = MNIST1DConvNet()
        optimizer: torch.optim.Optimizer
        if cfg["opt"] == "lamb":  # the library's defaults: weight decay 0.01, biases excluded
            optimizer = rp.optim.LAMB(model.parameters(), lr=cfg["lr"])
        elif cfg["opt"] == "lars":
            optimizer = rp.optim.LARS(model.parameters(), lr=cfg["lr"], momentum=0.9,
                                      trust_coefficient=cfg["trust"])
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=cfg["batch"],
                        shuffle=True, drop_last=True)
    dist = strategy.distribute_dataset(loader, seed=1)
    steps_per_epoch = len(data["x"]) // cfg["batch"]
    total = steps_per_epoch * epochs
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    schedule: torch.optim.lr_scheduler.LRScheduler = decay
    if cfg["warmup"]:
        w = min(round(warmup_epochs * steps_per_epoch), total // 2)
        # SGD and LARS warm up from the small-batch rate (Goyal et al.), LAMB from a tenth
        start = base_lr if cfg["opt"] != "lamb" else cfg["lr"] / 10
        warm = rp.scaling.warmup(optimizer, steps=w, start_lr=min(start, cfg["lr"]))
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - w)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, decay],
                                                         milestones=[w])

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        return loss.detach()

    accuracy, seconds, elapsed = [], [], 0.0
    for _ in range(epochs):
        strategy.barrier()
        start = time.perf_counter()
        for batch in dist:
            strategy.run(step_fn, args=(batch,))
        strategy.barrier()
        elapsed += time.perf_counter() - start
        with torch.no_grad():
            pred = model(data["x_test"]).argmax(1)
        acc = (pred == data["y_test"]).float().mean().item()
        accuracy.append(acc if acc == acc else 0.0)  # a diverged model scores 0, not NaN
        seconds.append(elapsed)
    return {**cfg, "accuracy": accuracy, "seconds": seconds, "steps": total}


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration, in this process's replica (called once per worker)."""
    # one thread per worker: on a busy machine a second thread per process costs far more
    # in waiting than it gains (see docs/large_batch.md)
    torch.set_num_threads(args.threads)
    strategy = rp.MirroredStrategy() if args.replicas > 1 else rp.OneDeviceStrategy("cpu")
    data = make_data(args.samples)
    results = []
    for cfg in configs(args.batches, args.base_lr, args.lamb_lr, args.lars_trust):
        r = train_one(strategy, cfg, data, args.epochs, args.warmup_epochs, args.base_lr)
        if strategy.is_chief:
            print(f"  {r['name']:>22}: accuracy {r['accuracy'][-1]:.4f} in "
                  f"{r['seconds'][-1]:.1f} s", flush=True)
        results.append(r)
    return results


def time_to(result: dict[str, Any], target: float) -> tuple[float | None, int | None]:
    for epoch, (acc, sec) in enumerate(zip(result["accuracy"], result["seconds"]), 1):
        if acc >= target:
            return sec, epoch
    return None, None


def report(results: list[dict[str, Any]], target: float, out_dir: str) -> None:
    base = results[0]["accuracy"][-1]
    print(f"\nMNIST-1D, same epochs for every batch; time to {target:.2f} test accuracy")
    print(f"{'configuration':>22}  {'lr':>7}  {'steps':>6}  {'accuracy':>8}  {'vs base':>7}  "
          f"{'s to target':>11}  {'epochs':>6}  {'total s':>7}")
    for r in results:
        sec, ep = time_to(r, target)
        print(f"{r['name']:>22}  {r['lr']:7.4g}  {r['steps']:6d}  {r['accuracy'][-1]:8.4f}  "
              f"{100 * (r['accuracy'][-1] - base):+6.2f}  "
              f"{'-' if sec is None else f'{sec:.1f}':>11}  {'-' if ep is None else ep:>6}  "
              f"{r['seconds'][-1]:7.1f}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "large_batch.json"), "w") as f:
        json.dump(results, f, indent=1)
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(out_dir, ".matplotlib"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        style = "--" if "no rule" in r["name"] else "-"
        epochs = range(1, len(r["accuracy"]) + 1)
        ax1.plot(epochs, r["accuracy"], style, marker=".", label=r["name"])
        ax2.plot(r["seconds"], r["accuracy"], style, marker=".", label=r["name"])
    for ax, xlabel in ((ax1, "epoch"), (ax2, "training seconds")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.0, 1.0)
        ax.axhline(target, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("MNIST-1D: global batch vs accuracy, with and without the large-batch rules")
    fig.tight_layout()
    path = os.path.join(out_dir, "large_batch.png")
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path} and large_batch.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--samples", type=int, default=50_000, help="MNIST-1D samples "
                        "generated (80%% train)")
    parser.add_argument("--epochs", type=int, default=40, help="for every batch")
    parser.add_argument("--warmup-epochs", type=float, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--base-lr", type=float, default=0.1, help="SGD lr at batch 128 "
                        "(the best of 0.01-0.2 there)")
    parser.add_argument("--lars-trust", type=float, default=0.014,
                        help="LARS trust coefficient")
    parser.add_argument("--lamb-lr", type=float, default=0.009, help="LAMB lr at batch 128 "
                        "(scaled by the square root)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", default="large_batch_out")
    parser.add_argument("--quick", action="store_true", help="tiny run for CI (seconds)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.epochs, args.batches, args.warmup_epochs = 2000, 2, [16, 64, 256], 1
    start = time.perf_counter()
    if args.replicas > 1:
        results = rp.launch(run_all, num_replicas=args.replicas, args=(args,))[0]
    else:
        results = run_all(args)
    report(results, args.target, args.out)
    print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
