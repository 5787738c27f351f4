"""A training script with BackupAndRestore, used by the fault-tolerance tests.

Usage: backup_train.py OUT_DIR BACKUP_DIR [--steps N] [--save-freq K] [fault options]

Each rank appends one JSON line per completed step to OUT_DIR/log-a{attempt}-r{rank}.jsonl
(step, sample ids, a random draw) and, at the end, writes its final model and optimizer state
to OUT_DIR/final-r{rank}.safetensors. Faults come from rp.testing.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

import replicator as rp
from replicator import fault_points
from replicator.errors import ReplicaTimeoutError
from replicator.resume import BackupAndRestore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests package
from tests.helpers import hang  # noqa: E402


class ShardedIds:
    """Per-replica batches in a seeded per-epoch order, with an exact state_dict."""

    def __init__(self, data: TensorDataset, global_batch: int, rank: int, world: int) -> None:
        self.data, self.rank, self.world = data, rank, world
        self.per_replica = global_batch // world
        self.global_batch = global_batch
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.data) // self.global_batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(
            100 + self.epoch)).tolist()
        while self.position < len(self):
            start = self.position * self.global_batch + self.rank * self.per_replica
            idx = order[start:start + self.per_replica]
            self.position += 1
            yield tuple(t[idx] for t in self.data.tensors)
        self.epoch += 1
        self.position = 0


def parse_fault(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(":")] if text else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("backup")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-freq", default="10")
    p.add_argument("--kill", help="RANK:STEP (once)")
    p.add_argument("--kill-during-save", type=int, help="STEP: rank 0 dies before the marker")
    p.add_argument("--terminate", help="RANK:STEP: SIGTERM once")
    p.add_argument("--fail", help="RANK:STEP: raise on every attempt")
    p.add_argument("--delay", help="RANK:STEP:SECONDS (once)")
    p.add_argument("--hang", help="RANK:STEP:SECONDS (once): a hung rank, away SECONDS or until "
                   "a rank waiting for it has given up (OUT_DIR/gave-up)")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--stateful-data", action="store_true")
    p.add_argument("--delete", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--check-seconds", type=float, default=0.0, help="preemption checks")
    p.add_argument("--attempt-offset", type=int, default=0, help="log numbering of a rerun")
    p.add_argument("--slow-commit", help="STEP:SECONDS: the chief waits after the commit")
    p.add_argument("--background", action="store_true",
                   help="save in the background (then which backup a crash resumes from "
                   "depends on timing; the tests here assert exact resume steps)")
    args = p.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    strategy = rp.MirroredStrategy()
    rank, world = strategy.replica_id, strategy.num_replicas_in_sync
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 6, generator=g)
    data = TensorDataset(torch.arange(240), x, (x[:, 0] + x[:, 1] > 0).long())
    if args.stateful_data:
        dist_data = ShardedIds(data, 8, rank, world)
    else:
        dist_data = strategy.distribute_dataset(data, batch_size=8, shuffle=True, seed=3)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=25, gamma=0.5)
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    backup = BackupAndRestore(args.backup, save_freq=save_freq, delete_checkpoint=args.delete,
                              preemption_check_seconds=args.check_seconds,
                              background=args.background)
    backup.track(model=model, optimizer=optimizer, scheduler=scheduler)

    faults = []
    if args.kill:
        faults.append(rp.testing.kill_rank(*parse_fault(args.kill)))
    if args.terminate:
        faults.append(rp.testing.terminate_rank(*parse_fault(args.terminate)))
    if args.fail:
        faults.append(rp.testing.fail_rank(*parse_fault(args.fail), once=False))
    if args.delay:
        r, s, seconds = parse_fault(args.delay)
        faults.append(rp.testing.delay_rank(r, s, seconds))
    if args.kill_during_save:
        rp.testing.kill_during_save(0, args.kill_during_save)
    if args.slow_commit:
        slow_step, seconds = parse_fault(args.slow_commit)
        fault_points.add_hook("after_commit", lambda step, path, rank: time.sleep(
            seconds if step == slow_step and rank == 0 else 0))

    attempt = int(os.environ.get("REPLICATOR_RESTART_COUNT",
                                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    attempt += args.attempt_offset
    hung = parse_fault(args.hang) if args.hang and attempt == 0 else None
    gave_up = Path(args.out) / "gave-up"
    log = open(Path(args.out) / f"log-a{attempt}-r{rank}.jsonl", "a")
    try:
        _train(args, backup, dist_data, model, optimizer, scheduler, faults, hung, rank, log)
    except ReplicaTimeoutError:
        gave_up.touch()  # the hung rank may come back now: this rank has its error
        raise
    log.close()
    _save_final(model, optimizer, Path(args.out) / f"final-r{rank}.safetensors")


def _save_final(model, optimizer, path: Path) -> None:
    """The final model and optimizer state, compared with the uninterrupted run's."""
    final = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            final[f"optimizer.{pid}.{key}"] = torch.as_tensor(value).clone().contiguous()
    save_file(final, str(path), metadata={"lr": str(optimizer.param_groups[0]["lr"])})


def _train(args, backup, dist_data, model, optimizer, scheduler, faults, hung, rank, log):
    for step, (ids, xb, yb) in backup.steps(dist_data, num_steps=args.steps):
        for fault in faults:
            fault(step)
        if hung and rank == hung[0] and step == hung[1]:
            print(f"rank {rank}: hanging at step {step}", file=sys.stderr, flush=True)
            hang(hung[2], Path(args.out) / "gave-up")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        noisy = xb + 0.05 * torch.randn_like(xb)
        loss = F.cross_entropy(model(noisy), yb) * (1.0 + 0.1 * random.random())
        if step == args.nan_at:
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        log.write(json.dumps({"step": step, "ids": ids.tolist(), "draw": float(np.random.rand()),
                              "loss": loss.item()}) + "\n")
        log.flush()


if __name__ == "__main__":
    main()
    # Leave as `replicator run` leaves a finished script: output flushed, no C++ static
    # destructors. Run directly (torchrun, TF_CONFIG, SLURM), a finished gloo job can still
    # abort at interpreter teardown ("terminate called without an active exception"), which
    # these equivalence tests are not about.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
