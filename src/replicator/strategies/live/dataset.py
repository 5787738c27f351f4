"""The input of a live-recovery job: each step's share of the global batch, cut per quorum
(``data/live_split.py``) at the committed step, which a healed group gets from its peer
(docs/fault_tolerance.md, "Exact data").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from replicator.data.live_split import MapInput, StepSplit
from replicator.strategies.live import EpochLoopError, LiveRecoveryError
from replicator.strategies.live.engine import LiveEngine, Quorum


class LiveDataset:
    """This process's share of each step's global batch (see the module doc)."""

    def __init__(self, engine: LiveEngine, data: MapInput, device: torch.device, *, seed: int,
                 epochs: int | None) -> None:
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        s = engine.settings
        self.engine = engine
        self.data = data
        self.device = torch.device(device)
        self.epochs = epochs
        self.split = StepSplit(len(data.dataset), data.global_batch_size, shuffle=data.shuffle,
                               seed=seed, drop_remainder=data.drop_remainder,
                               group_size=s.group_size, max_groups=s.groups)
        self._epoch = 0            # the epoch of the next one-epoch pass
        self._pass_epoch: int | None = None
        self._last: Any = None
        engine.progress_check = self._check_progress

    # -- what a DataLoader answers ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.split.steps_per_epoch * (self.epochs or 1)

    @property
    def dataset(self) -> Any:
        return self.data.dataset

    @property
    def batch_size(self) -> int:
        """The global batch size (every group together)."""
        return self.data.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.split.locate(self.engine.committed_steps)[0]

    def set_epoch(self, epoch: int) -> None:
        """For loops written for a ``DataLoader`` (the epoch comes from the committed step)."""
        self._epoch = epoch

    # -- iteration --------------------------------------------------------------------------------
    def _end(self) -> int:
        spe = self.split.steps_per_epoch
        if self.epochs is not None:
            return self.epochs * spe
        return (self._pass_epoch if self._pass_epoch is not None else self._epoch) * spe + spe

    def __iter__(self) -> LiveDataset:
        self._pass_epoch = None if self.epochs is not None else self._epoch
        return self

    def __next__(self) -> Any:
        quorum = self._next_quorum(self._end())
        if quorum is not None:
            return self._cut(quorum)
        if self._pass_epoch is not None:
            self._epoch = self._pass_epoch + 1
            self._pass_epoch = None
        raise StopIteration

    def until(self, end: int) -> Iterator[Any]:
        """The batches of the steps before committed step ``end``, across epochs."""
        self._pass_epoch = None
        while (quorum := self._next_quorum(end)) is not None:
            yield self._cut(quorum)

    def _next_quorum(self, end: int) -> Quorum | None:
        """The quorum of the next step before committed step ``end`` (``None``: no step left)."""
        engine = self.engine
        if engine.committed_steps >= end and not engine.in_step:
            return None
        quorum = engine.begin_step()
        return None if quorum.step >= end else quorum

    def _cut(self, quorum: Quorum) -> Any:
        share = self.split.share(quorum.step, quorum.participant, quorum.participants,
                                 self.engine.settings.rank)
        batch = self.data.load(share.indices)
        if self.device.type != "cpu":
            batch = tree_map(lambda t: t.to(self.device, non_blocking=True)
                             if isinstance(t, torch.Tensor) else t, batch)
        self.engine.use_share(share, self)
        self._last = batch
        return batch

    def reshare(self, args: tuple, quorum: Quorum) -> tuple | None:
        """``args`` with this dataset's batch cut anew for ``quorum`` (``None``: the data ended)."""
        last = self._last
        if quorum.step >= self._end():
            return None
        new = self._cut(quorum)
        # the batch itself, else its parts: the first of them an argument is, by identity
        pairs = [(last, new), *(zip(last, new) if isinstance(last, (tuple, list)) else ())]
        fresh = {id(old): cut for old, cut in reversed(pairs)}
        if not any(id(a) in fresh for a in args):
            raise LiveRecoveryError(
                f"{self.engine.who} must redo step {quorum.step} with a new quorum but cannot "
                "find the batch the distributed dataset gave among strategy.run's arguments. "
                "HINT: pass the batch (or its parts) from the distributed dataset to "
                "strategy.run as they are")
        return tuple(fresh.get(id(a), a) for a in args)

    # -- backups ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a backup keeps per rank beside the committed step (``LiveEngine.backup_state``)."""
        return self.engine.backup_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand a :meth:`state_dict` read from disk to the engine, for its ``resume_at``."""
        self.engine.from_backup = state or None

    # -- healing ---------------------------------------------------------------------------------
    def progress(self, step: int) -> dict[str, Any]:
        """The data position of committed step ``step`` (sent to a healing peer)."""
        epoch, index = self.split.locate(step)
        return {"epoch": epoch, "position": index, "steps_per_epoch": self.split.steps_per_epoch,
                "global_batch_size": self.data.global_batch_size}

    def _check_progress(self, progress: dict[str, Any]) -> None:
        who = self.engine.who
        if progress.get("global_batch_size", self.data.global_batch_size) != \
                self.data.global_batch_size or progress.get(
                    "steps_per_epoch", self.split.steps_per_epoch) != self.split.steps_per_epoch:
            raise LiveRecoveryError(
                f"{who} reads global batches of {self.data.global_batch_size} "
                f"({self.split.steps_per_epoch} steps per epoch) but its peer group reads "
                f"{progress.get('global_batch_size')} ({progress.get('steps_per_epoch')}). "
                "HINT: every group must build the same input")
        if self._pass_epoch is None:
            return
        step = int(progress.get("step", 0))
        spe = self.split.steps_per_epoch
        if not self._pass_epoch * spe <= step <= (self._pass_epoch + 1) * spe:
            raise EpochLoopError(
                f"{who} heals at step {step} (epoch {step // spe}) while its own loop is in "
                f"epoch {self._pass_epoch}: a healed process cannot learn a Python loop counter "
                "from a peer, so a script that loops epochs itself (`for epoch in range(E): "
                "for batch in dist: ...`) would train the wrong number of epochs. HINT: let the "
                "library count epochs: `for batch in strategy.distribute_dataset(loader, "
                "epochs=E)`, or `for step, batch in backup.steps(dist, epochs=E)`")

    def __repr__(self) -> str:
        return (f"LiveDataset(global batch {self.data.global_batch_size}, "
                f"{self.split.steps_per_epoch} steps per epoch, epochs {self.epochs}, "
                f"{self.engine.who})")
