"""DistributedDataset and DistributedIterator: what ``strategy.distribute_dataset`` returns.

``distribute_dataset`` takes *global* batches (a ``DataLoader`` with the global batch size, a
dataset plus ``batch_size=``, files plus ``reader=``, or an ``rp.data.Dataset`` pipeline) and
gives each replica its part, reading only what that replica needs where the input allows it
(see ``AutoShardPolicy``).
``distribute_datasets_from_function`` calls the user's ``input_fn`` once per process with an
:class:`InputContext`; that pipeline already yields per-replica batches. Both take ``group``,
the process group of the data-parallel replicas (``None``: the default group): the context
gives this process's count and position on that data axis, and replicas whose inputs end
unevenly agree on that group only (see ``agreement``).

The dataset is a cursor over epochs: iterating it runs from the current position to the end of
the epoch, then moves to the next epoch. A loop left early with ``break`` leaves it mid-epoch;
the next loop continues there (``set_epoch(e)`` starts epoch ``e`` from its beginning).
``state_dict()`` / ``load_state_dict()`` save and restore that position as plain JSON data.

A :class:`DistributedIterator` is one pass: it runs the plan through the chosen engine and the
prefetch queue, makes the step's stream wait for the device copy, and keeps the owning
dataset's position up to date (counting only batches handed to the step, so prefetched ones
are read again after a restart).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from replicator.data import uneven
from replicator.data.agreement import EndAgreement, check_data_group, process_rank
from replicator.data.batching import LocalBatch, repeat_first_row
from replicator.data.context import InputContext, InputOptions
from replicator.data.dataflow import Dataset as Dataflow
from replicator.data.dataflow.distribute import build_dataflow
from replicator.data.errors import EmptyShardError, InputPipelineError
from replicator.data.pipeline import (
    Pipeline,
    ProcessEngine,
    build_global,
    build_per_replica,
    run_inline,
    run_threads,
)
from replicator.data.prefetch import DeviceStage, make_queue
from replicator.errors import ReplicatorError

STATE_FORMAT = "replicator.input"
STATE_VERSION = 1


# -- one pass over an epoch --------------------------------------------------------------------
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
        self._who = f"rank {process_rank(pipe.rank)}"  # the global rank, for messages
        specs = pipe.plan.specs(epoch, position)
        if pipe.engine is not None:
            source = pipe.engine(specs)
        elif not pipe.num_workers or not pipe.plan.element_level:
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
                                 who=self._who)
        self._agreement = None if pipe.plan.known_end else EndAgreement(
            pipe.rank, pipe.world, pipe.group, drop_remainder=pipe.drop_remainder,
            describe=pipe.plan.describe())
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
        start = time.perf_counter()
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
                f"the input pipeline of {self._who} failed while preparing step "
                f"{self._step} of epoch {self.epoch} ({self._plan.describe()}): "
                f"{type(exc).__name__}: {exc}") from exc
        self._step += 1
        self._last = item
        owner = self._owner()
        if owner is not None:
            owner._waited(time.perf_counter() - start)
        self.mask = cast(torch.Tensor, item.mask)  # a tensor once staged
        uneven.record(uneven.check(item, self._pipe.rank, self._pipe.world, self.epoch,
                                   self._step))
        if owner is not None:
            owner._advance(self, item.position)
        return (item.batch, item.mask) if self._pipe.options.with_mask else item.batch

    # -- known end: every replica finds the same end by itself -------------------------------
    def _next_known(self) -> LocalBatch:
        staged = self._queue.pop()
        if staged is None:
            if self._step == 0 and self._fresh:
                raise EmptyShardError(
                    f"epoch {self.epoch} has no batch for {self._who}: the input is "
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
            raise InputPipelineError(f"{self._who} lost a batch it had reported "
                                     "ready; please report this as a bug")
        return self._stage.ready(staged)._replace(position=position)

    def _agree(self) -> None:
        assert self._agreement is not None
        steps, out = self._agreement.agree(self._queue, epoch=self.epoch, step=self._step,
                                           fresh=self._fresh)
        self._horizon = self._step + steps
        self._out_of_data = out

    def _padding(self) -> LocalBatch:
        """A fully masked batch shaped like this replica's last one, or with
        ``partial_batch="empty"`` that batch's structure with 0 rows."""
        last = self._last
        if last is None:
            spec = self._plan.template_spec(self.epoch)
            if spec is None:
                raise EmptyShardError(f"{self._who} has no sample at all to build a "
                                      "masked batch from; the input is empty")
            last = self._stage.ready(self._stage(self._pipe.materialise(spec)))
        mask = cast(torch.Tensor, last.mask)  # a tensor once staged
        rows = 0 if self._pipe.partial_batch == "empty" else int(mask.numel()) or 1
        batch = repeat_first_row(last.batch, rows)
        return LocalBatch(batch, torch.zeros(rows, dtype=mask.dtype, device=mask.device), 0,
                          True, last.position)

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


# -- the dataset: a cursor over epochs, with its state -----------------------------------------
class DistributedDataset:
    """Iterate to get this replica's batches, already on the replica's device.

    ``mask`` is the per-sample weight of the last batch (1.0 real, 0.0 masked padding): pass it
    as ``rp.compute_average_loss(..., sample_weight=mask)`` and weight metrics with it so that
    a padded batch counts every real sample exactly once. ``len()``, ``dataset`` and
    ``batch_size`` answer as a DataLoader's do, so loops written for one keep working.
    """

    def __init__(self, pipeline: Pipeline, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = torch.device(device)
        self._epoch = 0
        self._position = 0
        self._active: DistributedIterator | None = None
        self._mask: torch.Tensor | None = None
        self._engine: ProcessEngine | None = None
        self._input_wait = 0.0

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> DistributedIterator:
        self._close_active()
        self._active = DistributedIterator(self, self._epoch, self._position)
        return self._active

    def __len__(self) -> int:
        """Steps in one whole epoch, where known without reading the data."""
        steps = self.pipeline.plan.steps_per_epoch()
        if steps is None:
            raise TypeError(f"this input ({self.pipeline.plan.describe()}) has no length: its "
                            "epochs end where the data ends")
        return steps

    @property
    def dataset(self) -> Any:
        """The dataset the input reads, as ``DataLoader.dataset``: the whole dataset (the
        DataLoader's, or the one given; a ``FileDataset`` for files), not this replica's part.
        For ``input_fn`` pipelines: the ``dataset`` of the loader ``input_fn`` returned (this
        replica's own), or that iterable itself."""
        return self.pipeline.dataset

    @property
    def batch_size(self) -> int | None:
        """The *global* batch size (all replicas together), as the DataLoader given was built;
        ``None`` where batches have no fixed size. For ``input_fn`` pipelines: the loader's
        per-replica ``batch_size`` times the replicas in sync."""
        return self.pipeline.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def input_wait_seconds(self) -> float:
        """Seconds the training loop spent blocked in ``next()`` waiting for a batch, over this
        dataset's life (a progress bar shows its share of the step time)."""
        return self._input_wait

    @property
    def mask(self) -> torch.Tensor | None:
        """Per-sample weights of the last batch handed out (``None`` before the first)."""
        return self._mask

    @property
    def shard_policy(self) -> str | None:
        """The sharding actually used (``AUTO`` resolved), e.g. ``"file"``."""
        policy = self.pipeline.policy
        return None if policy is None else policy.value

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch takes a non-negative integer, got {epoch!r}")
        self._close_active()
        self._epoch, self._position = epoch, 0

    def close(self) -> None:
        """Stop the current pass and shut down process workers (they are otherwise kept for
        the next epoch); iterating again starts them anew."""
        self._close_active()
        self._engine = None
        close_engine = getattr(self.pipeline.engine, "close", None)
        if close_engine is not None:  # a dataflow pipeline's workers
            close_engine()

    def _waited(self, seconds: float) -> None:
        self._input_wait += seconds
        dataflow = self.pipeline.dataset
        if isinstance(dataflow, Dataflow):  # its stats() show the step's wait too
            dataflow.runtime.waited(seconds)

    def _advance(self, it: DistributedIterator, position: int) -> None:
        if it is self._active:
            self._position = position
            self._mask = it.mask

    def _epoch_done(self, it: DistributedIterator) -> None:
        if it is self._active:
            self._epoch, self._position = it.epoch + 1, 0
            self._active = None

    def _process_engine(self) -> ProcessEngine:
        if self._engine is None:
            pipe = self.pipeline
            self._engine = ProcessEngine(pipe.materialise, num_workers=pipe.num_workers,
                                         prefetch=pipe.options.prefetch,
                                         timeout_seconds=pipe.options.timeout_seconds,
                                         start_method=pipe.start_method,
                                         worker_init_fn=pipe.worker_init_fn)
        return self._engine

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The input position as JSON-serialisable data (the same on every replica).

        Prefetched batches not yet handed to the step are not stored: they are read again
        from the position after a restart, so the restart sees exactly the batches an
        uninterrupted run would have seen next.
        """
        pipe, plan = self.pipeline, self.pipeline.plan
        state: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "kind": plan.kind,
            "epoch": self._epoch, "position": self._position,
            "position_unit": plan.position_unit, "seed": pipe.seed, "shuffle": pipe.shuffle,
            "global_batch_size": pipe.global_batch_size, "num_replicas": pipe.world,
            "shard_policy": self.shard_policy, "drop_remainder": pipe.drop_remainder,
        }
        state.update(plan.state(self._epoch, self._position))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (call before iterating)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"load_state_dict needs a state from DistributedDataset.state_dict()"
                             f" (a dict with format {STATE_FORMAT!r}), got "
                             f"{type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"input state version {state.get('version')!r} is not supported "
                             f"(this replicator reads version {STATE_VERSION})")
        pipe, plan = self.pipeline, self.pipeline.plan
        if state.get("kind") != plan.kind:
            raise ValueError(
                f"the input state was saved by a {state.get('kind')!r} pipeline, but this one is "
                f"{plan.kind!r} ({plan.describe()}). HINT: restore into a dataset built the same "
                "way (same kind of input and shard policy).")
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (epoch, position)):
            raise ValueError(f"the input state's epoch and position must be non-negative "
                             f"integers, got epoch={epoch!r}, position={position!r}")
        if bool(state.get("shuffle")) != pipe.shuffle:
            raise ValueError(f"the input state was saved with shuffle={state.get('shuffle')}, "
                             f"this dataset has shuffle={pipe.shuffle}; continuing would not "
                             "give the samples the saved run would have seen")
        seed = state.get("seed", pipe.seed)
        if seed != pipe.seed:
            warnings.warn(f"the input state was saved with seed {seed}; continuing with it "
                          f"instead of {pipe.seed}", RuntimeWarning, stacklevel=2)
            pipe.seed = seed
            for obj in (plan, getattr(plan, "open_stream", None)):
                if obj is not None and hasattr(obj, "seed"):
                    obj.seed = seed
        self._close_active()
        self._epoch = epoch  # type: ignore[assignment]
        self._position = plan.load_state(state, epoch, position)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"DistributedDataset({self.pipeline.plan.describe()}, rank "
                f"{self.pipeline.rank} of {self.pipeline.world}, epoch {self._epoch}, "
                f"position {self._position})")


# -- entry points ------------------------------------------------------------------------------
def distribute_dataset(data: Any, ctx: InputContext, device: torch.device, *,
                       batch_size: int | None = None, shuffle: bool | None = None,
                       seed: int = 0, drop_last: bool | None = None,
                       drop_remainder: bool | None = None,
                       transform: Callable[[Any], Any] | None = None,
                       reader: Callable[[str], Iterable[Any]] | None = None,
                       options: InputOptions | None = None,
                       group: Any = None, partial_batch: str = "mask") -> DistributedDataset:
    """Split global batches across replicas (see the module doc).

    ``drop_remainder`` (alias ``drop_last``; default: the DataLoader's ``drop_last``, else
    False): drop a short last global batch on every replica, or keep it split as evenly as
    possible. ``partial_batch``: what a replica without a sample of that batch gets:
    ``"mask"`` (default) one masked copy of a sample (mask 0), so every step has a row;
    ``"empty"`` a batch of 0 rows, as tf.distribute gives. ``transform``: a per-sample
    function run by the workers. ``reader``: with a list of file paths, ``reader(path)``
    yields the samples of one file. ``group``: the process group of the data-parallel
    replicas (``None``: the default group); ``ctx`` gives this process's count and position
    on that axis, and the group's size must equal ``ctx.num_replicas_in_sync``.
    """
    check_data_group(group, ctx.num_replicas_in_sync, "distribute_dataset")
    if drop_last is not None and drop_remainder is not None and drop_last != drop_remainder:
        raise ValueError(f"drop_last={drop_last} and drop_remainder={drop_remainder} disagree; "
                         "give one of them (they are the same setting)")
    drop = drop_remainder if drop_remainder is not None else drop_last
    if isinstance(data, Dataflow):
        return DistributedDataset(build_dataflow(
            data, ctx, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop,
            transform=transform, reader=reader, options=options, group=group,
            partial_batch=partial_batch), device)
    pipeline = build_global(data, ctx, batch_size=batch_size, shuffle=shuffle, seed=seed,
                            drop_remainder=drop, transform=transform, reader=reader,
                            options=options, group=group, partial_batch=partial_batch)
    return DistributedDataset(pipeline, device)


def distribute_datasets_from_function(input_fn: Callable[[InputContext], Iterable[Any]],
                                      ctx: InputContext, device: torch.device, *,
                                      drop_remainder: bool | None = None,
                                      options: InputOptions | None = None,
                                      group: Any = None,
                                      partial_batch: str = "mask") -> DistributedDataset:
    """Build this process's pipeline with ``input_fn(ctx)``; batches are per replica.

    When the replicas' pipelines end at different steps they agree, on ``group`` (the process
    group of the data-parallel replicas; ``None``: the default group; its size must equal
    ``ctx.num_replicas_in_sync``): with ``drop_remainder=True`` (the default) all stop before
    the first short batch of any replica (shorter than the loader's ``batch_size``, or than
    the epoch's first batch) or when the first runs out, so every step has full batches; with
    ``False`` every batch is kept and a replica out of data yields, by ``partial_batch``,
    fully masked copies of its last batch (``"mask"``) or batches of 0 rows (``"empty"``)
    until all are done.
    """
    check_data_group(group, ctx.num_replicas_in_sync, "distribute_datasets_from_function")
    return DistributedDataset(build_per_replica(input_fn, ctx, drop_remainder=drop_remainder,
                                                options=options, group=group,
                                                partial_batch=partial_batch), device)
