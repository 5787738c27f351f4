"""Callbacks with Keras's hook names. Every replica runs every callback (so collectives
match); only the chief prints or writes files. ``logs`` are already reduced across replicas,
so decisions taken from them are the same everywhere."""

from __future__ import annotations

import csv
import io
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from replicator.checkpoint.atomic import write_atomic
from replicator.checkpoint.serialization import refuse_placeholders
from replicator.checkpoint.store import check_location, is_remote, read_url, write_url
from replicator.cluster.terminal import is_live_terminal
from replicator.resume.backup_and_restore import BackupAndRestore
from replicator.resume.rank_state import has_state

if TYPE_CHECKING:
    from replicator.strategies.base import Strategy


class Trainer(Protocol):
    """What a callback sees of the trainer that runs it (``rp.Trainer`` is one); a protocol
    here so the callbacks need not import the trainer that imports them."""

    strategy: Strategy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    epochs: int
    step_in_epoch: int
    steps_in_epoch: int
    global_step: int
    last_global_batch: float
    stop_training: bool

Logs = dict[str, float]


class Callback:
    """Base class: override the hooks you need. ``self.trainer`` is set before training, and
    ``self.is_chief`` (the trainer's ``strategy.is_chief``) with it."""

    trainer: Trainer
    is_chief: bool

    def set_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.is_chief = trainer.strategy.is_chief

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

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as if never stopped: plain data (numbers,
        strings, lists, dicts) and tensors only, saved in a ``BackupAndRestore`` backup."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; called on resume, after ``on_train_begin``."""


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
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in self.history.items()}}

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


def _monitored(logs: Logs | None, monitor: str) -> float | None:
    value = (logs or {}).get(monitor)
    return None if value is None else float(value)


class EarlyStopping(Callback):
    """Stop when ``monitor`` stops improving for ``patience`` epochs."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0,
                 mode: str = "auto", restore_best_weights: bool = False) -> None:
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.better, self.restore_best_weights = _better(mode, monitor), restore_best_weights
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.best, self.wait, self.stopped_epoch, self._best_weights = None, 0, None, None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if (current := _monitored(logs, self.monitor)) is None:
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

    def state_dict(self) -> dict[str, Any]:
        """The best value so far, the epochs waited, and the best weights if kept."""
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch,
                "best_weights": self._best_weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.wait = int(state["wait"])
        self.stopped_epoch = state["stopped_epoch"]
        weights = state.get("best_weights")
        self._best_weights = None if weights is None else dict(weights)


def _read(location: str) -> bytes | None:
    """The bytes at a local path or a URL (``None``: nothing there)."""
    if is_remote(location):
        return read_url(location)
    return Path(location).read_bytes() if os.path.exists(location) else None


def _write(location: str, data: bytes) -> None:
    """Replace a local file (atomically) or an object (one PUT is atomic) by ``data``."""
    if is_remote(location):
        write_url(location, data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(location)), exist_ok=True)
    write_atomic(location, data)


def _atomic_save_weights(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``state`` (a full state dict) as a safetensors file, atomically; a state with
    placeholders (a pipeline rank's own part) is refused."""
    from safetensors.torch import save

    refuse_placeholders(state, "ModelCheckpoint")
    _write(path, save({k: v.detach().cpu().contiguous() for k, v in state.items()}))


class ModelCheckpoint(Callback):
    """The chief saves ``strategy.full_state_dict(model)`` (safetensors, a split model whole)
    after each epoch, or when ``monitor`` improves with ``save_best_only=True``. ``filepath``
    may use ``{epoch}`` and log names (``"ckpt/w-{epoch:02d}-{val_loss:.3f}.safetensors"``)."""

    def __init__(self, filepath: str, monitor: str = "val_loss", save_best_only: bool = False,
                 mode: str = "auto") -> None:
        check_location(filepath, "ModelCheckpoint's filepath")
        self.filepath, self.monitor, self.save_best_only = filepath, monitor, save_best_only
        self.better = _better(mode, monitor)
        self.best: float | None = None
        self.saved: list[str] = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs or {}
        if self.save_best_only:
            if (current := _monitored(logs, self.monitor)) is None:
                raise KeyError(f"ModelCheckpoint monitors {self.monitor!r} but the logs hold "
                               f"only {sorted(logs)}; pass validation_data or another monitor")
            if self.best is not None and not self.better(current, self.best, 0.0):
                return
            self.best = current
        path = self.filepath.format(epoch=epoch + 1, **logs)
        state = self.trainer.strategy.full_state_dict(self.trainer.model)  # every rank
        if self.is_chief:
            _atomic_save_weights(state, path)
        self.saved.append(path)

    def state_dict(self) -> dict[str, Any]:
        """The best monitored value so far and the files written."""
        return {"best": self.best, "saved": list(self.saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.saved = list(state["saved"])


class LearningRateScheduler(Callback):
    """Set the learning rate at each epoch's start: ``schedule(epoch, lr) -> lr``, or step a
    ``torch.optim.lr_scheduler`` object once per epoch."""

    def __init__(self, schedule: Callable[[int, float], float] | Any) -> None:
        self.schedule: Any = schedule

    def _is_torch_scheduler(self) -> bool:
        return hasattr(self.schedule, "step") and hasattr(self.schedule, "get_last_lr")

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if self.trainer.step_in_epoch > 0:
            return  # resumed in the middle of this epoch: its rate is already set
        if self._is_torch_scheduler():
            if epoch > 0:
                self.schedule.step()
            return
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = float(self.schedule(epoch, float(group["lr"])))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(self.trainer.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """A ``torch.optim.lr_scheduler``'s state (the rate itself is in the optimizer's)."""
        if self._is_torch_scheduler() and callable(getattr(self.schedule, "state_dict", None)):
            return {"scheduler": self.schedule.state_dict()}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state:
            self.schedule.load_state_dict(state["scheduler"])


class CSVLogger(Callback):
    """The chief writes one row of logs per epoch to ``filename`` (``append=False``: a new file);
    a resumed run cuts rows past the restored epoch, so the file equals an uninterrupted run's."""

    def __init__(self, filename: str, append: bool = False) -> None:
        check_location(filename, "CSVLogger's file")
        self.filename, self.append = filename, append
        self._keys: list[str] | None = None
        self._size = 0  # bytes of the file that belong to this run's past (chief)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._keys = None
        old = _read(self.filename) if self.is_chief and self.append else None
        self._size = len(old or b"")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
        if not self.is_chief:
            return
        text = io.StringIO(newline="")
        rows = [] if self._size else [["epoch", *self._keys]]
        csv.writer(text).writerows([*rows, [epoch, *(logs.get(k, "") for k in self._keys)]])
        # rows past the restored epoch (or an old file) go; the file is rewritten whole
        kept = (_read(self.filename) or b"")[:self._size] if self._size else b""
        data = kept + text.getvalue().encode()
        _write(self.filename, data)
        self._size = len(data)

    def state_dict(self) -> dict[str, Any]:
        """The columns and how many bytes of the file the epochs so far wrote."""
        return {"keys": self._keys, "size": self._size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = state["keys"]
        self._keys = None if keys is None else [str(k) for k in keys]
        self._size = int(state["size"])
        data = _read(self.filename) if self.is_chief else None
        if data is not None and len(data) < self._size:
            raise ValueError(
                f"CSVLogger: {self.filename} holds {len(data)} bytes but the backup says the "
                f"epochs so far wrote {self._size}. HINT: the log was changed or removed since "
                "the backup; restore it or use a new backup_dir.")


class TerminateOnNaN(Callback):
    """Stop training when the (cross-replica) loss becomes NaN or infinite."""

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if (loss := (logs or {}).get("loss")) is not None and not math.isfinite(loss):
            if self.is_chief:
                print(f"TerminateOnNaN: loss is {loss} at step {self.trainer.global_step}; "
                      "stopping", flush=True)
            self.trainer.stop_training = True


def _fmt_logs(logs: Logs) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in logs.items())


def _input_wait(trainer: Any) -> float | None:
    """Seconds the loop waited for input so far (``None``: the input does not measure it)."""
    wait = getattr(getattr(trainer, "train_dataset", None), "input_wait_seconds", None)
    return wait if isinstance(wait, float) else None


class ProgressBar(Callback):
    """Epoch, step/total, loss and metrics, samples/s, the share of the time spent waiting for
    input, and ETA, on the chief only. ``live=None``: a live bar on a live terminal (its own, or
    the one ``replicator run`` relays to), plain log lines otherwise."""

    def __init__(self, live: bool | None = None) -> None:
        self.live = live
        self._bar: Any = None
        self._task: Any = None
        self._start, self._samples, self._done = 0.0, 0.0, 0
        self._wait0: float | None = None

    def input_share(self) -> float | None:
        """The share of this epoch's time so far that the loop spent waiting for input
        (``None``: the input does not measure it)."""
        wait = _input_wait(self.trainer)
        if wait is None or self._wait0 is None:
            return None
        return min(1.0, max(0.0, wait - self._wait0) / max(time.perf_counter() - self._start, 1e-9))

    def _speed(self) -> str:
        rate = self._samples / max(time.perf_counter() - self._start, 1e-9)
        share = self.input_share()
        return f"{rate:,.0f} samples/s" + ("" if share is None else f"  input {share:.0%}")

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        self._start, self._samples = time.perf_counter(), 0.0
        self._wait0, self._done = _input_wait(self.trainer), self.trainer.step_in_epoch
        if is_live_terminal() if self.live is None else self.live:
            from rich import progress

            self._bar = progress.Progress(
                progress.TextColumn(f"epoch {epoch + 1}/{self.trainer.epochs}"),
                progress.BarColumn(), progress.MofNCompleteColumn(),
                progress.TextColumn("{task.fields[info]}"), progress.TextColumn("ETA"),
                progress.TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=self.trainer.steps_in_epoch, info="",
                                            completed=self.trainer.step_in_epoch)
            self._bar.start()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        self._samples += self.trainer.last_global_batch
        self._done = batch + 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, info=f"{_fmt_logs(logs or {})}  "
                                                         f"{self._speed()}")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        self.on_train_end()  # the bar of this epoch ends here
        elapsed = time.perf_counter() - self._start
        print(f"epoch {epoch + 1}/{self.trainer.epochs}  step {self._done}/"
              f"{self.trainer.steps_in_epoch}  {_fmt_logs(logs or {})}  {self._speed()}  "
              f"{elapsed:.1f} s", flush=True)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


_HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))


class CallbackList:
    """Calls a hook on every callback, in order; gives a backup their state and takes it back."""

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
            if (method := getattr(cb, hook, None)) is not None:
                method(*args)

    def _stateful(self) -> dict[str, Any]:
        """The callbacks whose state a backup holds, by ``"index:ClassName"`` (not History, not
        backups)."""
        return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(self.callbacks)
                if has_state(cb) and not isinstance(cb, (History, BackupAndRestore))}

    def state_dict(self) -> dict[str, Any]:
        """Every stateful callback's ``state_dict()``, for a backup."""
        return {key: cb.state_dict() for key, cb in self._stateful().items()}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each callback its state from a backup; warn for one the backup does not know."""
        for key, cb in self._stateful().items():
            if key in states:
                cb.load_state_dict(states[key])
            elif cb.state_dict():
                warnings.warn(f"the backup holds no state for callback {key} (it has "
                              f"{', '.join(sorted(states)) or 'none'}); it starts afresh, so the "
                              "resumed run may differ from an uninterrupted one. HINT: pass the "
                              "same callbacks, in the same order, as the run that wrote it.",
                              RuntimeWarning, stacklevel=2)
