"""BackupAndRestore saves the input position with the model: 2 replicas, a backup taken
mid-epoch, one rank SIGKILLed a few steps later, the job restarted: the restarted job starts at
the step after the backup, gives those steps the very batches the killed run gave them, and
every sample of each epoch is trained on exactly once (the steps up to the backup, then the
resumed ones), none twice. For an ``rp.data.Dataset`` tracked with ``track(data=...)``, and for
plain torch ``DataLoader``s through ``strategy.distribute_dataset``: a shuffling one, and one
with a sampler of its own (a restarted process drew another order for it, so the batches
skipped on resume were not the ones trained on; the loader is now re-seeded each epoch)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.cluster.environment import resolve_cluster
from replicator.data import Dataset, Options
from replicator.testing import run_distributed

N, BATCH, EPOCHS = 48, 6, 2        # 8 steps per epoch, 16 in all
SAVE_FREQ, KILL_AT = 3, 5          # backups at steps 3, 6, ...; rank 1 dies at step 5


def plus_thousand(x: torch.Tensor) -> torch.Tensor:
    return x + 1000


def build(kind: str, strategy: rp.Strategy) -> tuple[object, int]:
    """The input of one replica, and what to subtract from a batch's values to get ids."""
    if kind == "dataflow":
        ds = (Dataset.from_tensor_slices(torch.arange(N)).shuffle(N, seed=5)
              .map(plus_thousand, num_parallel_calls=2).batch(BATCH)
              .with_options(Options(cpu_budget=2)))
        return strategy.distribute_dataset(ds), 1000
    if kind == "dataloader":
        loader = torch.utils.data.DataLoader(torch.arange(N), batch_size=BATCH, shuffle=True)
    else:  # a sampler of its own: every replica runs the loader and keeps its rows
        sampler = torch.utils.data.WeightedRandomSampler(torch.ones(N), N, replacement=False)
        loader = torch.utils.data.DataLoader(torch.arange(N), batch_size=BATCH, sampler=sampler)
    return strategy.distribute_dataset(loader, seed=5), 0


def train(kind: str, out: str, backup_dir: str) -> None:
    strategy = rp.MirroredStrategy()
    rank, attempt = strategy.replica_id, resolve_cluster().restart_count
    data, offset = build(kind, strategy)
    with strategy.scope():
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    backup = rp.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ, background=False,
                                 delete_checkpoint=False)
    backup.track(model=model, optimizer=optimizer, data=data)
    kill = rp.testing.kill_rank(1, at_step=KILL_AT)
    with open(Path(out) / f"a{attempt}-r{rank}.jsonl", "a") as log:
        for step, batch in backup.steps(epochs=EPOCHS):
            kill(step)
            mask = data.mask  # type: ignore[attr-defined]
            loss = (model(batch.float().unsqueeze(1) / 2000) ** 2).mean()
            loss.backward()
            for p in model.parameters():  # the replicas stay in step, as training keeps them
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            if backup.restored is not None and step == backup.restored.step + 1:
                saved = (backup.restored.per_rank or {}).get("data")
                log.write(json.dumps({"restored_position": saved and saved["position"]}) + "\n")
            ids = [int(v) - offset for v, m in zip(batch.tolist(), mask.tolist()) if m]
            log.write(json.dumps({"step": step, "epoch": backup.epoch, "ids": ids}) + "\n")
            log.flush()


def read(out: Path, attempt: int) -> dict[int, dict]:
    """step -> {"epoch", "ids" of both ranks}, for one attempt."""
    steps: dict[int, dict] = {}
    for rank in range(2):
        path = out / f"a{attempt}-r{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            if "restored_position" in row:  # the input position the backup held
                steps.setdefault(0, {"positions": {}})["positions"][rank] = row
                continue
            entry = steps.setdefault(row["step"], {"epoch": row["epoch"], "ids": {}})
            entry["ids"][rank] = row["ids"]
    return steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["dataflow", "dataloader", "sampler"])
def test_a_killed_job_resumes_the_input_exactly(kind: str, tmp_path: Path) -> None:
    out = tmp_path / "logs"
    out.mkdir()
    os.environ.pop("REPLICATOR_RESTART_COUNT", None)
    run_distributed(train, world_size=2, args=(kind, str(out), str(tmp_path / "backup")),
                    max_restarts=1)
    killed, resumed = read(out, 0), read(out, 1)
    restored = SAVE_FREQ * ((KILL_AT - 1) // SAVE_FREQ)  # the last backup before the kill
    positions = resumed.pop(0)["positions"]  # the position was saved, not replayed
    assert all(positions[r]["restored_position"] for r in (0, 1)), positions
    assert min(resumed) == restored + 1, "the restart did not resume from the mid-epoch backup"
    assert max(resumed) == EPOCHS * N // BATCH
    assert restored + 1 in killed  # the killed run had read the step after the backup ...
    for step in set(killed) & set(resumed):  # ... and the resumed run reads the same batches
        for rank in killed[step]["ids"]:
            assert resumed[step]["ids"][rank] == killed[step]["ids"][rank], (step, rank)
    trained = {s: killed[s] for s in range(1, restored + 1)} | resumed
    assert sorted(trained) == list(range(1, max(resumed) + 1))
    for epoch in range(EPOCHS):
        seen = Counter(i for entry in trained.values() if entry["epoch"] == epoch
                       for rank in (0, 1) for i in entry["ids"][rank])
        assert sorted(seen) == list(range(N)), (epoch, sorted(set(range(N)) - set(seen)))
        assert max(seen.values()) == 1, (epoch, [i for i, c in seen.items() if c > 1])
