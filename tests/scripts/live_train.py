"""One replica group's training script for the live-recovery tests and benchmark.

An MLP trained with SGD or Adam (and an LR schedule) on a fixed synthetic regression set,
through ``strategy.distribute_dataset(..., epochs=E)``. ``--kill-at-step S``: this process
kills itself (SIGKILL) inside step ``S``, after backward and before the optimizer step, so the
other groups' all-reduce of that step fails (once: a restart that heals into step ``S`` trains
it; ``--kill-at-steps`` lists several). Writes the committed step after every step to
``progress_g<G>.txt`` and, at the end, the parameters to ``final_g<G>.pt``. ``--step-seconds``
slows every step (``--slow-until FILE``: only until FILE appears in the output folder).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.testing.live_groups import wait_for_file


def build(width: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 4))


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=g)
    y = torch.randn(samples, 4, generator=g)
    return TensorDataset(x, y)


def make_optimizer(name: str, model: torch.nn.Module):
    if name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="mirrored")
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--kill-at-steps", default="", help="comma-separated steps")
    ap.add_argument("--own-epoch-loop", action="store_true")
    ap.add_argument("--backup", default="", help="loop with BackupAndRestore in this folder")
    ap.add_argument("--save-freq", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--slow-until", default="",
                    help="with --step-seconds: sleep in each step only until this file (in "
                    "--out) exists, then train at full speed")
    ap.add_argument("--seed-by-group", action="store_true")
    ap.add_argument("--hold-at-step", type=int, default=-1)
    ap.add_argument("--hold-for", default="")
    ap.add_argument("--start-together", type=int, default=0,
                    help="wait for this many groups to start before the first step")
    a = ap.parse_args()
    out = Path(a.out)
    group = int(os.environ.get("REPLICATOR_REPLICA_GROUP", "0"))
    rank = int(os.environ.get("RANK", "0"))
    tag = f"g{group}" + (f"r{rank}" if rank else "")
    strategy = {"mirrored": rp.MirroredStrategy, "central_storage": rp.CentralStorageStrategy,
                "fsdp": rp.FSDPStrategy,
                "one_device": lambda: rp.OneDeviceStrategy("cpu")}[a.strategy]()
    with strategy.scope():
        model = build(a.width, seed=group if a.seed_by_group else 0)
    opt, sched = make_optimizer(a.optimizer, model)
    live = strategy.live
    kill_steps = {int(x) for x in a.kill_at_steps.split(",") if x}
    (out / f"started_{tag}.txt").write_text("1")
    for g in range(a.start_together):  # the groups meet before their first quorum (a busy
        # machine started one late: it missed its kill step)
        wait_for_file(out / f"started_g{g}.txt", 120, f"{tag}: the start of group {g}")
    (out / f"pid_{tag}.txt").write_text(str(os.getpid()))  # which process a test may kill
    t0 = time.monotonic()

    def after_step() -> None:
        if live is None:
            return
        (out / f"progress_{tag}.txt").write_text(str(live.committed_steps))
        if live.committed_steps == a.hold_at_step:
            deadline = time.monotonic() + 120
            while not (out / a.hold_for).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{tag} held at step {a.hold_at_step} for 120 s")
                time.sleep(0.02)

    backup = None

    def step_fn(batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        step = None if live is None else live.committed_steps
        # each kill step once: a restart that heals into the step it died in trains it
        done = out / f"killed_{tag}_at_{step}"
        if step is not None and (step == a.kill_at_step or step in kill_steps) \
                and not done.exists():
            done.write_text("1")
            if backup is not None:  # the backup due before the kill is on disk, however fast
                backup.wait_for_save()
            os.kill(os.getpid(), signal.SIGKILL)
        if a.step_seconds and not (a.slow_until and (out / a.slow_until).exists()):
            time.sleep(a.step_seconds)
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss.detach()

    data = dataset(a.samples)
    if a.backup:
        backup = rp.BackupAndRestore(a.backup, save_freq=a.save_freq)
        backup.track(model=model, optimizer=opt, scheduler=sched)
        dist = strategy.distribute_dataset(data, batch_size=a.batch, shuffle=True)
        for _, batch in backup.steps(dist, epochs=a.epochs):
            strategy.run(step_fn, (batch,))
            after_step()
    elif a.own_epoch_loop:
        dist = strategy.distribute_dataset(data, batch_size=a.batch, shuffle=True)
        for _ in range(a.epochs):
            for batch in dist:
                strategy.run(step_fn, (batch,))
                after_step()
    else:
        for batch in strategy.distribute_dataset(data, batch_size=a.batch, shuffle=True,
                                                 epochs=a.epochs):
            strategy.run(step_fn, (batch,))
            after_step()
    state = strategy.full_state_dict(model)
    if rank == 0 or a.strategy != "fsdp":
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / f"final_{tag}.pt")
    summary = {"redone": live.redone_steps if live else 0,
               "steps": live.committed_steps if live else None,
               "seconds": time.monotonic() - t0}
    (out / f"summary_{tag}.json").write_text(json.dumps(summary))
    strategy.close()
    print(f"[live_train] {tag} done: {summary}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
