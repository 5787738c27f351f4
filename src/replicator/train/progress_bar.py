"""The chief's progress display: a live bar on a terminal (its own, or the one ``replicator
run`` relays its output to), plain log lines otherwise (CI, files)."""

from __future__ import annotations

import time
from typing import Any

from replicator.cluster.terminal import is_live_terminal
from replicator.train.callbacks import Callback, Logs


def _fmt_logs(logs: Logs) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in logs.items())


def _input_wait(trainer: Any) -> float | None:
    """Seconds the loop waited for input so far, where the training input measures it (a
    distributed dataset, an ``rp.data.Dataset``)."""
    wait = getattr(getattr(trainer, "train_dataset", None), "input_wait_seconds", None)
    return wait if isinstance(wait, float) else None


class ProgressBar(Callback):
    """Epoch, step/total, loss and metrics, samples/s, the share of the time spent waiting for
    input, and ETA, on the chief only. ``live=None``: a live bar on a live terminal
    (:func:`~replicator.cluster.terminal.is_live_terminal`).
    """

    def __init__(self, live: bool | None = None) -> None:
        self.live = live
        self._bar: Any = None
        self._task: Any = None
        self._start = 0.0
        self._samples = 0.0
        self._done = 0
        self._wait0: float | None = None

    def input_share(self) -> float | None:
        """The share of this epoch's time so far that the loop spent waiting for input
        (``None``: the input does not measure it)."""
        wait = _input_wait(self.trainer)
        if wait is None or self._wait0 is None:
            return None
        return min(1.0, max(0.0, wait - self._wait0) / max(time.perf_counter() - self._start,
                                                           1e-9))

    def _speed(self) -> str:
        rate = self._samples / max(time.perf_counter() - self._start, 1e-9)
        share = self.input_share()
        return f"{rate:,.0f} samples/s" + ("" if share is None else f"  input {share:.0%}")

    def _enabled(self) -> bool:
        return self.is_chief

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._enabled():
            return
        self._start, self._samples = time.perf_counter(), 0.0
        self._wait0 = _input_wait(self.trainer)
        self._done = self.trainer.step_in_epoch
        live = is_live_terminal() if self.live is None else self.live
        total = self.trainer.steps_in_epoch
        if live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn(f"epoch {epoch + 1}/{self.trainer.epochs}"), BarColumn(),
                MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TextColumn("ETA"),
                TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total, info="",
                                            completed=self.trainer.step_in_epoch)
            self._bar.start()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self._enabled():
            return
        self._samples += self.trainer.last_global_batch
        self._done = batch + 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, info=f"{_fmt_logs(logs or {})}  "
                                                         f"{self._speed()}")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._enabled():
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elapsed = time.perf_counter() - self._start
        print(f"epoch {epoch + 1}/{self.trainer.epochs}  step {self._done}/"
              f"{self.trainer.steps_in_epoch}  {_fmt_logs(logs or {})}  {self._speed()}  "
              f"{elapsed:.1f} s", flush=True)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
