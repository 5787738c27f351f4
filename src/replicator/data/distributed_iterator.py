"""DistributedIterator: one pass over this replica's batches, from a position to the epoch's end.

It runs the plan through the chosen engine and the prefetch queue, makes the step's stream wait
for the device copy, and keeps the owning dataset's position up to date (counting only batches
handed to the step, so prefetched ones are read again after a restart).

When replicas read different streams (``known_end`` is false) they agree on the end: before
its first step, and whenever the steps covered by the last agreement are used up, each replica
reports how many batches it has ready; all then run ``min(ready)`` more steps. When every
replica is out of data they stop together. With ``drop_remainder=True`` they stop as soon as
any replica is out of full batches; otherwise a replica out of data yields fully masked copies
of its last batch until all are done, so every real sample is used once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from replicator.data.agreement import Agreement
from replicator.data.batch_rows import repeat_first_row
from replicator.data.device_transfer import DeviceStage
from replicator.data.engines import run_inline, run_threads
from replicator.data.errors import EmptyShardError, InputPipelineError
from replicator.data.materialise import LocalBatch
from replicator.data.prefetch import make_queue
from replicator.errors import ReplicaMismatchError, ReplicatorError

if TYPE_CHECKING:
    from replicator.data.distributed_dataset import DistributedDataset

_NO_LIMIT = 2 ** 62


class DistributedIterator:
    """Iterator over this replica's batches (on its device) for the rest of one epoch."""

    def __init__(self, owner: DistributedDataset, epoch: int, position: int) -> None:
        pipe = owner.pipeline
        self._owner = weakref.ref(owner)  # the dataset holds its active iterator
        self._pipe = pipe
        self._plan = pipe.plan
        self.epoch = epoch
        self._position = position
        self._fresh = pipe.plan.fresh(epoch, position)
        self._stage = DeviceStage(owner.device, pipe.options.fetch_to_device,
                                  pipe.options.pin_memory)
        self._wait_on_close = False
        specs = pipe.plan.specs(epoch, position)
        if not pipe.num_workers or not pipe.plan.element_level:
            source = run_inline(specs, pipe.materialise)
        elif pipe.options.worker_type == "thread":
            source = run_threads(specs, pipe.materialise, pipe.num_workers,
                                 f"replicator-map-rank{pipe.rank}")
        else:
            source = owner._process_engine().run(specs)
            self._wait_on_close = True
        self._queue = make_queue(source, self._stage, prefetch=pipe.options.prefetch,
                                 timeout_seconds=pipe.options.timeout_seconds,
                                 name=f"replicator-input-rank{pipe.rank}",
                                 who=f"rank {pipe.rank}")
        self._agreement = None if pipe.plan.known_end else Agreement(pipe.rank, pipe.world)
        self._step = 0
        self._horizon = 0
        self._out_of_data = False
        self._last: LocalBatch | None = None
        self._done = False
        self.mask: torch.Tensor | None = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            item = self._next_agreed() if self._agreement is not None else self._next_known()
        except StopIteration:
            self._finish(completed=True)
            raise
        except ReplicatorError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise InputPipelineError(
                f"the input pipeline of rank {self._pipe.rank} failed while preparing step "
                f"{self._step} of epoch {self.epoch} ({self._plan.describe()}): "
                f"{type(exc).__name__}: {exc}") from exc
        self._step += 1
        self._last = item
        self.mask = item.mask
        owner = self._owner()
        if owner is not None:
            owner._advance(self, item.position)
        return (item.batch, item.mask) if self._pipe.options.with_mask else item.batch

    # -- known end: every replica finds the same end by itself -------------------------------
    def _next_known(self) -> LocalBatch:
        staged = self._queue.pop()
        if staged is None:
            if self._step == 0 and self._fresh:
                raise EmptyShardError(
                    f"epoch {self.epoch} has no batch for rank {self._pipe.rank}: the input is "
                    "empty, or has fewer samples than one global batch and drop_remainder=True. "
                    "HINT: use a smaller batch size, more data, or drop_remainder=False.")
            raise StopIteration
        return self._stage.ready(staged)

    # -- agreed end ------------------------------------------------------------------------------
    def _next_agreed(self) -> LocalBatch:
        if self._step >= self._horizon:
            self._agree()
        position = self._position + self._step + 1
        if self._out_of_data:
            return self._padding()._replace(position=position)
        staged = self._queue.pop()
        if staged is None:  # cannot happen: the agreement counted this batch as ready
            raise InputPipelineError(f"rank {self._pipe.rank} lost a batch it had reported "
                                     "ready; please report this as a bug")
        return self._stage.ready(staged)._replace(position=position)

    def _agree(self) -> None:
        drop = self._pipe.drop_remainder
        assert self._agreement is not None
        self._queue.wait(need_full=drop)
        ready, full = self._queue.counts()
        have = full if drop else ready
        out = self._queue.finished and have == 0
        world, rank = self._agreement.world, self._pipe.rank
        empty = out and self._fresh and self._step == 0
        values = [have if drop or not out else _NO_LIMIT, -have, self.epoch, -self.epoch,
                  -(world - rank) if empty else 0]
        low, neg_high, epoch_low, neg_epoch_high, empty_code = self._agreement.exchange(
            values, f"epoch {self.epoch}, step {self._step}")
        if epoch_low != -neg_epoch_high:
            raise ReplicaMismatchError(
                f"the replicas are in different epochs of their input (epochs {epoch_low} to "
                f"{-neg_epoch_high}; rank {rank} is in epoch {self.epoch}). HINT: every replica "
                "must iterate the dataset the same number of times and load the same state.")
        if empty_code < 0:
            bad = world + empty_code
            what = ("fewer samples than one per-replica batch" if drop
                    else "no samples")
            raise EmptyShardError(
                f"the input shard of rank {bad} has {what} in epoch {self.epoch}, so it cannot "
                f"take part in the steps ({self._plan.describe()}). HINT: give every replica "
                "data: more files or samples than replicas (AutoShardPolicy.DATA splits "
                "samples instead of files), or fewer replicas.")
        if low == 0 or -neg_high == 0:
            raise StopIteration
        self._horizon = self._step + low
        self._out_of_data = out

    def _padding(self) -> LocalBatch:
        """A fully masked batch, shaped like this replica's last one."""
        last = self._last
        if last is None:
            spec = self._plan.template_spec(self.epoch)
            if spec is None:
                raise EmptyShardError(f"rank {self._pipe.rank} has no sample at all to build a "
                                      "masked batch from; the input is empty")
            last = self._stage.ready(self._stage(self._pipe.materialise(spec)))
        rows = int(last.mask.numel()) or 1
        batch = repeat_first_row(last.batch, rows)
        return LocalBatch(batch, torch.zeros_like(last.mask) if last.mask.numel() else
                          torch.zeros(rows, device=last.mask.device), 0, True, last.position)

    def state_dict(self) -> dict[str, Any]:
        """The owning dataset's :meth:`~DistributedDataset.state_dict` (this pass's position)."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the distributed dataset of this iterator no longer exists")
        return owner.state_dict()

    # -- end -------------------------------------------------------------------------------------
    def _finish(self, completed: bool) -> None:
        self.close()
        owner = self._owner()
        if completed and owner is not None:
            owner._epoch_done(self)

    def close(self) -> None:
        """Stop the background work of this pass (the dataset keeps its position)."""
        if self._done:
            return
        self._done = True
        self._queue.close(wait=self._wait_on_close)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
