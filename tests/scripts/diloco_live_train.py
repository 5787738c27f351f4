"""One replica group's DiLoCo training script for the live-recovery test of two-level training.

Launched by ``replicator run --replica-groups G --nproc P``: each group is one DiLoCo host. An
MLP trained with Adam on a synthetic regression set whose samples carry their index, through
``strategy.distribute_dataset(..., epochs=E)``. Every process appends each step it trains
(global step and sample indices) to ``seen_g<G>r<R>_life<L>.jsonl``. ``--kill-group G
--kill-at-step S``: rank 1 of group G kills itself (SIGKILL) inside step S of its first life.
``--hold-at-step S``: the other groups wait before the last step ahead of step S (a
round's start) until the restarted group is about to ask for a quorum, and every step is
from there on slowed by ``--step-seconds`` until it has healed, so it joins before the
end. ``--fragments F`` streams the model in F fragments (a round of ``inner_steps / F`` steps
ends with one fragment's exchange), started ``--sync-delay`` steps before the round's end.
``--compression int8|int4`` (``--no-error-feedback``)
quantises the exchange. At the end
rank 0 writes the parameters to ``final_g<G>.pt`` and its step counts and wire bytes to
``summary_g<G>_life<L>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import replicator as rp


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(samples, 8, generator=g),
                         torch.randn(samples, 4, generator=g), torch.arange(samples))


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:.0f} s")
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--inner-steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill-group", type=int, default=1)
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--hold-at-step", type=int, default=-1)
    ap.add_argument("--step-seconds", type=float, default=0.25)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--sync-delay", type=int, default=0)
    ap.add_argument("--compression", choices=["int8", "int4"], default=None)
    ap.add_argument("--no-error-feedback", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    group = int(os.environ["REPLICATOR_REPLICA_GROUP"])
    rank = int(os.environ.get("RANK", "0"))
    life = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))
    strategy = rp.DiLoCoStrategy(inner_steps=a.inner_steps, fragments=a.fragments,
                                 sync_delay=a.sync_delay, compression=a.compression,
                                 error_feedback=not a.no_error_feedback)
    with strategy.scope():
        model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    live = strategy.live
    assert live is not None, "launch with replicator run --replica-groups"
    if life == 0:  # the groups meet before their first quorum: none trains alone at the start
        (out / f"started_g{group}r{rank}.txt").write_text("1")
        for g in range(int(os.environ["REPLICATOR_REPLICA_GROUPS"])):
            wait_for(out / f"started_g{g}r{rank}.txt", 120)
    killer = group == a.kill_group and rank == 1 and life == 0 and a.kill_at_step >= 0
    restarted = out / f"running_g{a.kill_group}_life1.txt"
    healed = out / "healed.txt"
    seen = (out / f"seen_g{group}r{rank}_life{life}.jsonl").open("a")

    def step_fn(batch):
        x, y, idx = batch
        step = live.committed_steps
        F.mse_loss(model(x), y).backward()
        if killer and step == a.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        seen.write(json.dumps({"step": step, "idx": idx.tolist()}) + "\n")
        seen.flush()

    dist = strategy.distribute_dataset(dataset(a.samples), batch_size=a.batch, shuffle=True,
                                       epochs=a.epochs)
    if life:
        restarted.write_text("1")  # it asks for a quorum next
    for batch in dist:
        if 0 <= a.hold_at_step - 1 <= live.committed_steps and not healed.exists():
            if group != a.kill_group and live.committed_steps == a.hold_at_step - 1:
                wait_for(restarted, 120)  # before the quorum of the round at hold_at_step
            time.sleep(a.step_seconds)
        strategy.run(step_fn, (batch,))
        if life and live.last_heal_seconds is not None and rank == 0 and not healed.exists():
            healed.write_text(str(live.committed_steps - 1))  # the round start it healed at
    seen.close()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   out / f"final_g{group}.pt")
        (out / f"summary_g{group}_life{life}.json").write_text(json.dumps(
            {"steps": live.committed_steps, "redone": live.redone_steps,
             "participants": live.participants, "wire": strategy.wire_stats}))
    strategy.close()


if __name__ == "__main__":
    main()
