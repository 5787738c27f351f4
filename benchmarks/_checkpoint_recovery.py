"""``recovery`` of benchmarks/checkpoint.py: seconds from a rank's death to the first step
after the launcher's restart resumed it from its backup, beside a cold start of the same job.

Run as a script, this file is the job's worker (under the local launcher).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import median  # noqa: E402
from replicator.launch.script_launch import run_script  # noqa: E402
from replicator.resume import BackupAndRestore  # noqa: E402


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256))


class RepeatedBatch:
    """The same batch ``n`` times per epoch, with an input position to back up."""

    def __init__(self, batch: tuple[torch.Tensor, ...], n: int) -> None:
        self.batch, self.n, self.position = batch, n, 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.batch
        self.position = 0


def recovery_worker(out: str) -> None:
    strategy = rp.MirroredStrategy()
    attempt = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    with strategy.scope():
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    data = RepeatedBatch((x, y), 40)
    backup = BackupAndRestore(Path(out) / "backup", save_freq=10, delete_checkpoint=True,
                              strategy=strategy).track(model=model, optimizer=opt)
    stamp = Path(out)
    kill = rp.testing.kill_rank(1, at_step=25, on_fire=lambda: (stamp / "death").write_text(
        repr(time.time())))
    first = True
    for step, (xb, yb) in backup.steps(data, num_steps=40):
        kill(step)
        F.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        if first and strategy.is_chief:
            (stamp / f"first{attempt}").write_text(repr(time.time()))
        first = False


def bench_recovery(repeats: int, tmp: Path) -> dict[str, float]:
    recovery, cold = [], []
    for i in range(repeats):
        out = tmp / f"recovery{i}"
        out.mkdir()
        start = time.time()
        run_script(os.path.abspath(__file__), [str(out)], 2,
                   max_restarts=1, timeout_seconds=60)
        read = {n: float((out / n).read_text()) for n in ("death", "first0", "first1")}
        recovery.append(read["first1"] - read["death"])
        cold.append(read["first0"] - start)
    return {"recovery": median(recovery), "cold": median(cold)}


if __name__ == "__main__":
    recovery_worker(sys.argv[1])
