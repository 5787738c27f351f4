"""BackupAndRestore: resume an interrupted training run at the exact step, bit for bit (unlike
Keras's, which redoes the unfinished epoch). The strategy is asked only through its public API;
storage gets collectives, never a strategy.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from replicator.checkpoint.distributed_checkpoint import (
    discard_uncommitted,
    load_sharded,
    save_sharded,
    stage_sharded,
    write_staged,
)
from replicator.checkpoint.manager import CheckpointManager, Restored, check_state_name
from replicator.checkpoint.saver import BackgroundSaver, check_saver, early_process, make_saver
from replicator.checkpoint.storage import open_storage
from replicator.cluster.worker_errors import record_backup
from replicator.data.sharding import set_epoch_on
from replicator.resume.preemption import Preempted, PreemptionWatcher
from replicator.resume.rank_state import (
    capture_rng,
    epoch_length,
    has_state,
    restore_rng,
    warn_replay,
)
from replicator.resume.sharded import checkpoint_collectives, prepare_optimizers, sharded_objects
from replicator.resume.step_hooks import CopyGuard, NonFiniteGuard
from replicator.strategies.base import Strategy
from replicator.strategies.replica_context import current_strategy

if TYPE_CHECKING:
    from replicator.strategies.live.dataset import LiveDataset

#: Where the sharded model and optimizer state of each backup go, under ``backup_dir``.
SHARDED_DIR = "sharded"


def check_frequency(value: str | int, name: str) -> str | int:
    """``value`` when it is ``"epoch"`` or a positive number of steps (``name``: the argument)."""
    if value != "epoch" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be 'epoch' or a positive number of steps, got {value!r}")
    return value


class BackupAndRestore:
    """Back up training state regularly and resume from the newest valid backup on restart.

    Args:
        backup_dir: directory for the backups; one file system that every rank sees, or an
            fsspec URL (``"s3://bucket/run"``: see docs/remote_storage.md).
        save_freq: ``"epoch"`` (after each epoch) or a number of optimizer steps.
        keep: how many backups to keep (older ones are deleted after each new one commits).
        delete_checkpoint: delete the backups once training completes (as Keras does); with
            ``False`` a final backup is written, so a rerun finds nothing left to do.
        strategy: the strategy in use (default: the active one, or the one a Trainer
            passes); its collectives name a rank that stops responding, and a strategy that
            splits the model has its part of it saved by every rank.
        terminate_on_nan: stop before an optimizer step with NaN/inf gradients.
        handle_preemption: save and exit with code 75 on SIGTERM (main thread only).
        preemption_check_seconds: how often the ranks agree on whether one was signalled
            (about; the interval in steps adapts to the step time); 0 checks every step.
        background: write and commit the saves due by ``save_freq`` while training goes on
            (the state is copied to memory first); ``False`` writes each save before the
            next step starts.
        saver: who writes background saves: ``"process"`` (a saver process, handed the state
            in shared memory; a save due while one runs is skipped and logged) or
            ``"thread"``; default: the process for a URL, the thread for a local path. Under
            a strategy that splits the model, sharded saves go to the background for a URL,
            and for a local path when ``saver`` is given (else before the next step).
        mirror: for a URL, a local directory that also receives every backup (kept when
            the store cannot be reached; see docs/remote_storage.md).
        storage_options: fsspec options for a URL (e.g. ``{"client_kwargs":
            {"endpoint_url": ...}}``); default: fsspec's environment (``AWS_*``,
            ``FSSPEC_S3_ENDPOINT_URL``).
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 keep: int = 2, delete_checkpoint: bool = True, *,
                 strategy: Strategy | None = None,
                 terminate_on_nan: bool = True, handle_preemption: bool = True,
                 preemption_check_seconds: float = 1.0, background: bool = True,
                 saver: str | None = None, mirror: str | os.PathLike[str] | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.save_freq = check_frequency(save_freq, "save_freq")
        storage = open_storage(backup_dir, storage_options, "the backup location")
        #: The location: a local :class:`Path`, or the URL of a store.
        self.backup_dir = storage.location
        self._saver_kind = check_saver(saver)
        #: The saver process, started now: the first backup does not wait for its start.
        self._process = early_process(storage, saver) if background else None
        self._mirror, self._storage_options = mirror, storage_options
        self.delete_checkpoint = bool(delete_checkpoint)
        self.terminate_on_nan = terminate_on_nan
        self.handle_preemption = handle_preemption
        if preemption_check_seconds < 0:
            raise ValueError(f"preemption_check_seconds must be >= 0, got "
                             f"{preemption_check_seconds!r}")
        self.preemption_check_seconds = preemption_check_seconds
        self._strategy = strategy
        self._keep = keep
        self.background = bool(background)
        self._saver: BackgroundSaver | None = None
        self._copy_guard = CopyGuard()  # tracked optimizers wait for a save's deferred copy
        self._manager: CheckpointManager | None = None
        self._objects: dict[str, Any] = {}
        self._dataset: Any = None
        #: Optimizer steps completed (the next step yielded is ``step + 1``).
        self.step = 0
        #: Index of the epoch in progress (0-based).
        self.epoch = 0
        #: Batches completed in the epoch in progress.
        self.step_in_epoch = 0
        #: What the last restore loaded (None: a fresh start).
        self.restored: Restored | None = None
        self._resume: dict[str, Any] | None = None
        self._last_saved_step: int | None = None
        self._pending_save = False
        self._pending_preempt = False
        self._watcher: PreemptionWatcher | None = None
        self._guard: NonFiniteGuard | None = None
        self._began = False
        if keep < 1 or isinstance(keep, bool):
            raise ValueError(f"keep must be a positive number of backups, got {keep!r}")

    # -- what to save --------------------------------------------------------------------------
    def track(self, model: Any = None, optimizer: Any = None, scheduler: Any = None,
              data: Any = None, *, dataset: Any = None, **others: Any) -> BackupAndRestore:
        """Register what a backup holds; returns ``self``.

        ``model``, ``optimizer``, ``scheduler`` and ``others`` need ``state_dict()`` and
        ``load_state_dict()`` and must be the same on every rank (the chief writes them),
        except under a strategy that splits the model: there the one tracked module and the
        tracked optimizers are saved sharded, by every rank.
        ``data`` (alias ``dataset``): this rank's input, read by :meth:`steps` (a distributed
        dataset, an ``rp.data.Dataset``); its ``state_dict()`` is saved per rank and loaded on
        resume; without one, a resume replays the epoch up to the saved position."""
        dataset = data if data is not None else dataset
        named = {"model": model, "optimizer": optimizer, "scheduler": scheduler, **others}
        for name, obj in named.items():
            if obj is None:
                continue
            check_state_name(name)
            if not has_state(obj):
                raise TypeError(f"track({name}=...) needs an object with state_dict() and "
                                f"load_state_dict(), got {type(obj).__name__}")
            self._objects[name] = obj
        if dataset is not None:
            self._dataset = dataset
        return self

    def set_strategy(self, strategy: Strategy) -> None:
        """Use ``strategy`` when none was given (a Trainer passes its own)."""
        if self._strategy is None:
            self._strategy = strategy

    @property
    def manager(self) -> CheckpointManager:
        """The storage beneath, over the ranks that checkpoint together."""
        if self._manager is None:
            self._manager = CheckpointManager(
                self.backup_dir, keep=self._keep,
                collectives=checkpoint_collectives(self._strategy_now()),
                mirror=self._mirror, storage_options=self._storage_options)
        return self._manager

    def _sharded_location(self) -> Any:
        """Where the sharded state of backups goes (with the backup's ``storage_options``)."""
        return open_storage(f"{self.backup_dir}/{SHARDED_DIR}", self._storage_options,
                            "the sharded backup location")

    def _strategy_now(self) -> Strategy | None:
        return self._strategy if self._strategy is not None else current_strategy()

    @property
    def initial_epoch(self) -> int:
        """The epoch a trainer should start from (after :meth:`on_train_begin`)."""
        return self.epoch

    # -- the custom-loop shape -----------------------------------------------------------------
    def steps(self, dataset: Iterable[Any] | None = None, *, epochs: int | None = None,
              num_steps: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` (``step`` from 1) from the resume point on, saving as
        configured, until ``epochs`` epochs and/or ``num_steps`` steps; ``break`` ends training
        without a final save."""
        if dataset is not None:
            self._dataset = dataset
        if self._dataset is None:
            raise ValueError("steps() needs the dataset to iterate: steps(dist_dataset, ...)")
        if epochs is None and num_steps is None:
            raise ValueError("steps() needs epochs= or num_steps= to know when to stop")
        if is_live(self._dataset):  # replica groups: counted from the committed step
            yield from self._live_steps(self._dataset, epochs=epochs, num_steps=num_steps)
            return
        self.on_train_begin()
        try:
            while (epochs is None or self.epoch < epochs) and (
                    num_steps is None or self.step < num_steps):
                self.on_epoch_begin(self.epoch)
                finished = True
                for batch in self.epoch_batches(stop_at=num_steps):
                    yield self.step + 1, batch
                    self.on_train_batch_end(self.step_in_epoch)
                if num_steps is not None and self.step >= num_steps:
                    length = epoch_length(self._dataset)
                    finished = length is not None and self.step_in_epoch >= length
                if finished:
                    self.on_epoch_end(self.epoch)
            self.on_train_end()  # closes
        except BaseException:  # an error, or the loop left with break (GeneratorExit)
            self.close(raise_errors=False)
            raise

    def _live_steps(self, dataset: LiveDataset, *, epochs: int | None,
                    num_steps: int | None) -> Iterator[tuple[int, Any]]:
        """:meth:`steps` in a live-recovery job (replica groups): the position comes from the
        committed step (a healed group receives it from its peer), each batch from the live
        dataset; one group writes the backups (all hold the same state); in rounds (DiLoCo,
        LocalSGD) the run resumes at the round's start. SIGTERM makes a group leave the job, so
        the backup's own preemption handling is off."""
        engine = dataset.engine
        spe = dataset.split.steps_per_epoch
        end = min(n for n in (epochs * spe if epochs is not None else None, num_steps)
                  if n is not None)
        self.handle_preemption = False  # SIGTERM: the group leaves (engine.py)
        self.on_train_begin()
        resume = self._resume
        if self.step > engine.committed_steps:
            if resume is not None:  # first: a run in rounds resumes at its round's start, with
                restore_rng(resume.pop("rng", None))  # that start's random state
                dataset.load_state_dict(resume.get("data") or {})
            engine.resume_at(self.step)
        self._resume = None
        try:
            for batch in dataset.until(end):
                yield engine.committed_steps + 1, batch
                step = engine.committed_steps
                epoch, index = divmod(step - 1, spe)
                if not engine.writes_backups:
                    self.step, (self.epoch, self.step_in_epoch) = step, divmod(step, spe)
                    continue
                self.step, self.epoch, self.step_in_epoch = step - 1, epoch, index
                self.on_train_batch_end(index)
                if index + 1 == spe:
                    self.on_epoch_end(epoch)
            if engine.writes_backups:
                self.on_train_end()
        except BaseException:
            self.wait_for_save(raise_errors=False)
            raise
        finally:
            self.close()

    def epoch_batches(self, dataset: Iterable[Any] | None = None,
                      stop_at: int | None = None) -> Iterator[Any]:
        """The batches of the epoch in progress from where a restored backup left off; stops,
        without fetching another batch, once ``step`` reaches ``stop_at``."""
        ds = self._dataset if dataset is None else dataset
        if ds is None:
            raise ValueError("epoch_batches() needs a dataset (track(dataset=...) or pass one)")
        resume, self._resume = self._resume, None
        position = 0 if resume is None else resume["step_in_epoch"]
        loaded = resume is not None and resume.get("data") is not None and has_state(ds)
        if resume is not None and position == 0:
            # before iter(): starting an epoch may draw numbers
            restore_rng(resume.pop("rng", None))
        if loaded:
            ds.load_state_dict(resume["data"])  # type: ignore[union-attr,index]
        elif resume is not None or not has_state(ds):
            set_epoch_on(ds, self.epoch)
        skip = position if resume is not None and not loaded else 0
        if skip:
            warn_replay(ds, skip)
        it = iter(ds)
        for _ in range(skip):
            if next(it, _END) is _END:
                break
        if resume is not None and position > 0:
            restore_rng(resume.pop("rng", None))
        first = True
        while stop_at is None or self.step < stop_at:
            batch = next(it, _END)
            if batch is _END and first and loaded and position == 0:
                it = iter(ds)  # the loaded state was the end of the previous epoch
                batch = next(it, _END)
            first = False
            if batch is _END:
                return
            yield batch

    # -- Keras callback hooks ------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Restore the newest valid backup (if any), arm preemption and the NaN check."""
        if self._began:
            return
        self._began = True
        self.restore()
        if self.background:
            self._start_saver()
        if self.handle_preemption:
            self._watcher = PreemptionWatcher(self.manager.channel.collectives,
                                              check_seconds=self.preemption_check_seconds)
            if not self._watcher.install():
                self._watcher = None
        optimizer = self._objects.get("optimizer")
        if self.terminate_on_nan and optimizer is not None and hasattr(
                optimizer, "register_step_pre_hook"):
            self._guard = NonFiniteGuard(optimizer, self._describe_position)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Nothing to do: the epoch in progress is tracked by :meth:`on_epoch_end`."""

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Count the step; save when due; stop everywhere once any rank was preempted."""
        self.step += 1
        self.step_in_epoch += 1
        preempted = self._watcher.poll() if self._watcher is not None else False
        due = isinstance(self.save_freq, int) and self.step % self.save_freq == 0
        if not (due or preempted):
            return
        length = epoch_length(self._dataset) if self._dataset is not None else None
        if length is not None and self.step_in_epoch >= length:
            # Last batch of the epoch: save after on_epoch_end, at the start of the next epoch,
            # so the backup never depends on how an input pipeline reports a finished epoch.
            self._pending_save = self._pending_save or due or preempted
            self._pending_preempt = self._pending_preempt or preempted
            return
        self._save("preemption" if preempted else "step")
        if preempted:
            self._exit_preempted()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Move to the next epoch and save when ``save_freq="epoch"`` or a save is pending."""
        self.epoch += 1
        self.step_in_epoch = 0
        if self.save_freq == "epoch" or self._pending_save:
            reason = "preemption" if self._pending_preempt else "epoch"
            self._pending_save = False
            self._save(reason)
        if self._pending_preempt:
            self._exit_preempted()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Training completed on every rank: finish a save in flight (raising its error), then
        delete the backups or write the final one."""
        self.wait_for_save()
        if self.delete_checkpoint:
            ch = self.manager.channel
            ch.max_flag(False, "end of training")  # nobody still needs a backup
            if ch.is_chief:
                self._sharded_location().delete_all()
            self.manager.delete_all()
        elif self._last_saved_step != self.step:
            self._save("final")
        self.manager.finish()  # a store that refused the last saves: said here, at the end
        self.close()

    def close(self, raise_errors: bool = True) -> None:
        """Remove the signal handler and the NaN check (call it if you leave a callback-driven
        loop early). A save in flight commits first, so a rerun never races it; its error is
        raised (warned with ``raise_errors=False``: the loop's came first)."""
        self.wait_for_save(raise_errors)
        if self._watcher is not None:
            self._watcher.uninstall()
            self._watcher = None
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._copy_guard.remove()
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self._manager is not None:
            self._manager.close()
        self._began = False

    # -- saving and restoring --------------------------------------------------------------------
    def save(self) -> Path:
        """Back up the current state now (every rank must call it at the same step)."""
        return self._save("manual")

    def _start_saver(self) -> BackgroundSaver:
        """The background saver, made once at the start of training (before a save is due)."""
        if self._saver is None:
            self._saver = make_saver(self.manager, self._saver_kind, process=self._process)
            self._process = None
        return self._saver

    def wait_for_save(self, raise_errors: bool = True) -> None:
        """Block until the background save in flight (if any) is committed on every rank;
        raises its error (only warns with ``raise_errors=False``)."""
        if self._saver is None:
            return
        try:
            done = self._saver.wait()
        except Exception as exc:
            if raise_errors:
                raise
            warnings.warn(f"the background checkpoint save failed: {exc}", RuntimeWarning,
                          stacklevel=3)
            return
        if done is not None:
            self._last_saved_step = done[0]

    def _save(self, reason: str) -> Path:
        """Write a backup of the current step; in the background when due by ``save_freq``
        (with the saver process nothing waits here: see ``checkpoint/saver.py``)."""
        in_background = self.background and reason in ("step", "epoch")
        if not (in_background and self._saver is not None and self._saver.async_mode == "process"):
            self.wait_for_save()
        ch = self.manager.channel
        strategy = self._strategy_now()
        sharded = sharded_objects(self._objects, strategy)
        sharded_names: list[str] = []
        write_shards = None
        if sharded is not None:
            module_name, module, optimizers = sharded
            sharded_names = [module_name, *optimizers]
            listed = prepare_optimizers(strategy, optimizers.values())
            if in_background and (self._saver_kind is not None or self.manager.store.scheme):
                # saver= chosen, or a URL: copied now, written on the saver's thread first
                write_shards = functools.partial(write_staged, self._sharded_location(),
                                                 self.step, stage_sharded(module, listed),
                                                 keep=self._keep + 1)
            else:
                save_sharded(self._sharded_location(), self.step, module, listed,
                             collectives=ch.collectives, keep=self._keep + 1)
        replicated = ({name: obj.state_dict() for name, obj in self._objects.items()
                       if name not in sharded_names} if ch.is_chief else None)
        data = self._dataset.state_dict() if has_state(self._dataset) else None
        per_rank = {"rng": capture_rng(), "data": data}
        info: dict[str, Any] = {"step": self.step, "epoch": self.epoch,
                                "step_in_epoch": self.step_in_epoch, "reason": reason,
                                "data_state": data is not None}
        if sharded_names:
            info["sharded"] = {"directory": SHARDED_DIR, "states": sharded_names}
        if in_background and (write_shards is not None or not sharded_names):
            saver = self._start_saver()
            if saver.process is not None and not is_live(self._dataset):  # live groups
                # roll back and heal in place: their state is all copied at the step
                self._copy_guard.attach(self._objects.values(), saver.wait_copied)
            return saver.submit(self.step, replicated, per_rank, info, write_shards,
                                self._copy_guard.deferrable())
        path = self.manager.save(self.step, replicated, per_rank, info)
        self._last_saved_step = self.step  # the chief noted it for the launcher at its commit
        return path

    def restore(self) -> bool:
        """Load the newest valid backup into the tracked objects; False when there is none."""
        self.wait_for_save()
        restored = self.restored = self.manager.restore()
        ch = self.manager.channel
        if restored is None:
            if ch.is_chief:
                discard_uncommitted(self._sharded_location(), after=-1)  # a first save that crashed
            return False
        sharded_names = list(restored.info.get("sharded", {}).get("states", []))
        held = set(restored.replicated) | set(sharded_names)
        missing = sorted(set(self._objects) - held)
        if missing:
            raise ValueError(
                f"the backup {restored.path} holds no state for {', '.join(missing)} (it has "
                f"{', '.join(sorted(held)) or 'none'}). HINT: track the same "
                "objects as the run that wrote it, or use another backup_dir.")
        self._load_sharded(restored, sharded_names)
        for name, obj in self._objects.items():
            if name not in sharded_names:
                obj.load_state_dict(restored.replicated[name])
        extra = sorted(held - set(self._objects))
        if extra:
            warnings.warn(f"the backup {restored.path} also holds {', '.join(extra)}, which is "
                          "not tracked now; it is ignored", RuntimeWarning, stacklevel=2)
        info = restored.info
        self.step = self._last_saved_step = int(info.get("step", restored.step))
        record_backup(self.manager.directory, self.step)
        self.epoch = int(info.get("epoch", 0))
        self.step_in_epoch = int(info.get("step_in_epoch", 0))
        per_rank = restored.per_rank or {}
        if restored.world_size != ch.world_size:
            warnings.warn(
                f"resuming on {ch.world_size} replicas from a backup written by "
                f"{restored.world_size}: model, optimizer and step are restored; per-rank RNG "
                "and input states are taken from the same rank where it exists, so the run is "
                "not bit-identical to an uninterrupted one", RuntimeWarning, stacklevel=2)
        own = restored.per_rank_source == ch.rank
        self._resume = {"step_in_epoch": self.step_in_epoch,
                        "rng": per_rank.get("rng") if own else None,
                        "data": per_rank.get("data")}
        if ch.is_chief:
            print(f"[replicator] resuming from {restored.path} (step {self.step}, epoch "
                  f"{self.epoch})", file=sys.stderr, flush=True)
        return True

    def _load_sharded(self, restored: Restored, names: list[str]) -> None:
        """Load the tracked module and optimizers of ``names`` from the step's sharded save."""
        strategy = self._strategy_now()
        splits = sharded_objects(self._objects, strategy) is not None  # checks what is tracked
        if not names:
            if splits:
                raise ValueError(
                    f"the backup {restored.path} was written by a strategy that holds the whole "
                    f"model on each rank, and {type(strategy).__name__} splits it; resuming "
                    "across that change is not supported. HINT: resume with the strategy that "
                    "wrote it, or use another backup_dir.")
            return
        if self.manager.channel.is_chief:
            discard_uncommitted(self._sharded_location(), after=restored.step)  # before its choice
        module = next((o for n, o in self._objects.items()
                       if n in names and isinstance(o, torch.nn.Module)), None)
        if module is None:
            raise ValueError(f"the backup {restored.path} holds a sharded model "
                             f"({names[0]}) but no module is tracked under that name")
        optimizers = [o for n, o in self._objects.items()
                      if n in names and isinstance(o, torch.optim.Optimizer)]
        prepare_optimizers(strategy, optimizers)
        load_sharded(self._sharded_location(), module, optimizers, step=restored.step,
                     collectives=self.manager.channel.collectives)

    def _describe_position(self) -> str:
        # a save still in flight holds the state from before this step: let it commit, so the
        # error names the newest backup (every rank reaches this at the same step)
        self.wait_for_save(raise_errors=False)
        last = self.manager.latest_step
        backup = f"step {last}" if last is not None else "none yet"
        return f" at step {self.step + 1} (epoch {self.epoch}; last backup: {backup})"

    def _exit_preempted(self) -> None:
        path = str(self.manager.directory) if self._last_saved_step == self.step else None
        exc = Preempted(self.step, self.manager.channel.rank, path)
        print(f"[replicator] {exc}", file=sys.stderr, flush=True)
        self.close()
        raise exc


_END = object()


def is_live(dataset: Any) -> TypeGuard[LiveDataset]:
    """True for the distributed dataset of a live-recovery job."""
    from replicator.strategies.live.dataset import LiveDataset

    return isinstance(dataset, LiveDataset)

