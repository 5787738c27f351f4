"""``BackupAndRestore.steps`` in a live-recovery job (replica groups on torchft).

The position comes from the committed step (a healed group receives it from its peer), each
batch from the live dataset; one group writes the backups (all hold the same state). In rounds
(DiLoCo, LocalSGD) the run resumes at the round's start. SIGTERM makes a group leave the job,
so the backup's own preemption handling is off here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

from replicator.resume.rank_state import restore_rng

if TYPE_CHECKING:
    from replicator.strategies.live.dataset import LiveDataset


def is_live(dataset: Any) -> TypeGuard[LiveDataset]:
    """True for the distributed dataset of a live-recovery job."""
    from replicator.strategies.live.dataset import LiveDataset

    return isinstance(dataset, LiveDataset)


def live_steps(backup: Any, dataset: LiveDataset, *, epochs: int | None,
               num_steps: int | None) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` until ``epochs`` epochs or ``num_steps`` steps are committed
    (``backup``: the ``BackupAndRestore`` whose ``steps`` this is)."""
    engine = dataset.engine
    spe = dataset.split.steps_per_epoch
    ends = [n for n in (epochs * spe if epochs is not None else None, num_steps)
            if n is not None]
    end = min(ends)
    backup.handle_preemption = False  # SIGTERM: the group leaves (engine.py)
    backup.on_train_begin()
    resume = backup._resume
    if backup.step > engine.committed_steps:
        if resume is not None:  # first: a run in rounds resumes at its round's start, with
            restore_rng(resume.pop("rng", None))  # that start's random state
            dataset.load_state_dict(resume.get("data") or {})
        engine.resume_at(backup.step)
    backup._resume = None
    try:
        for batch in dataset.until(end):
            yield engine.committed_steps + 1, batch
            step = engine.committed_steps
            epoch, index = divmod(step - 1, spe)
            if not engine.writes_backups:
                backup.step, (backup.epoch, backup.step_in_epoch) = step, divmod(step, spe)
                continue
            backup.step, backup.epoch, backup.step_in_epoch = step - 1, epoch, index
            backup.on_train_batch_end(index)
            if index + 1 == spe:
                backup.on_epoch_end(epoch)
        if engine.writes_backups:
            backup.on_train_end()
    except BaseException:
        backup.wait_for_save(raise_errors=False)
        raise
    finally:
        backup.close()


__all__ = ["is_live", "live_steps"]
