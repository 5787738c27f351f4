"""Experiment trackers on 2 real processes: the chief alone logs (one run, whatever the number
of replicas), and a run whose chief was killed after a backup continues the same run id with
each step logged once and the values of an uninterrupted run."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

import replicator as rp
from replicator.testing import run_distributed
from tests.tracker_helpers import (
    EPOCHS,
    STEPS_PER_EPOCH,
    KillAt,
    fit_logged,
    mlflow_history,
    mlflow_runs,
    wandb_offline_runs,
    wandb_values,
)

# Found, not imported: the workers import this module, and mlflow and wandb take 3 s or more.
pytestmark = pytest.mark.skipif(not all(find_spec(name) for name in ("mlflow", "wandb")),
                                reason="needs mlflow and wandb")

STEPS = EPOCHS * STEPS_PER_EPOCH


def logged_fit(root: str, kill_step: int | None) -> dict:
    from replicator.callbacks import MLflowLogger, WandbLogger

    out = Path(root)
    loggers = [MLflowLogger("digits", tracking_uri=(out / "mlruns").as_uri(), update_freq=1,
                            params={"global_batch": 32}),
               WandbLogger(project="digits", dir=str(out), update_freq=1)]
    fault = KillAt(0, kill_step) if kill_step is not None else None  # the chief dies
    result = fit_logged(rp.MirroredStrategy(), loggers, str(out / "backup"), fault)
    return {**result, "run_ids": [lg.run_id for lg in loggers]}


@pytest.fixture
def tracker_env(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # W&B tests earlier in this process started a service that children would share; the
    # chief must have its own (a killed chief's run stays open in a shared one)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


def _mlflow(root: Path) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    uri = (root / "mlruns").as_uri()
    [run] = mlflow_runs(uri, "digits")  # one run: only the chief logs, a resume continues it
    return run, {k: mlflow_history(uri, run.info.run_id, k)
                 for k in ("batch/loss", "epoch/loss", "epoch/accuracy")}


@pytest.mark.timeout(300)
def test_chief_logs_once_and_a_killed_run_continues_its_run_id(tmp_path, tracker_env):
    ref = run_distributed(logged_fit, 2, args=(str(tmp_path / "ref"), None))
    assert ref[1]["run_ids"] == [None, None]  # the other replica never opened a run
    ref_run, ref_metrics = _mlflow(tmp_path / "ref")
    assert ref_run.data.params["num_replicas"] == "2"  # type: ignore[attr-defined]
    assert ref_run.data.params["strategy"] == "MirroredStrategy"  # type: ignore[attr-defined]
    assert [s for s, _ in ref_metrics["batch/loss"]] == list(range(1, STEPS + 1))

    # the chief is killed at step 7, after logging it and 3 steps past the backup of step 4
    out = run_distributed(logged_fit, 2, args=(str(tmp_path / "run"), 7), max_restarts=1)
    assert out[0]["steps"] == STEPS and out[0]["history"] == ref[0]["history"]
    run, metrics = _mlflow(tmp_path / "run")
    assert run.info.run_id == out[0]["run_ids"][0]  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED"  # type: ignore[attr-defined]
    assert metrics == ref_metrics  # every step once, with the uninterrupted run's values

    ref_wb = wandb_offline_runs(tmp_path / "ref")
    killed, resumed = wandb_offline_runs(tmp_path / "run")  # folders in time order
    assert killed["id"] == resumed["id"] == out[0]["run_ids"][1]
    # what W&B had written of the killed process (it flushes every 15 s), then the resumed
    # run from the backup of step 4 on, with the uninterrupted run's values
    assert set(s for s, _ in wandb_values([killed], "batch/loss")) <= set(range(1, 8))
    assert wandb_values([resumed], "batch/loss") == wandb_values(ref_wb, "batch/loss")[4:]
