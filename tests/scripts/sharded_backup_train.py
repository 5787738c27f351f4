"""A training script with BackupAndRestore under a model-splitting strategy (sharded backups).

Usage: sharded_backup_train.py OUT_DIR BACKUP_DIR --layout fsdp|data_pipeline|tensor [--steps N]
       [--save-freq K] [--kill RANK:STEP] [--kill-during-save STEP]

Each rank appends one JSON line per completed step to OUT_DIR/log-a{attempt}-r{rank}.jsonl
(step, loss, a random draw) and, at the end, writes the parameters and optimizer state it
holds (its FSDP shards or its pipeline stage) to OUT_DIR/final-r{rank}.safetensors.
"""

import argparse
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.resume import BackupAndRestore


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().clone().contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("backup")
    p.add_argument("--layout", choices=("fsdp", "data_pipeline", "tensor"), required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-freq", type=int, default=10)
    p.add_argument("--kill", help="RANK:STEP (once)")
    p.add_argument("--saver", choices=("process", "thread"), help="BackupAndRestore's saver")
    p.add_argument("--kill-during-save", type=int,
                   help="STEP: rank 0 dies after the sharded state committed, before the "
                   "backup's own marker")
    args = p.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    if args.layout == "fsdp":
        strategy: rp.Strategy = rp.FSDPStrategy()
    elif args.layout == "tensor":
        strategy = rp.TensorParallelStrategy()
    else:
        strategy = rp.MeshStrategy(data=2, pipeline=2,
                                   pipeline_options={"num_microbatches": 2, "schedule": "1f1b"})
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 6, generator=g)
    data = TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())
    dist_data = strategy.distribute_dataset(data, batch_size=8, shuffle=True, seed=3)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    backup = BackupAndRestore(args.backup, save_freq=args.save_freq, delete_checkpoint=False,
                              preemption_check_seconds=0.0, saver=args.saver)
    backup.track(model=model, optimizer=optimizer, scheduler=scheduler)
    faults = []
    if args.kill:
        r, s = (int(v) for v in args.kill.split(":"))
        # the backup due before the kill is committed first, however slow its upload
        faults.append(rp.testing.kill_rank(r, s, on_fire=backup.wait_for_save))
    if args.kill_during_save:
        rp.testing.kill_during_save(0, args.kill_during_save)

    attempt = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))
    log = open(Path(args.out) / f"log-a{attempt}-r{rank}.jsonl", "a")
    for step, (xb, yb) in backup.steps(dist_data, num_steps=args.steps):
        for fault in faults:
            fault(step)
        noisy = xb + 0.05 * torch.randn_like(xb)  # the RNG state must resume too
        loss = F.cross_entropy(model(noisy), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        log.write(json.dumps({"step": step, "loss": loss.item(),
                              "draw": float(np.random.rand())}) + "\n")
        log.flush()
    log.close()
    final = {f"model.{k}": _local(v) for k, v in model.named_parameters() if _local(v).numel()}
    for i, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            if not _local(param).numel():  # another stage's (loading may give it a state)
                continue
            for key, value in optimizer.state.get(param, {}).items():
                final[f"optimizer.{i}.{j}.{key}"] = _local(torch.as_tensor(value))
    save_file(final, str(Path(args.out) / f"final-r{rank}.safetensors"),
              metadata={"lr": str(optimizer.param_groups[0]["lr"])})


if __name__ == "__main__":
    main()
    # Leave as `replicator run` leaves a finished script (see backup_train.py).
    import sys as _sys

    _sys.stdout.flush()
    _sys.stderr.flush()
    os._exit(0)
