"""Reading back what the experiment-tracker loggers wrote (MLflow file store, W&B offline
files, TensorBoard calls), and a training run they log (module level, for the workers)."""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import replicator as rp
from tests.train_helpers import digits, loader, model_fn

EPOCHS, STEPS_PER_EPOCH, SAVE_FREQ = 4, 3, 4  # 96 samples, global batch 32: 12 steps


class FailAt(rp.Callback):
    """Raise at a global step on the first attempt only (a file remembers the attempt)."""

    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("failed once")
            raise RuntimeError(f"injected failure at step {self.step}")


class KillAt(rp.Callback):
    """SIGKILL a rank at a global step, on the first attempt only."""

    def __init__(self, rank: int, step: int) -> None:
        self.fault = rp.testing.kill_rank(rank, at_step=step)

    def on_train_batch_end(self, batch, logs=None):
        self.fault(self.trainer.global_step)


def fit_logged(strategy: rp.Strategy, loggers: list[rp.Callback], backup_dir: str | None,
               fault: rp.Callback | None = None) -> dict[str, Any]:
    """Train digits for 12 steps with the loggers (and a backup every 4 steps)."""
    train, _ = digits(STEPS_PER_EPOCH * 32)
    trainer = rp.Trainer(strategy, model_fn, lambda p: torch.optim.Adam(p, lr=0.05),
                         nn.CrossEntropyLoss(), metrics=["accuracy"])
    callbacks: list[Any] = list(loggers)
    if fault is not None:
        callbacks.append(fault)  # after the loggers: the failing step is logged first
    if backup_dir is not None:
        from replicator.resume import BackupAndRestore

        callbacks.append(BackupAndRestore(backup_dir, save_freq=SAVE_FREQ, background=False))
    history = trainer.fit(loader(train), epochs=EPOCHS, callbacks=callbacks, verbose=0)
    return {"history": history.history, "steps": trainer.global_step}


# -- MLflow ----------------------------------------------------------------------------------
def mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    points = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in points)


# -- W&B offline files -------------------------------------------------------------------------
_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed records


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left  # block trailer or padding
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_offline_runs(wandb_dir: Path, wait_seconds: float = 30.0) -> list[dict[str, Any]]:
    """Every offline run folder, oldest first: its run id, config and history rows. W&B's
    service writes the files after ``finish()`` returns, so this waits until the newest
    holds its run and no file has grown for a second (a killed process's may stay empty)."""
    deadline = time.monotonic() + wait_seconds
    seen: list[dict[Path, int]] = []
    while True:
        files = sorted((wandb_dir / "wandb").glob("offline-run-*/*.wandb"))
        seen = [*seen[-1:], {f: f.stat().st_size for f in files}]
        runs = _read_offline_runs(wandb_dir)
        settled = len(seen) == 2 and seen[0] == seen[1] and bool(runs) and runs[-1]["rows"]
        if settled or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def _read_offline_runs(wandb_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        named = re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", folder.name)
        run: dict[str, Any] = {"folder": folder.name, "config": {}, "rows": [],
                               "id": named.group(1) if named else None}
        for f in folder.glob("*.wandb"):
            for record in _wandb_records(f):
                kind = record.WhichOneof("record_type")
                if kind == "run":
                    run["id"] = record.run.run_id
                    run["config"].update({i.key: json.loads(i.value_json)
                                          for i in record.run.config.update})
                elif kind == "config":
                    run["config"].update({i.key: json.loads(i.value_json)
                                          for i in record.config.update})
                elif kind == "history":
                    run["rows"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                        for i in record.history.item})
        runs.append(run)
    return runs


def wandb_steps(runs: list[dict[str, Any]], key: str) -> list[int]:
    """The W&B steps of every row holding ``key``, over all the runs' folders."""
    return sorted(row["_step"] for run in runs for row in run["rows"] if key in row)


def wandb_values(runs: list[dict[str, Any]], key: str, index: str = "_step") \
        -> list[tuple[int, float]]:
    return sorted((row[index], row[key]) for run in runs for row in run["rows"] if key in row)
