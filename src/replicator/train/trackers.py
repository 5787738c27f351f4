"""Experiment trackers for the Trainer: :class:`MLflowLogger`, :class:`WandbLogger` and
:class:`TensorBoard`. Every replica runs the callback; only the chief talks to the tracker, one
run per job: the hyper-parameters, metrics per epoch (``epoch/<name>``) and, with an integer
``update_freq``, every that many steps (``batch/<name>``, step = global step). A run resumed by
:class:`~replicator.BackupAndRestore` continues the same run and sends no step twice."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from replicator.checkpoint.store import check_location, is_remote, upload_tree
from replicator.resume.backup_and_restore import check_frequency
from replicator.train.callbacks import Callback, Logs


class TrackerLedger:
    """The last global step (0: none) and epoch (-1: none) a logger sent to its run. A worker
    dying at step 37 after the backup of step 32 has sent 33 to 37, which the exact resume
    replays, and trackers cannot delete a point: so the chief keeps this ledger beside the
    backups (``<backup_dir>/trackers/<name>.json``, rewritten atomically per send) and a resume
    skips up to the later of ledger and backup."""

    def __init__(self) -> None:
        self.step, self.epoch = 0, -1
        self._path: Path | None = None

    def state(self) -> dict[str, int]:
        """For the logger's ``state_dict`` (what a backup holds)."""
        return {"step": self.step, "epoch": self.epoch}

    def attach(self, trainer: Any, name: str | None, state: dict[str, Any] | None) -> None:
        """Start from a backup's ``state`` (None: a fresh run); on the chief, keep the ledger
        ``name`` (None: none) in the trainer's backup directory and take in what it records."""
        saved = state or {}
        self.step, self.epoch = int(saved.get("step", 0)), int(saved.get("epoch", -1))
        backup = getattr(trainer, "backup", None)
        backup_dir = None if backup is None else backup.backup_dir
        self._path = None if backup_dir is None or name is None else \
            Path(backup_dir) / "trackers" / f"{name}.json"
        if state is None or self._path is None:
            return
        try:
            recorded = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return  # none yet (nothing sent since the backup), or torn by a crash
        self.step = max(self.step, int(recorded.get("step", 0)))
        self.epoch = max(self.epoch, int(recorded.get("epoch", -1)))

    def sent(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Record a send (call after the tracker accepted it)."""
        self.step = max(self.step, step or 0)
        self.epoch = max(self.epoch, -1 if epoch is None else epoch)
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.state()))
        os.replace(tmp, self._path)

    def close(self) -> None:
        """Training completed: remove the ledger (and its folder once empty)."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other loggers' ledgers are still there
                self._path.parent.rmdir()
            self._path = None


def _require(module: str, logger: str, install: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"{logger} needs the {module} package, which is not installed. "
                          f"HINT: pip install {install}") from None


class RunLogger(Callback, ABC):
    """The part every tracker shares: when to log, what the run records, how a run resumes. A
    tracker implements the abstract methods below; only the chief calls them."""

    #: Names the ledger file (``<name>-<run id>.json``).
    tracker = "tracker"
    #: Keep a ledger (:class:`TrackerLedger`): right for a tracker whose sends are written when
    #: the call returns; one that writes later is asked (:meth:`_last_step_in_tracker`).
    keeps_ledger = True

    def __init__(self, params: dict[str, Any] | None, update_freq: str | int) -> None:
        self.params = dict(params or {})
        self.update_freq = check_frequency(update_freq, "update_freq")
        #: The tracker's id of the run (set on the chief when training starts).
        self.run_id: str | None = None
        self._ledger = TrackerLedger()
        self._restored: dict[str, Any] | None = None
        self._open = False

    def hyperparameters(self) -> dict[str, Any]:
        """``params`` plus the strategy, replicas, epochs and optimizer of the trainer."""
        trainer, optimizer = self.trainer, self.trainer.optimizer
        return {"strategy": type(trainer.strategy).__name__,
                "num_replicas": trainer.strategy.num_replicas_in_sync, "epochs": trainer.epochs,
                "optimizer": type(optimizer).__name__, "lr": optimizer.param_groups[0].get("lr"),
                **self.params}

    def state_dict(self) -> dict[str, Any]:
        """The run id and what was logged so far (a backup holds the chief's)."""
        return {"run_id": self.run_id, **self._ledger.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = dict(state)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        # the run opens at the first epoch: a resume (load_state_dict) comes after this hook
        self._restored, self._open = None, False

    def _ensure_open(self) -> None:
        if self._open or not self.is_chief:
            return
        restored = self._restored
        if run_id := (restored or {}).get("run_id"):
            self.run_id = str(run_id)
            self._resume_run(self.run_id)
        else:
            restored = None  # a backup taken before any run opened: nothing was logged
            self.run_id = self._start_run()
        self._ledger.attach(self.trainer, f"{self.tracker}-{self.run_id}"
                            if self.keeps_ledger else None, restored)
        if restored is not None:
            self._ledger.step = max(self._ledger.step, self._last_step_in_tracker())
        self._open = True

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._ensure_open()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        step = self.trainer.global_step
        if not self.is_chief or self.update_freq == "epoch" or not logs \
                or step % int(self.update_freq) != 0:
            return
        self._ensure_open()
        if step > self._ledger.step:
            self._log({f"batch/{k}": float(v) for k, v in logs.items()}, step)
            self._ledger.sent(step=step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.is_chief or not logs:
            return
        self._ensure_open()
        if epoch > self._ledger.epoch:
            self._log({f"epoch/{k}": float(v) for k, v in logs.items()}, epoch)
            self._ledger.sent(epoch=epoch)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._open:
            self._finish_run()
            self._ledger.close()
            self._open = False

    @abstractmethod
    def _start_run(self) -> str:
        """Open a new run in the tracker; its id."""

    @abstractmethod
    def _resume_run(self, run_id: str) -> None:
        """Reopen the run ``run_id`` (after a resume from a backup)."""

    @abstractmethod
    def _log(self, metrics: dict[str, float], step: int) -> None:
        """Send ``metrics`` at global step ``step``."""

    @abstractmethod
    def _finish_run(self) -> None:
        """Close the run as finished."""

    def _last_step_in_tracker(self) -> int:
        """After a resume: the last global step the tracker itself holds (0: unknown)."""
        return 0


class MLflowLogger(RunLogger):
    """Log the run to MLflow (``pip install 'replicator[mlflow]'``, ``mlflow-skinny``):
    ``experiment_name`` (created if missing), ``tracking_uri`` (``None``: MLflow's default; a
    ``file://`` store wants ``MLFLOW_ALLOW_FILE_STORE=true`` in MLflow 3), ``run_name``, ``tags``,
    ``params`` and ``update_freq``."""

    tracker = "mlflow"

    def __init__(self, experiment_name: str = "replicator", tracking_uri: str | None = None,
                 run_name: str | None = None, params: dict[str, Any] | None = None,
                 tags: dict[str, str] | None = None, update_freq: str | int = "epoch") -> None:
        _require("mlflow", "MLflowLogger", "'replicator[mlflow]'")
        super().__init__(params, update_freq)
        self.experiment_name, self.tracking_uri = experiment_name, tracking_uri
        self.run_name, self.tags = run_name, dict(tags or {})
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The ``mlflow.tracking.MlflowClient`` (created on first use, on the chief)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _start_run(self) -> str:
        from mlflow.entities import Param

        client = self.client
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment is not None \
            else client.create_experiment(self.experiment_name)
        hparams = self.hyperparameters()
        tags = {"replicator.strategy": str(hparams["strategy"]),
                "replicator.num_replicas": str(hparams["num_replicas"]), **self.tags}
        run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        client.log_batch(run.info.run_id,
                         params=[Param(k, str(v)[:6000]) for k, v in hparams.items()])
        return str(run.info.run_id)

    def _resume_run(self, run_id: str) -> None:
        try:
            self.client.update_run(run_id, status="RUNNING")
        except Exception as exc:  # mlflow's MlflowException (RESOURCE_DOES_NOT_EXIST, ...)
            raise RuntimeError(
                f"MLflowLogger: the backup names run {run_id}, which the tracking store "
                f"{self.client.tracking_uri!r} cannot resume: {exc}. HINT: resume with the "
                "tracking_uri of the run that wrote the backup, or use a new backup_dir.") \
                from exc

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        assert self.run_id is not None
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in metrics.items()])

    def _finish_run(self) -> None:
        assert self.run_id is not None
        self.client.set_terminated(self.run_id, "FINISHED")


class WandbLogger(RunLogger):
    """Log the run to Weights & Biases (``pip install 'replicator[wandb]'``): ``project``,
    ``entity``, ``name``, ``tags``, ``dir``, ``mode`` (or ``WANDB_MODE``) and ``init_kwargs`` (not
    ``id``/``resume``) go to ``wandb.init``. W&B's step is the global step. W&B writes later, from
    its own process, so on a resume online the run continues after the server's last step
    (``run.step``); offline it logs again from the backup's step into a new folder, same id."""

    tracker = "wandb"
    keeps_ledger = False

    def __init__(self, project: str | None = None, entity: str | None = None,
                 name: str | None = None, params: dict[str, Any] | None = None,
                 tags: list[str] | None = None, mode: str | None = None,
                 dir: str | None = None, update_freq: str | int = "epoch",
                 **init_kwargs: Any) -> None:
        _require("wandb", "WandbLogger", "'replicator[wandb]'")
        if clash := sorted({"id", "resume", "config"} & set(init_kwargs)):
            raise ValueError(f"WandbLogger sets {', '.join(clash)} itself. HINT: pass the "
                             "hyper-parameters as params=...; a resumed run keeps its id.")
        super().__init__(params, update_freq)
        self.init_kwargs = {"project": project, "entity": entity, "name": name, "tags": tags,
                            "mode": mode, "dir": dir, **init_kwargs}
        self.run: Any = None

    def _init(self, run_id: str, config: dict[str, Any] | None) -> None:
        import wandb

        kwargs = {k: v for k, v in self.init_kwargs.items() if v is not None}
        kwargs.setdefault("reinit", "create_new")  # never hand back another run of the process
        try:
            self.run = wandb.init(id=run_id, resume="allow", config=config, **kwargs)
        except Exception as exc:
            if "in use" not in str(exc) or not os.environ.get("WANDB_SERVICE"):
                raise
            raise RuntimeError(
                f"WandbLogger: W&B run {run_id} is still open in the W&B service this process "
                f"inherited from its parent (WANDB_SERVICE): {exc}. HINT: a worker killed "
                "before the restart left it open there; start the workers without "
                "WANDB_SERVICE in their environment, so each chief runs its own service.") \
                from exc
        self.run.define_metric("epoch")
        self.run.define_metric("epoch/*", step_metric="epoch")

    def _start_run(self) -> str:
        run_id = secrets.token_hex(8)  # W&B's ids: letters and digits
        self._init(run_id, self.hyperparameters())
        return run_id

    def _resume_run(self, run_id: str) -> None:
        self._init(run_id, None)

    def _last_step_in_tracker(self) -> int:
        return max(0, int(getattr(self.run, "step", 0) or 0) - 1)  # run.step: the next one

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if any(k.startswith("epoch/") for k in metrics):
            metrics = {**metrics, "epoch": step}
        self.run.log(metrics, step=self.trainer.global_step)

    def _finish_run(self) -> None:
        self.run.finish()
        self.run = None


class TensorBoard(RunLogger):
    """Scalars per epoch (and every ``update_freq`` batches) for TensorBoard (``pip install
    tensorboard``); a resumed run appends to ``log_dir`` with no step twice."""

    tracker = "tensorboard"

    def __init__(self, log_dir: str = "logs", update_freq: str | int = "epoch") -> None:
        check_location(log_dir, "TensorBoard's log_dir")
        _require("tensorboard", "the TensorBoard callback", "tensorboard")
        super().__init__(None, update_freq)
        self.log_dir = log_dir
        self._writer: Any = None
        self._local: str | None = None

    def _start_run(self) -> str:
        from torch.utils.tensorboard import SummaryWriter

        # a URL: events are written to a local folder and copied there at each flush
        self._local = tempfile.mkdtemp(prefix="replicator-tb-") if is_remote(self.log_dir) else None
        self._writer = SummaryWriter(self._local or self.log_dir)
        where = self.log_dir if self._local else os.path.abspath(self.log_dir)
        return hashlib.sha1(where.encode()).hexdigest()[:12]

    def _resume_run(self, run_id: str) -> None:
        self._start_run()

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()
        if self._local is not None:
            upload_tree(self._local, self.log_dir)

    def _finish_run(self) -> None:
        self._writer.close()
        if self._local is not None:
            upload_tree(self._local, self.log_dir)
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None
        self._writer = None
