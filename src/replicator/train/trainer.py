"""Trainer: Keras-style ``fit`` / ``evaluate`` / ``predict`` on the public Strategy API, the
same under every strategy: the ``compute_average_loss`` rule (uneven or padded batches give the
one-device gradient), metric sums reduced in one collective per step, each sample evaluated
once. :class:`Replicator` is TF-Replicator's shape: only an ``input_fn`` and a ``step_fn``."""

from __future__ import annotations

import copy
import math
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from replicator.comm.reduce_op import ReduceOp
from replicator.data.batching import batch_rows, slice_bounds
from replicator.data.context import InputContext
from replicator.data.prefetch import to_device
from replicator.errors import CallbackFailedError, NonFiniteLossError
from replicator.resume.backup_and_restore import BackupAndRestore
from replicator.resume.rank_state import epoch_length
from replicator.strategies.base import Strategy
from replicator.strategies.live import LiveRecoveryError
from replicator.strategies.losses import compute_average_loss
from replicator.train.callbacks import (
    Callback,
    CallbackList,
    History,
    Logs,
    ProgressBar,
    TerminateOnNaN,
)
from replicator.train.metrics import Mean, Metric, as_metric, reduce_states

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_example_loss(loss_fn: LossFn) -> LossFn:
    """A loss returning one value per example: a ``torch.nn`` loss copied with
    ``reduction="none"``; another function as it is (a scalar: the local batch's mean)."""
    if isinstance(loss_fn, nn.modules.loss._Loss) and hasattr(loss_fn, "reduction"):
        per_example = copy.copy(loss_fn)
        per_example.reduction = "none"
        return per_example
    return loss_fn


def _outputs_are_logits(loss_fn: LossFn) -> bool | None:
    """Whether a model trained with ``loss_fn`` outputs logits (None: cannot tell)."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.BCEWithLogitsLoss, nn.NLLLoss)):
        return True  # NLLLoss takes log-probabilities: their softmax is the probabilities
    return False if isinstance(loss_fn, nn.BCELoss) else None


def _unpack(batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict):
        return batch["x"], batch["y"], batch.get("sample_weight")
    if isinstance(batch, (list, tuple)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise TypeError("a batch must be (x, y), (x, y, sample_weight) or a dict with 'x' and 'y'; "
                    f"got {type(batch).__name__}")


class ErrorAgreement:
    """Makes every replica fail together when a callback fails on some of them: this replica's
    first error is held until the next agreement point (the per-step reduction, where a flag
    travels with the step's numbers, or :meth:`agree`); then all raise ``CallbackFailedError``."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.pending: tuple[str, BaseException] | None = None

    @property
    def flag(self) -> float:
        return 1.0 if self.pending is not None else 0.0

    def hold(self, where: str, exc: BaseException) -> None:
        if self.pending is None:
            self.pending = (where, exc)

    def agree(self) -> None:
        """One small collective: raise on every replica if any holds an error."""
        self.check(float(self.strategy.reduce("sum", torch.tensor(self.flag))))

    def check(self, flags_total: float) -> None:
        """Raise if ``flags_total`` (the sum of every replica's flag) says someone failed."""
        if flags_total <= 0:
            return
        where, exc = self.pending or ("", None)
        mine = "" if exc is None else f"{where} raised {type(exc).__name__}: {exc}"
        texts = self.strategy.collectives.all_gather_bytes(mine.encode(), "callback errors")
        reports = [f"rank {r}: {t.decode(errors='replace')}" for r, t in enumerate(texts) if t]
        message = "a callback failed, so every replica stops: " + "; ".join(reports)
        if exc is not None:
            tb = "".join(traceback.format_exception(exc))
            raise CallbackFailedError(f"{message}\n{tb}") from exc
        raise CallbackFailedError(message)


class _MemoryReportPrinter(Callback):
    """``verbose=2``: every rank's ``strategy.memory_report()`` after the first batch."""

    _done = False

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._done:
            return
        self._done = True
        reports = self.trainer.strategy.memory_reports()  # type: ignore[attr-defined]
        if self.is_chief:
            print("memory per rank:\n  " + "\n  ".join(str(r) for r in reports), flush=True)


class Trainer:
    """``rp.Trainer(strategy, model_fn | model, optimizer_fn | optimizer, loss_fn, metrics)``:
    the functions run under ``strategy.scope()``, a built model goes to ``distribute_model``.
    For exact results with ``sample_weight`` give a ``torch.nn`` (or per-example) loss."""

    def __init__(self, strategy: Strategy, model: nn.Module | Callable[[], nn.Module],
                 optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
                 loss_fn: LossFn, metrics: Sequence[Metric | str] = ()) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"Trainer needs a replicator Strategy, got {type(strategy).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(predictions, targets)")
        self.strategy = strategy
        with strategy.scope():
            built = model if isinstance(model, nn.Module) else model()
            if not isinstance(built, nn.Module):
                raise TypeError(f"model_fn must return a torch.nn.Module, got "
                                f"{type(built).__name__}")
            self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) \
                else optimizer(built.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a function of the "
                            "parameters returning one")
        self.model = strategy.distribute_model(built) if isinstance(model, nn.Module) else built
        self.loss_fn = _per_example_loss(loss_fn)
        self.metrics = [as_metric(m) for m in metrics]
        logits = _outputs_are_logits(loss_fn)
        for m in self.metrics:  # "auto" (None): what the loss takes tells logits/probabilities
            if getattr(m, "from_logits", False) is None and logits is not None:
                m.from_logits = logits  # type: ignore[attr-defined]
        names = ["loss", *(m.name for m in self.metrics)]
        if len(set(names)) != len(names):
            raise ValueError(f"metric names must be unique (and not 'loss'): {names}")
        self._loss = Mean("loss")
        self.history = History()
        self.epoch, self.epochs, self.global_step = 0, 0, 0
        self.step_in_epoch, self.steps_in_epoch = 0, 0
        self.last_global_batch, self.stop_training = 0.0, False
        self.terminate_on_nan = True  # fit(terminate_on_nan=...)
        self.train_dataset: Any = None
        self._errors = ErrorAgreement(strategy)
        self._reduced_sums = [m.state.clone() for m in self._all_metrics()]
        #: The current ``fit``'s ``BackupAndRestore`` (``None``: none); loggers keep ledgers by it.
        self.backup: BackupAndRestore | None = None
        self._samples_seen = 0.0
        self._callbacks = CallbackList([], self)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands, the same on every replica (what ``BackupAndRestore`` saves)."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "global_step": self.global_step,
                "metric_sums": {m.name: s.tolist() for m, s in
                                zip(self._all_metrics(), self._reduced_sums)},
                "history": self.history.state_dict(), "stop_training": self.stop_training,
                "callbacks": self._callbacks.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: every replica holds the same running sums, so a
        resumed epoch's metrics are bit for bit those of an uninterrupted one."""
        self.epoch, self.step_in_epoch, self.global_step = (
            int(state[k]) for k in ("epoch", "step_in_epoch", "global_step"))
        self._reduced_sums = []
        for m in self._all_metrics():
            m.reset()
            saved = state["metric_sums"].get(m.name)
            if saved is not None:  # sizes a metric that sizes itself lazily
                m.load_state(torch.zeros(len(saved), dtype=torch.float64))
            self._reduced_sums.append(torch.zeros_like(m.state) if saved is None
                                      else torch.tensor(saved, dtype=torch.float64))
        self.history.load_state_dict(state["history"])
        self.stop_training = bool(state.get("stop_training", False))
        # the callbacks' on_train_begin ran before this restore (backups come last)
        self._callbacks.load_state_dict(state.get("callbacks", {}))

    def _all_metrics(self) -> list[Metric]:
        return [self._loss, *self.metrics]

    def _hook(self, name: str, *args: Any) -> None:
        try:
            self._callbacks.call(name, *args)
        except Exception as exc:
            if self.strategy.num_replicas_in_sync == 1:
                raise
            self._errors.hold(name, exc)

    def _forward(self, x: Any, y: torch.Tensor) -> tuple[Any, torch.Tensor, int]:
        """The predictions, one loss per example (a scalar loss stands for each) and ``n``."""
        pred = self.model(x)
        per_example = self.loss_fn(pred, y)
        if (n := batch_rows(x)) is None:
            raise TypeError(f"cannot tell the batch size of {type(x).__name__}")
        if per_example.dim() == 0:
            per_example = per_example.expand(n)
        return pred, (per_example.reshape(n, -1).mean(1) if n else per_example.reshape(0)), n

    def _train_step(self, batch: Any, mask: torch.Tensor | None = None) -> float:
        x, y, weight = _unpack(batch)
        if weight is None and mask is not None:
            weight = mask  # padding the input pipeline added at an uneven end
        pred, per_example, n = self._forward(x, y)
        w = torch.ones(n, dtype=per_example.dtype, device=per_example.device) if weight is None \
            else weight.to(per_example.dtype).reshape(-1)
        # the global count and the replicas with a non-finite loss, in one collective
        counts = torch.stack([w.sum().detach(), self._nonfinite(per_example, w)])
        if self.strategy.num_replicas_in_sync > 1:
            counts = self.strategy.reduce(ReduceOp.SUM, counts)
        total, bad = (float(v) for v in counts.tolist())
        if bad:
            self._stop_on_nonfinite(per_example, w, int(round(bad)))
        # the one compute_average_loss rule; with no real sample anywhere (total == 0, the
        # same on every replica) it finds the zero count itself and returns a zero loss
        count: Any = total if total > 0 else None  # a weighted count may be fractional
        compute_average_loss(per_example, global_batch_size=count, sample_weight=w).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self._loss.update(per_example.detach(), y, w)
        for m in self.metrics:
            m.update(pred, y, w)
        return total

    def _nonfinite(self, per_example: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """1.0 when ``fit(terminate_on_nan=True)`` and a real example's loss is NaN or inf."""
        bad = ~torch.isfinite(per_example.detach()) & (w != 0) & self.terminate_on_nan
        return bad.any().to(w.dtype)

    def _stop_on_nonfinite(self, per_example: torch.Tensor, w: torch.Tensor, bad: int) -> None:
        """Raise :class:`NonFiniteLossError` before backward, on every replica at once (the
        count came from one collective), so the weights keep the previous step's values."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mine = "not finite" if bool(self._nonfinite(per_example, w)) else "finite"
        raise NonFiniteLossError(
            f"the loss is NaN or infinite at step {self.step_in_epoch + 1} of epoch "
            f"{self.epoch + 1}/{self.epochs} (global step {self.global_step + 1}) on {bad} of "
            f"{self.strategy.num_replicas_in_sync} replica(s) (rank {rank}'s own loss is {mine}); "
            "fit stopped before the optimizer step, so the weights are those after global step "
            f"{self.global_step}. HINT: lower the learning rate, clip gradients, or look for "
            "NaN/inf in this step's input; fit(..., terminate_on_nan=False) trains on regardless.")

    def _reduced(self, metrics: list[Metric]) -> list[torch.Tensor]:
        """The metrics' sums over all replicas, reduced with the error flag in one collective."""
        states, extra = reduce_states(self.strategy, metrics, [self._errors.flag])
        self._errors.check(extra[0])
        return states

    def _step_logs(self) -> Logs:
        """Training logs: the step's reduced sums are added to the epoch's running sums (the
        same on every replica, and what a backup holds) and the local sums start over."""
        metrics = self._all_metrics()
        states = self._reduced(metrics)
        for i, (m, step_sums) in enumerate(zip(metrics, states)):
            running = self._reduced_sums[i]
            if running.numel() != step_sums.numel():  # a metric sized on its first batch
                if bool(running.any()):
                    raise ValueError(f"metric {m.name!r} changed its state size mid-epoch")
                running = torch.zeros_like(step_sums)
            self._reduced_sums[i] = running + step_sums
            m.reset()
        return {m.name: m.value_from(s) for m, s in zip(metrics, self._reduced_sums)}

    def fit(self, train_data: Any, epochs: int = 1, validation_data: Any = None,
            steps_per_epoch: int | None = None, callbacks: Iterable[Callback] = (),
            verbose: int = 1, terminate_on_nan: bool = True) -> History:
        """Train for ``epochs`` epochs (at most ``steps_per_epoch`` steps each); returns the
        :class:`History`. ``terminate_on_nan``: a NaN or infinite loss on any replica raises
        ``NonFiniteLossError`` everywhere before that step's backward (unless a ``TerminateOnNaN``
        callback or a ``BackupAndRestore`` takes over)."""
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if getattr(self.strategy, "live", None) is not None:
            raise LiveRecoveryError(
                "Trainer.fit does not run in replica groups (live recovery) yet: a group that "
                "heals from a peer cannot take over fit's own epoch loop and history, so it "
                "would stop with EpochLoopError at its first heal. HINT: in replica groups, "
                "write the loop: `for step, batch in backup.steps(dist, epochs=E): "
                "strategy.run(step_fn, (batch,))` (docs/fault_tolerance.md)")
        self.epochs = epochs
        if isinstance(train_data, (DataLoader, Dataset)):
            train_data = self.strategy.distribute_dataset(train_data)
        elif not hasattr(train_data, "__iter__"):  # else already distributed
            raise TypeError(f"fit() takes a DataLoader with the global batch size, a Dataset or "
                            f"a distributed dataset; got {type(train_data).__name__}")
        self.train_dataset = train_data
        extra: list[Callback] = [ProgressBar()] if verbose else []
        if verbose >= 2 and hasattr(self.strategy, "memory_reports"):
            extra.append(_MemoryReportPrinter())
        callbacks = list(callbacks)
        backups = [cb for cb in callbacks if isinstance(cb, BackupAndRestore)]
        for backup in backups:  # what a backup holds, the input, and the strategy
            backup.set_strategy(self.strategy)
            backup.track(model=self.model, optimizer=self.optimizer,
                         dataset=self.train_dataset, trainer=self)
        # user callbacks first, so that what they add to the logs is shown and recorded;
        # backups last, so that a backup taken at an epoch's end holds that epoch's history
        others = [cb for cb in callbacks if cb not in backups]
        self._callbacks = CallbackList([*others, *extra, self.history, *backups], self)
        self.backup = backups[0] if backups else None
        # a BackupAndRestore's own guard, or a TerminateOnNaN callback, decides instead
        self.terminate_on_nan = bool(terminate_on_nan) and not backups and not any(
            isinstance(cb, TerminateOnNaN) for cb in callbacks)
        self.stop_training = False
        self.model.train()
        started, self._samples_seen = time.perf_counter(), 0.0
        try:
            self._hook("on_train_begin", {})
            self._errors.agree()
            first_epoch = self.epoch  # after a restore: where this call resumed
            while self.epoch < epochs and not self.stop_training:
                self._run_epoch(steps_per_epoch, validation_data)
            self._hook("on_train_end", {})
            self._errors.agree()
        except BaseException:
            for backup in backups:  # a save still in flight commits before the error leaves
                backup.close(raise_errors=False)
            raise
        if verbose and self.strategy.is_chief:
            print(self._summary(self.epoch - first_epoch, time.perf_counter() - started),
                  flush=True)
        return self.history

    def _summary(self, epochs_run: int, seconds: float) -> str:
        """``fit: 3 epochs in 7.2 s, 1,620 samples/s on 2 replicas; loss 0.07, ...``."""
        rate = self._samples_seen / max(seconds, 1e-9)
        replicas = self.strategy.num_replicas_in_sync
        final = ", ".join(f"{k} {v[-1]:.4g}" for k, v in self.history.history.items() if v)
        return (f"fit: {epochs_run} epoch{'s' if epochs_run != 1 else ''} in {seconds:.1f} s, "
                f"{rate:,.0f} samples/s on {replicas} replica{'s' if replicas != 1 else ''}"
                + (f"; {final}" if final else ""))

    def _run_epoch(self, steps_per_epoch: int | None, validation_data: Any) -> None:
        epoch = self.epoch
        total = epoch_length(self.train_dataset)
        if steps_per_epoch is not None:
            total = steps_per_epoch if total is None else min(total, steps_per_epoch)
        self.steps_in_epoch = total or 0
        if self.step_in_epoch == 0:
            for m in self._all_metrics():
                m.reset()
            self._reduced_sums = [m.state.clone() for m in self._all_metrics()]
        self._hook("on_epoch_begin", epoch, {})
        logs: Logs = {}
        iterator = iter(self.backup.epoch_batches(self.train_dataset)) \
            if self.backup is not None else iter(self.train_dataset)
        # run the input to its end (so it knows the epoch is over) unless steps_per_epoch
        # or a callback stops earlier; a later epoch then continues where this one stopped
        for batch in iterator:
            self._hook("on_train_batch_begin", self.step_in_epoch, {})
            mask = getattr(self.train_dataset, "mask", None)
            self.last_global_batch = self.strategy.run(self._train_step, args=(batch, mask))
            self._samples_seen += self.last_global_batch
            self.step_in_epoch += 1
            self.global_step += 1
            logs = self._step_logs()
            self._hook("on_train_batch_end", self.step_in_epoch - 1, logs)
            if self.stop_training or (steps_per_epoch is not None
                                      and self.step_in_epoch >= steps_per_epoch):
                break
        logs = logs or self._step_logs()
        if validation_data is not None:
            logs.update(self.evaluate(validation_data, _prefix="val_"))
            self.model.train()
        # the epoch is done: advance first, so a backup taken in on_epoch_end resumes after it
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self._hook("on_epoch_end", epoch, logs)
        self._errors.agree()

    def _shard_for_eval(self, data: Any, batch_size: int | None) -> DataLoader:
        if isinstance(data, DataLoader):
            dataset, global_batch, collate = data.dataset, data.batch_size, data.collate_fn
        elif isinstance(data, Dataset):
            dataset, global_batch, collate = data, batch_size or 32, None
        else:
            raise TypeError("evaluate() and predict() take a DataLoader or a map-style Dataset")
        if isinstance(dataset, IterableDataset):
            raise TypeError("evaluate() and predict() need a map-style dataset so each replica "
                            "can take its own block of samples")
        n, replicas = len(dataset), self.strategy.num_replicas_in_sync  # type: ignore[arg-type]
        if n < replicas:
            raise ValueError(f"the dataset has {n} samples for {replicas} replicas; each "
                             "replica needs at least one")
        start, stop = slice_bounds(n, self.strategy.replica_id, replicas)
        per_replica = max(1, math.ceil((batch_size or global_batch or 32) / replicas))
        kwargs: dict[str, Any] = {"collate_fn": collate} if collate is not None else {}
        return DataLoader(Subset(dataset, range(start, stop)), batch_size=per_replica, **kwargs)

    def evaluate(self, data: Any, batch_size: int | None = None,
                 callbacks: Iterable[Callback] = (), _prefix: str = "") -> Logs:
        """Loss and metrics over every sample of ``data`` exactly once, on all replicas."""
        if callbacks:
            self._callbacks = CallbackList([*self._callbacks.callbacks, *callbacks], self)
        loader = self._shard_for_eval(data, batch_size)
        loss, metrics = Mean("loss"), [copy.deepcopy(m) for m in self.metrics]
        for m in metrics:
            m.reset()
        self._hook("on_test_begin", {})
        self.model.eval()
        with torch.no_grad():
            for i, batch in enumerate(loader):
                x, y, w = _unpack(to_device(batch, self.strategy.device))
                pred, per_example, _ = self._forward(x, y)
                loss.update(per_example, y, w)
                for m in metrics:
                    m.update(pred, y, w)
                self._hook("on_test_batch_end", i, {})
        logs = {_prefix + m.name: m.value_from(s)
                for m, s in zip([loss, *metrics], self._reduced([loss, *metrics]))}
        self._hook("on_test_end", logs)
        return logs

    def predict(self, data: Any, batch_size: int | None = None) -> torch.Tensor:
        """Model outputs for every sample, in dataset order, gathered on every replica."""
        loader = self._shard_for_eval(data, batch_size)
        self._hook("on_predict_begin", {})
        self.model.eval()
        outputs = []
        with torch.no_grad():
            for batch in loader:
                batch = to_device(batch, self.strategy.device)
                x = batch[0] if isinstance(batch, (list, tuple)) else batch
                outputs.append(self.model(x))
        result = self.strategy.gather(torch.cat(outputs), axis=0)
        self._hook("on_predict_end", {})
        self._errors.agree()
        return result


class Replicator:
    """``rp.Replicator(strategy).run(input_fn, step_fn, num_steps)``: ``input_fn(ctx)`` builds
    this replica's pipeline, ``step_fn(batch)`` runs a step; passes repeat for ``num_steps``."""

    def __init__(self, strategy: Strategy) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"Replicator needs a Strategy, got {type(strategy).__name__}")
        self.strategy = strategy

    def run(self, input_fn: Callable[[InputContext], Iterable[Any]],
            step_fn: Callable[[Any], Any], num_steps: int,
            reduce: str | None = "mean") -> list[Any]:
        """Run ``num_steps`` steps; return each step's output, reduced across replicas with
        ``reduce`` (``None`` keeps this replica's own values)."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        dataset = self.strategy.distribute_datasets_from_function(input_fn)
        outputs: list[Any] = []
        while len(outputs) < num_steps:
            before = len(outputs)
            for batch in dataset:
                out = self.strategy.run(step_fn, args=(batch,))
                if reduce is not None and out is not None:
                    out = self.strategy.reduce(reduce, out)
                outputs.append(out)
                if len(outputs) == num_steps:
                    break
            if len(outputs) == before:
                raise ValueError("input_fn produced an empty pipeline; no step could run")
        return outputs
