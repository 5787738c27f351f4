"""DistributedDataset: what ``strategy.distribute_dataset`` returns: each replica's batches.

``distribute_dataset`` takes *global* batches (a ``DataLoader`` with the global batch size, a
dataset plus ``batch_size=``, or files plus ``reader=``) and gives each replica its part,
reading only what that replica needs where the input allows it (see ``AutoShardPolicy``).
``distribute_datasets_from_function`` calls the user's ``input_fn`` once per process with an
:class:`InputContext`; that pipeline already yields per-replica batches.

The dataset is a cursor over epochs: iterating it runs from the current position to the end of
the epoch, then moves to the next epoch. A loop left early with ``break`` leaves it mid-epoch;
the next loop continues there (``set_epoch(e)`` starts epoch ``e`` from its beginning).
``state_dict()`` / ``load_state_dict()`` save and restore that position as plain JSON data.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from replicator.data.distributed_iterator import DistributedIterator
from replicator.data.engines import ProcessEngine
from replicator.data.input_context import InputContext
from replicator.data.options import InputOptions
from replicator.data.pipeline_builder import Pipeline, build_global, build_per_replica

STATE_FORMAT = "replicator.input"
STATE_VERSION = 1


class DistributedDataset:
    """Iterate to get this replica's batches, already on the replica's device.

    ``mask`` is the per-sample weight of the last batch (1.0 real, 0.0 masked padding): pass it
    as ``rp.compute_average_loss(..., sample_weight=mask)`` and weight metrics with it so that
    a padded batch counts every real sample exactly once.
    """

    def __init__(self, pipeline: Pipeline, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = torch.device(device)
        self._epoch = 0
        self._position = 0
        self._active: DistributedIterator | None = None
        self._mask: torch.Tensor | None = None
        self._engine: ProcessEngine | None = None

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
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

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
                if hasattr(obj, "seed"):
                    obj.seed = seed
        self._close_active()
        self._epoch = epoch  # type: ignore[assignment]
        self._position = plan.load_state(state, epoch, position)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"DistributedDataset({self.pipeline.plan.describe()}, rank "
                f"{self.pipeline.rank} of {self.pipeline.world}, epoch {self._epoch}, "
                f"position {self._position})")


def distribute_dataset(data: Any, ctx: InputContext, device: torch.device, *,
                       batch_size: int | None = None, shuffle: bool | None = None,
                       seed: int = 0, drop_last: bool | None = None,
                       drop_remainder: bool | None = None,
                       transform: Callable[[Any], Any] | None = None,
                       reader: Callable[[str], Iterable[Any]] | None = None,
                       options: InputOptions | None = None) -> DistributedDataset:
    """Split global batches across replicas (see the module doc).

    ``drop_remainder`` (alias ``drop_last``; default: the DataLoader's ``drop_last``, else
    False): drop a short last global batch on every replica, or keep it split as evenly as
    possible, a replica without a sample getting a masked copy. ``transform``: a per-sample
    function run by the workers. ``reader``: with a list of file paths, ``reader(path)``
    yields the samples of one file.
    """
    if drop_last is not None and drop_remainder is not None and drop_last != drop_remainder:
        raise ValueError(f"drop_last={drop_last} and drop_remainder={drop_remainder} disagree; "
                         "give one of them (they are the same setting)")
    drop = drop_remainder if drop_remainder is not None else drop_last
    pipeline = build_global(data, ctx, batch_size=batch_size, shuffle=shuffle, seed=seed,
                            drop_remainder=drop, transform=transform, reader=reader,
                            options=options)
    return DistributedDataset(pipeline, device)


def distribute_datasets_from_function(input_fn: Callable[[InputContext], Iterable[Any]],
                                      ctx: InputContext, device: torch.device, *,
                                      drop_remainder: bool | None = None,
                                      options: InputOptions | None = None
                                      ) -> DistributedDataset:
    """Build this process's pipeline with ``input_fn(ctx)``; batches are per replica.

    When the replicas' pipelines end at different steps they agree: with
    ``drop_remainder=True`` (the default) all stop when the first runs out; with ``False``
    a replica out of data yields fully masked batches until all are done.
    """
    return DistributedDataset(build_per_replica(input_fn, ctx, drop_remainder=drop_remainder,
                                                options=options), device)
