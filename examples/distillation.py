"""Knowledge distillation: a large CNN teacher, split into pipeline stages, labels the data
for a small student trained data-parallel, on the same processes.

    replicator run --nproc 2 examples/distillation.py               # 1 seed, about 2 minutes
    replicator run --nproc 2 examples/distillation.py --seeds 3     # the figures in the docs
    replicator run --nproc 2 examples/distillation.py --steps 2     # a smoke test for CI

The data: scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package), of
which 300 are labelled, 900 more are a transfer set whose labels are hidden (Hinton et al.
2015: the teacher labels them), and the remaining 597 are the test set.

Three phases in one job, each under the strategy that fits it:

1. the teacher (a CNN with 25 times the student's parameters) trains on the labelled
   images under ``PipelineStrategy(num_stages=2)``: each process holds half of its layers;
2. still split, the teacher runs inference over the labelled and transfer images: under a
   pipeline ``model(x)`` gives every rank the output, so each process gets every soft label
   (logits); then ``teacher_strategy.close()`` releases the pipeline's hooks;
3. the student (an MLP) trains under ``MirroredStrategy()`` on the same processes, each
   replica on its share of the global batch of ``(x, y, teacher logits)``, with the loss
   ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross_entropy`` (the
   cross-entropy on the labelled images only; temperature ``T``). The baseline is the same
   student trained on the labelled images with the cross-entropy alone, for as many epochs.

Both strategies share the job's one process group: each builds its own communication state
over it, and only one is in use at a time (the teacher's is closed before the student's is
made), so their collectives never interleave. Labelling once, before the student trains, is
offline distillation: without data augmentation the teacher's outputs are the same every
epoch, so running it at each student step would only repeat the work.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

GLOBAL_BATCH = 64
N_LABELLED, N_TRANSFER = 300, 900  # the rest of the 1,797 images is the test set
UNLABELLED = -1


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """300 labelled images, 900 whose labels are hidden (the transfer set), the test set."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    labelled, transfer = order[:N_LABELLED], order[N_LABELLED:N_LABELLED + N_TRANSFER]
    test = order[N_LABELLED + N_TRANSFER:]
    hidden = torch.full((N_TRANSFER,), UNLABELLED)
    return (TensorDataset(x[labelled], y[labelled]), TensorDataset(x[transfer], hidden),
            TensorDataset(x[test], y[test]))


def make_teacher() -> nn.Sequential:
    """A chain of blocks, so a pipeline can cut it: 184k parameters."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 160), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(160, 10))


def make_student() -> nn.Sequential:
    """7k parameters."""
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      labels: torch.Tensor, temperature: float, alpha: float) -> torch.Tensor:
    """``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y)``, the
    cross-entropy averaged over the labelled samples of the batch (``y = -1``: unlabelled)."""
    labelled = labels != UNLABELLED
    hard = F.cross_entropy(student_logits[labelled], labels[labelled]) if bool(labelled.any()) \
        else student_logits.sum() * 0.0  # a batch of transfer images only
    if alpha == 0:
        return hard
    soft = F.kl_div(F.log_softmax(student_logits / temperature, dim=1),
                    F.log_softmax(teacher_logits / temperature, dim=1),
                    log_target=True, reduction="batchmean")
    return alpha * temperature ** 2 * soft + (1 - alpha) * hard


def teacher_strategy(world: int) -> rp.Strategy:
    if world >= 2:
        return rp.PipelineStrategy(num_stages=2, num_microbatches=4, schedule="1f1b")
    print("one process: the teacher runs unsplit (launch with --nproc 2 to split it)")
    return rp.OneDeviceStrategy()


def train_teacher(train_set: TensorDataset, seed: int, epochs: int, steps: int | None,
                  world: int) -> tuple[rp.Strategy, nn.Module]:
    """Phase 1: train the teacher, split into stages, on the labelled images."""
    strategy = teacher_strategy(world)
    torch.manual_seed(seed)
    with strategy.scope():
        teacher = make_teacher()
        optimizer = torch.optim.Adam(teacher.parameters(), lr=2e-3)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = strategy.forward_backward(teacher, x, y, F.cross_entropy)  # one schedule run
        optimizer.step()
        optimizer.zero_grad()
        return loss

    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    done = 0
    for _ in range(epochs):
        for x, y in strategy.distribute_dataset(loader):  # every stage gets the same batch
            strategy.run(step_fn, args=(x, y))
            done += 1
            if steps is not None and done >= steps:
                break
        if steps is not None and done >= steps:
            break
    return strategy, teacher


def predict(model: nn.Module, x: torch.Tensor, chunk: int = 200) -> torch.Tensor:
    """Outputs in chunks padded to a multiple of 4 (the pipeline's microbatches)."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            part = x[i:i + chunk]
            pad = -len(part) % 4
            padded = torch.cat([part, part[:1].expand(pad, -1)]) if pad else part
            outputs.append(model(padded)[:len(part)])
    return torch.cat(outputs)


def accuracy(model: nn.Module, test_set: TensorDataset) -> float:
    x, y = test_set.tensors
    return float((predict(model, x).argmax(1) == y).float().mean())


def train_student(strategy: rp.Strategy, data: TensorDataset, seed: int, epochs: int,
                  steps: int | None, temperature: float, alpha: float) -> nn.Module:
    """Phase 3: the student, data parallel, on ``(x, y, teacher logits)``."""
    torch.manual_seed(seed)
    with strategy.scope():
        student = make_student()
        optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)

    def step_fn(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        loss = distillation_loss(student(x), t, y, temperature, alpha)
        loss.backward()  # gradients averaged across the replicas
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    done = 0
    student.train()
    for _ in range(epochs):
        for x, y, t in strategy.distribute_dataset(loader):  # each replica its share
            strategy.run(step_fn, args=(x, y, t))
            done += 1
            if steps is not None and done >= steps:
                return student
    return student


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="repeat with seeds 0..N-1")
    parser.add_argument("--teacher-epochs", type=int, default=50)
    parser.add_argument("--student-epochs", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=4.0)
    parser.add_argument("--alpha", type=float, default=0.9, help="weight of the soft loss")
    parser.add_argument("--steps", type=int, default=None, help="stop each phase after N steps")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))

    results: dict[str, list[float]] = {"teacher": [], "student, labelled only": [],
                                       "student, distilled": []}
    for seed in range(args.seeds):
        labelled, transfer, test_set = load_data(seed)
        t_strategy, teacher = train_teacher(labelled, seed, args.teacher_epochs, args.steps,
                                            world)
        # phase 2, still split: the teacher labels the labelled and the transfer images
        everything = TensorDataset(torch.cat([labelled.tensors[0], transfer.tensors[0]]),
                                   torch.cat([labelled.tensors[1], transfer.tensors[1]]))
        soft = predict(teacher, everything.tensors[0])  # every rank gets all the logits
        accs = {"teacher": accuracy(teacher, test_set)}
        t_strategy.close()  # the pipeline's hooks go; the student's strategy takes over
        strategy = rp.MirroredStrategy()
        hard_only = TensorDataset(*labelled.tensors, soft[:len(labelled)])
        accs["student, labelled only"] = accuracy(train_student(
            strategy, hard_only, seed, args.student_epochs, args.steps, args.temperature,
            alpha=0.0), test_set)
        accs["student, distilled"] = accuracy(train_student(
            strategy, TensorDataset(*everything.tensors, soft), seed, args.student_epochs,
            args.steps, args.temperature, args.alpha), test_set)
        strategy.close()
        for name, acc in accs.items():
            results[name].append(acc)
        if strategy.is_chief:
            print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in accs.items()),
                  flush=True)
    if strategy.is_chief:
        print(f"test accuracy, mean of {args.seeds} seed(s) on {world} process(es) "
              f"(T={args.temperature}, alpha={args.alpha}):")
        for name, accs_of in results.items():
            print(f"  {name:22s} {statistics.mean(accs_of):.4f}  "
                  f"{' '.join(f'{a:.4f}' for a in accs_of)}")


if __name__ == "__main__":
    main()
