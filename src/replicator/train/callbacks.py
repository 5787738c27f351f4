"""Callbacks with Keras's hook names. Every replica runs every callback (so any collective a
callback makes is matched on all ranks); only the chief prints or writes files.

``logs`` values are already reduced across replicas, so decisions taken from them (early
stopping, NaN checks) are the same on every replica.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from replicator.train.trainer import Trainer

Logs = dict[str, float]


class Callback:
    """Base class: override the hooks you need. ``self.trainer`` is set before training."""

    trainer: Trainer

    def set_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def is_chief(self) -> bool:
        return self.trainer.strategy.is_chief

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...


class History(Callback):
    """Per-epoch logs: ``history.history["loss"]`` is the list of epoch losses."""

    def __init__(self) -> None:
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in
                                                       self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = list(state["epoch"])
        self.history = {k: list(v) for k, v in state["history"].items()}


def _better(mode: str, monitor: str) -> Callable[[float, float, float], bool]:
    if mode == "auto":
        mode = "max" if any(w in monitor for w in ("acc", "auc")) else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode == "min":
        return lambda current, best, delta: current < best - delta
    return lambda current, best, delta: current > best + delta


def _monitored(logs: Logs | None, monitor: str, who: str) -> float | None:
    if not logs or monitor not in logs:
        return None
    return float(logs[monitor])


class EarlyStopping(Callback):
    """Stop when ``monitor`` stops improving for ``patience`` epochs."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0,
                 mode: str = "auto", restore_best_weights: bool = False) -> None:
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.better = _better(mode, monitor)
        self.restore_best_weights = restore_best_weights
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.best, self.wait, self.stopped_epoch, self._best_weights = None, 0, None, None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        current = _monitored(logs, self.monitor, "EarlyStopping")
        if current is None:
            return
        if self.best is None or self.better(current, self.best, self.min_delta):
            self.best, self.wait = current, 0
            if self.restore_best_weights:
                self._best_weights = {k: v.detach().clone()
                                      for k, v in self.trainer.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self._best_weights is not None:
                self.trainer.model.load_state_dict(self._best_weights)


def _atomic_save_weights(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ModelCheckpoint(Callback):
    """The chief saves the model's weights (safetensors) after each epoch, or only when
    ``monitor`` improves with ``save_best_only=True``. ``filepath`` may use ``{epoch}`` and
    log names, e.g. ``"ckpt/weights-{epoch:02d}-{val_loss:.3f}.safetensors"``."""

    def __init__(self, filepath: str, monitor: str = "val_loss", save_best_only: bool = False,
                 mode: str = "auto") -> None:
        self.filepath, self.monitor, self.save_best_only = filepath, monitor, save_best_only
        self.better = _better(mode, monitor)
        self.best: float | None = None
        self.saved: list[str] = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs or {}
        if self.save_best_only:
            current = _monitored(logs, self.monitor, "ModelCheckpoint")
            if current is None:
                raise KeyError(f"ModelCheckpoint monitors {self.monitor!r} but the logs hold "
                               f"only {sorted(logs)}; pass validation_data or another monitor")
            if self.best is not None and not self.better(current, self.best, 0.0):
                return
            self.best = current
        path = self.filepath.format(epoch=epoch + 1, **logs)
        if self.is_chief:
            _atomic_save_weights(self.trainer.model, path)
        self.saved.append(path)


class LearningRateScheduler(Callback):
    """Set the learning rate at each epoch's start: ``schedule(epoch, lr) -> lr``, or step a
    ``torch.optim.lr_scheduler`` object once per epoch."""

    def __init__(self, schedule: Callable[[int, float], float] | Any) -> None:
        self.schedule = schedule

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if hasattr(self.schedule, "step") and hasattr(self.schedule, "get_last_lr"):
            if epoch > 0:
                self.schedule.step()
            return
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = float(self.schedule(epoch, float(group["lr"])))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(self.trainer.optimizer.param_groups[0]["lr"])


class CSVLogger(Callback):
    """The chief appends one row of logs per epoch to ``filename``."""

    def __init__(self, filename: str, append: bool = False) -> None:
        self.filename, self.append = filename, append
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.is_chief and not self.append and os.path.exists(self.filename):
            os.remove(self.filename)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
        new = not os.path.exists(self.filename)
        with open(self.filename, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["epoch", *self._keys])
            writer.writerow([epoch, *(logs.get(k, "") for k in self._keys)])


class TensorBoard(Callback):
    """Scalars per epoch (and every ``update_freq`` batches) for TensorBoard; the chief writes.

    Needs the optional ``tensorboard`` package (``pip install tensorboard``).
    """

    def __init__(self, log_dir: str = "logs", update_freq: str | int = "epoch") -> None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ImportError("the TensorBoard callback needs the tensorboard package: "
                              "pip install tensorboard") from None
        self.log_dir, self.update_freq = log_dir, update_freq
        self._writer: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.is_chief:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._writer is not None and isinstance(self.update_freq, int) \
                and self.trainer.global_step % self.update_freq == 0:
            for k, v in (logs or {}).items():
                self._writer.add_scalar(f"batch/{k}", v, self.trainer.global_step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._writer is not None:
            for k, v in (logs or {}).items():
                self._writer.add_scalar(f"epoch/{k}", v, epoch)
            self._writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class TerminateOnNaN(Callback):
    """Stop training when the (cross-replica) loss becomes NaN or infinite."""

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            if self.is_chief:
                print(f"TerminateOnNaN: loss is {loss} at step {self.trainer.global_step}; "
                      "stopping", flush=True)
            self.trainer.stop_training = True


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_end", "on_predict_begin", "on_predict_end")


class CallbackList:
    """Calls a hook on every callback, in order."""

    def __init__(self, callbacks: Iterable[Callback], trainer: Trainer) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not any(hasattr(cb, h) for h in _HOOKS):
                raise TypeError(f"{cb!r} is not a callback: it has none of the hooks "
                                f"{', '.join(_HOOKS)}")
            if hasattr(cb, "set_trainer"):
                cb.set_trainer(trainer)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)
