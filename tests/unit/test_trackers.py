"""MLflow, W&B and TensorBoard loggers on one device: what a run records, and a run that
failed after a backup continues the same run with no step logged twice."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

import replicator as rp
from replicator.train.trackers import MLflowLogger, WandbLogger
from tests.tracker_helpers import (
    EPOCHS,
    STEPS_PER_EPOCH,
    FailAt,
    fit_logged,
    mlflow_history,
    mlflow_runs,
    wandb_offline_runs,
    wandb_values,
)

STEPS = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks before a file store
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    if "wandb" in sys.modules:  # stop the W&B service this process started (and forget it)
        sys.modules["wandb"].teardown()
        os.environ.pop("WANDB_SERVICE", None)


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'replicator\[mlflow\]'"):
        MLflowLogger()
    with pytest.raises(ImportError, match=r"pip install 'replicator\[wandb\]'"):
        WandbLogger()


def test_bad_options_are_refused():
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="update_freq"):
        MLflowLogger(update_freq=0)
    with pytest.raises(ValueError, match="sets id itself"):
        WandbLogger(id="abc")


def test_callbacks_namespace_holds_every_callback():
    import replicator.callbacks as callbacks

    assert callbacks.MLflowLogger is MLflowLogger and callbacks.WandbLogger is WandbLogger
    for name in ("BackupAndRestore", "EarlyStopping", "ModelCheckpoint", "CSVLogger",
                 "TensorBoard", "TerminateOnNaN", "ProgressBar", "LearningRateScheduler"):
        assert issubclass(getattr(callbacks, name), object), name


def test_mlflow_records_hyperparameters_and_metrics(tracker_env):
    pytest.importorskip("mlflow")
    uri = (tracker_env / "mlruns").as_uri()
    logger = MLflowLogger("digits", tracking_uri=uri, params={"batch": 32}, update_freq=2)
    out = fit_logged(rp.OneDeviceStrategy("cpu"), [logger], None)
    [run] = mlflow_runs(uri, "digits")
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    params = run.data.params
    assert params["strategy"] == "OneDeviceStrategy" and params["num_replicas"] == "1"
    assert params["epochs"] == str(EPOCHS) and params["batch"] == "32"
    assert params["optimizer"] == "Adam" and float(params["lr"]) == 0.05
    assert run.data.tags["replicator.num_replicas"] == "1"
    assert mlflow_history(uri, logger.run_id, "epoch/loss") == \
        list(enumerate(pytest.approx(v) for v in out["history"]["loss"]))
    assert [s for s, _ in mlflow_history(uri, logger.run_id, "batch/loss")] == \
        list(range(2, STEPS + 1, 2))


def test_wandb_offline_records_config_and_metrics(tracker_env):
    pytest.importorskip("wandb")
    logger = WandbLogger(project="digits", params={"batch": 32}, update_freq=1)
    out = fit_logged(rp.OneDeviceStrategy("cpu"), [logger], None)
    [run] = wandb_offline_runs(tracker_env)
    assert run["id"] == logger.run_id
    config = run["config"]
    assert config["strategy"] == "OneDeviceStrategy" and config["num_replicas"] == 1
    assert config["batch"] == 32 and config["epochs"] == EPOCHS
    assert [s for s, _ in wandb_values([run], "batch/loss")] == list(range(1, STEPS + 1))
    assert [v for _, v in wandb_values([run], "epoch/loss", "epoch")] == \
        pytest.approx(out["history"]["loss"])


class _FakeWriter:
    """torch's SummaryWriter, recording its scalars (no tensorboard package needed)."""

    scalars: list[tuple[str, str, float, int]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((self.log_dir, tag, float(value), int(step)))

    def flush(self) -> None: ...
    def close(self) -> None: ...


@pytest.fixture
def fake_tensorboard(monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    _FakeWriter.scalars = []
    return _FakeWriter


def _make(kind: str, root: Path) -> rp.Callback:
    if kind == "mlflow":
        return MLflowLogger("digits", tracking_uri=(root / "mlruns").as_uri(), update_freq=1)
    if kind == "wandb":
        return WandbLogger(project="digits", dir=str(root), update_freq=1)
    return rp.callbacks.TensorBoard(str(root / "tb"), update_freq=1)


def _logged(kind: str, root: Path, key: str) -> list[tuple[int, float]]:
    if kind == "mlflow":
        [run] = mlflow_runs((root / "mlruns").as_uri(), "digits")  # one run, resumed
        return mlflow_history((root / "mlruns").as_uri(), run.info.run_id, key)
    return sorted((s, v) for d, t, v, s in _FakeWriter.scalars
                  if t == key and d == str(root / "tb"))


def _fail_then_resume(kind: str, tmp: Path) -> tuple[Path, Path, rp.Callback, rp.Callback]:
    """A reference run, and a run that fails at step 7 (after the backup of step 4, in
    epoch 2) and is run again with a new logger on the same backup directory."""
    ref_root, run_root = tmp / "ref", tmp / "run"
    ref_root.mkdir(), run_root.mkdir()
    fit_logged(rp.OneDeviceStrategy("cpu"), [_make(kind, ref_root)], str(ref_root / "backup"))
    backup = str(run_root / "backup")
    fault = FailAt(7, run_root / "failed")
    first = _make(kind, run_root)
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        fit_logged(rp.OneDeviceStrategy("cpu"), [first], backup, fault)
    if kind == "wandb":
        first.run.finish()  # type: ignore[attr-defined]  # what a failed process's end does
    second = _make(kind, run_root)
    fit_logged(rp.OneDeviceStrategy("cpu"), [second], backup, fault)
    return ref_root, run_root, first, second


@pytest.mark.parametrize("kind", ["mlflow", "tensorboard"])
def test_a_resumed_run_continues_the_run_without_logging_a_step_twice(
        kind, tracker_env, fake_tensorboard):
    if kind != "tensorboard":
        pytest.importorskip(kind)
    ref_root, run_root, first, second = _fail_then_resume(kind, tracker_env)
    if kind == "mlflow":
        assert second.run_id == first.run_id  # type: ignore[attr-defined]
    for key in ("batch/loss", "epoch/loss", "epoch/accuracy"):
        got, want = _logged(kind, run_root, key), _logged(kind, ref_root, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # each step once
        assert got == want, key  # the resume is exact: the same values
    assert not (run_root / "backup" / "trackers").exists()  # the ledger went with the run


def test_wandb_offline_resume_continues_the_run_id_from_the_backup(tracker_env):
    pytest.importorskip("wandb")
    ref_root, run_root, first, second = _fail_then_resume("wandb", tracker_env)
    assert second.run_id == first.run_id  # type: ignore[attr-defined]
    ref = wandb_offline_runs(ref_root)
    failed, resumed = wandb_offline_runs(run_root)  # folders in time order
    assert failed["id"] == resumed["id"] == first.run_id  # type: ignore[attr-defined]
    assert [s for s, _ in wandb_values([failed], "batch/loss")] == list(range(1, 8))
    # offline, W&B cannot tell what the failed process wrote: logging goes on from the backup
    assert wandb_values([resumed], "batch/loss") == wandb_values(ref, "batch/loss")[4:]
    assert wandb_values([resumed], "epoch/loss", "epoch") == \
        wandb_values(ref, "epoch/loss", "epoch")[1:]


def test_tensorboard_files_of_a_resumed_run_hold_each_step_once(tracker_env):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    backup, log_dir = str(tracker_env / "backup"), tracker_env / "tb"
    fault = FailAt(7, tracker_env / "failed")
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        fit_logged(rp.OneDeviceStrategy("cpu"), [rp.TensorBoard(str(log_dir), 1)], backup, fault)
    fit_logged(rp.OneDeviceStrategy("cpu"), [rp.TensorBoard(str(log_dir), 1)], backup, fault)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one file per attempt
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("batch/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in events.Scalars("epoch/loss")] == list(range(EPOCHS))
