"""Building and running one replica's input pipeline.

Building: what the user has (Dataset, IterableDataset, DataLoader, files + reader, ``input_fn``)
becomes a :class:`Pipeline`: a plan (which samples per step, from ``sharding``), a
materialiser (how to load and assemble them, from ``batching``) and the settings of the
workers that run it (:func:`build_global`, :func:`build_per_replica`).

Running: engines take a plan's specs through workers and yield materialised batches, in order:

* inline: everything in the calling thread (the prefetch thread when prefetch is on);
* threads: a thread pool loads and transforms the samples (parallel map), one batch ahead;
* processes: a ``torch.utils.data.DataLoader`` whose "indices" are our specs, so its worker
  processes load, transform and collate whole batches while the plan (and any stream) is read
  once, here. The DataLoader keeps results in order and reports worker errors with their
  traceback; the workers never iterate the user's stream themselves. Its workers persist
  across epochs, so a spawn start (an interpreter and ``import torch`` each) is paid once.
"""

from __future__ import annotations

import math
import os
import pickle
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from replicator.data.batching import (
    LocalBatch,
    Materialiser,
    Spec,
    check_divisible,
    check_partial_batch,
    derived_seed,
    shuffled,
)
from replicator.data.context import AutoShardPolicy, InputContext, InputOptions
from replicator.data.errors import EmptyShardError
from replicator.data.sharding import (
    FileDataset,
    FileShardPlan,
    IndexPlan,
    LoaderPlan,
    PerReplicaPlan,
    Plan,
    StreamPlan,
)


# -- building ----------------------------------------------------------------------------------
@dataclass
class Pipeline:
    """Everything a distributed dataset needs to run one replica's input."""

    plan: Plan
    materialise: Materialiser
    options: InputOptions
    rank: int
    world: int
    policy: AutoShardPolicy | None = None     # None for input_fn pipelines
    seed: int = 0
    shuffle: bool = False
    global_batch_size: int | None = None
    drop_remainder: bool = False
    num_workers: int = 0
    worker_init_fn: Callable[[int], None] | None = None
    start_method: Any = None
    group: Any = None    # process group of the data-parallel replicas (None: the default)
    partial_batch: str = "mask"  # a replica without a sample: "mask" (a copy) or "empty"
    dataset: Any = None  # what the user's input reads (for DistributedDataset.dataset)
    #: runs the specs instead of the engines below (a dataflow pipeline's own workers)
    engine: Callable[[Iterator[Spec]], Iterator[LocalBatch]] | None = None


def _is_standard_loader(loader: DataLoader) -> bool:
    """A DataLoader whose batches are consecutive chunks of a (random) order of the whole
    dataset, so they can be rebuilt sample by sample from a seeded order."""
    sampler = loader.sampler
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return False
    if type(sampler) is SequentialSampler:
        return True
    return (type(sampler) is RandomSampler and not sampler.replacement
            and sampler.num_samples == len(loader.dataset))  # type: ignore[arg-type]


class _FileStream:
    """Every file in the epoch's (seeded) order, for DATA sharding of files."""

    def __init__(self, files: FileDataset, shuffle: bool, seed: int) -> None:
        self.files, self.shuffle, self.seed = files, shuffle, seed

    def __call__(self, epoch: int) -> Iterable[Any]:
        paths = self.files.files
        if self.shuffle:
            paths = shuffled(paths, derived_seed(self.seed, epoch))
        for path in paths:
            yield from self.files.read(path)


def _iterable_stream(dataset: Any) -> Callable[[int], Iterable[Any]]:
    def open_stream(epoch: int) -> Iterable[Any]:
        if callable(getattr(dataset, "set_epoch", None)):
            dataset.set_epoch(epoch)  # type: ignore[attr-defined]
        return iter(dataset)
    return open_stream


def _resolve_policy(policy: AutoShardPolicy, dataset: Any, world: int,
                    custom_loader: bool) -> AutoShardPolicy:
    is_files = isinstance(dataset, FileDataset)
    if policy is AutoShardPolicy.FILE:
        if not is_files:
            raise TypeError(
                f"AutoShardPolicy.FILE needs a list of files: pass distribute_dataset(paths, "
                f"reader=read_file) or a rp.data.FileDataset, got {type(dataset).__name__}. "
                "HINT: use AutoShardPolicy.DATA (or AUTO) for other datasets.")
        if dataset.num_files < world:
            raise EmptyShardError(
                f"AutoShardPolicy.FILE needs at least one file per replica, but there are "
                f"{dataset.num_files} files for {world} replicas, so some replicas would read "
                "nothing. HINT: split the data into more files, or use AutoShardPolicy.DATA "
                "(every replica reads every file and keeps its share) or AUTO.")
    if custom_loader and policy is not AutoShardPolicy.OFF:
        if policy is AutoShardPolicy.AUTO:
            return AutoShardPolicy.OFF
        raise ValueError(
            f"AutoShardPolicy.{policy.name} rebuilds batches sample by sample, which this "
            "DataLoader does not allow (a custom sampler or batch sampler, or batch_size=None). "
            "HINT: use AutoShardPolicy.OFF (every replica runs the loader and keeps its rows), "
            "or build the DataLoader with batch_size=GLOBAL_BATCH and shuffle=True/False.")
    if policy is AutoShardPolicy.AUTO:
        if is_files and dataset.num_files >= world:
            return AutoShardPolicy.FILE
        if is_files and world > 1:
            warnings.warn(f"{dataset.num_files} files for {world} replicas: sharding by DATA "
                          "(every replica reads every file) instead of by FILE", stacklevel=4)
        return AutoShardPolicy.DATA
    return policy


def build_global(data: Any, ctx: InputContext, *, batch_size: int | None, shuffle: bool | None,
                 seed: int, drop_remainder: bool | None, transform: Callable[[Any], Any] | None,
                 reader: Callable[[str], Iterable[Any]] | None,
                 options: InputOptions | None, group: Any = None,
                 partial_batch: str = "mask") -> Pipeline:
    """The pipeline of ``distribute_dataset``: global batches split across replicas (the
    replicas of ``ctx``, whose data-parallel process group is ``group``)."""
    options, seed = _checked_arguments(options, transform, seed)
    partial_batch = check_partial_batch(partial_batch, options.pad_last_batch)
    empty_part = partial_batch == "empty"
    rank, world = ctx.input_pipeline_id, ctx.num_replicas_in_sync
    if reader is not None:
        if isinstance(data, (Dataset, DataLoader)):
            raise TypeError("reader= goes with a list of file paths, not with a Dataset or "
                            "DataLoader")
        data = FileDataset(data, reader)
    loader: DataLoader | None = None
    collate: Callable[[list[Any]], Any] | None = None
    num_workers, worker_init_fn, start_method = 0, None, options.worker_start_method
    if isinstance(data, DataLoader):
        loader, dataset = data, data.dataset
        if isinstance(data.sampler, DistributedSampler):
            raise ValueError(
                "this DataLoader already shards its data with a DistributedSampler, but "
                "distribute_dataset takes *global* batches and shards them itself. HINT: build "
                "the DataLoader with batch_size=GLOBAL_BATCH and shuffle=True (no sampler), or "
                "keep your per-replica loader and use distribute_datasets_from_function.")
        if batch_size is None:
            batch_size = data.batch_size
        if drop_remainder is None:
            drop_remainder = data.drop_last
        if shuffle is None:
            shuffle = isinstance(data.sampler, RandomSampler)
        if data.collate_fn is not default_collate:
            collate = data.collate_fn
        num_workers, worker_init_fn = data.num_workers, data.worker_init_fn
        start_method = start_method or data.multiprocessing_context
    elif isinstance(data, Dataset):
        dataset = data
    else:
        hint = (" HINT: for a list of files pass reader=read_file;" if isinstance(
            data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike)) else "")
        raise TypeError(f"distribute_dataset takes a DataLoader or a Dataset (or a list of files "
                        f"with reader=), got {type(data).__name__}.{hint} HINT: for per-replica "
                        "input pipelines use distribute_datasets_from_function(input_fn).")
    if options.num_workers is not None:
        num_workers = options.num_workers
    iterable = isinstance(dataset, IterableDataset)
    custom = loader is not None and (loader.batch_size is None if iterable
                                     else not _is_standard_loader(loader))
    policy = _resolve_policy(AutoShardPolicy.parse(options.shard_policy), dataset, world, custom)
    if batch_size is None and not (custom and policy is AutoShardPolicy.OFF):
        raise ValueError("distribute_dataset(dataset) needs batch_size=GLOBAL_BATCH, or a "
                         "DataLoader built with the global batch size")
    if batch_size is not None:
        check_divisible(batch_size, world)
    shuffle, drop_remainder = bool(shuffle), bool(drop_remainder)
    settings: dict[str, Any] = dict(shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
                    pad_last_batch=options.pad_last_batch)
    split = dict(settings, empty_part=empty_part)  # the plans that split global batches
    plan, materialise, num_workers = _choose_plan(
        loader, dataset, policy, custom, batch_size, rank, world, settings, split, options,
        Materialiser(transform=transform, collate=collate), num_workers)
    if num_workers and options.worker_type == "process" and plan.element_level:
        method = start_method if isinstance(start_method, str) or start_method is None \
            else start_method.get_start_method()
        check_picklable(transform, "transform", method)
        check_picklable(collate, "collate_fn", method)
    return Pipeline(plan, materialise, options, rank, world, policy, seed, shuffle, batch_size,
                    drop_remainder, num_workers, worker_init_fn, start_method, group,
                    partial_batch, dataset)


def _checked_arguments(options: InputOptions | None, transform: Callable[[Any], Any] | None,
                       seed: Any) -> tuple[InputOptions, int]:
    """``distribute_dataset``'s options (the default when ``None``) and seed, checked."""
    options = options or InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be rp.data.InputOptions, got {type(options).__name__}")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be a function sample -> sample, got "
                        f"{type(transform).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            seed = int(seed)  # numpy integers
        except (TypeError, ValueError):
            raise TypeError(f"seed must be an integer, got {type(seed).__name__}") from None
    return options, seed


def _choose_plan(loader: DataLoader | None, dataset: Any, policy: AutoShardPolicy, custom: bool,
                 batch_size: int | None, rank: int, world: int, settings: dict[str, Any],
                 split: dict[str, Any], options: InputOptions, materialise: Materialiser,
                 num_workers: int) -> tuple[Plan, Materialiser, int]:
    """How the global batches are read and split (by the loader itself, by file, from a
    stream or by index), the materialiser of its elements and the workers it keeps."""
    transform = materialise.transform
    drop_remainder, empty_part = settings["drop_remainder"], split["empty_part"]
    shuffle, seed = settings["shuffle"], settings["seed"]
    iterable = isinstance(dataset, IterableDataset)
    plan: Plan
    if loader is not None and (custom or (iterable and policy is AutoShardPolicy.OFF)):
        if transform is not None:
            raise ValueError("transform= needs sample-by-sample reading, which this DataLoader "
                             "does not allow; apply the transform in the dataset instead")
        plan = LoaderPlan(loader, batch_size, rank, world, drop_remainder=drop_remainder,
                          pad_last_batch=options.pad_last_batch, empty_part=empty_part,
                          seed=seed)
        materialise = Materialiser(collated=True)
        num_workers = 0  # the loader runs its own workers
    elif policy is AutoShardPolicy.FILE:
        plan = FileShardPlan(dataset, batch_size, rank, world,  # type: ignore[arg-type]
                             shuffle_buffer=options.shuffle_buffer, **settings)
    elif iterable:
        opener = (_FileStream(dataset, shuffle, seed) if isinstance(dataset, FileDataset)
                  else _iterable_stream(dataset))
        plan = StreamPlan(opener, batch_size, rank, world,  # type: ignore[arg-type]
                          shuffle_buffer=options.shuffle_buffer,
                          load_all=policy is AutoShardPolicy.OFF, **split)
    else:
        num_samples = len(dataset)  # type: ignore[arg-type]
        if num_samples < world:
            raise EmptyShardError(
                f"the dataset has {num_samples} samples for {world} replicas, so some replica "
                "would never get one. HINT: use fewer replicas or more data.")
        materialise.dataset = dataset
        plan = IndexPlan(num_samples, batch_size, rank, world,  # type: ignore[arg-type]
                         load_all=policy is AutoShardPolicy.OFF, **split)
    return plan, materialise, num_workers


def build_per_replica(input_fn: Callable[[InputContext], Iterable[Any]], ctx: InputContext, *,
                      drop_remainder: bool | None, options: InputOptions | None,
                      group: Any = None, partial_batch: str = "mask") -> Pipeline:
    """The pipeline of ``distribute_datasets_from_function``: the user's per-replica batches
    (the replicas of ``ctx``, whose data-parallel process group is ``group``)."""
    options = options or InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be rp.data.InputOptions, got {type(options).__name__}")
    if not callable(input_fn):
        raise TypeError("distribute_datasets_from_function needs a function input_fn(ctx)")
    loader = input_fn(ctx)
    if not isinstance(loader, Iterable):
        raise TypeError(f"input_fn returned {type(loader).__name__}, which is not iterable; "
                        "return a DataLoader or another iterable of per-replica batches")
    drop = True if drop_remainder is None else bool(drop_remainder)
    declared = getattr(loader, "batch_size", None)
    global_batch = declared * ctx.num_replicas_in_sync \
        if isinstance(declared, int) and declared > 0 else None
    return Pipeline(PerReplicaPlan(loader, drop_remainder=drop), Materialiser(collated=True),
                    options, ctx.input_pipeline_id, ctx.num_replicas_in_sync,
                    global_batch_size=global_batch, drop_remainder=drop, group=group,
                    partial_batch=check_partial_batch(partial_batch, options.pad_last_batch),
                    dataset=getattr(loader, "dataset", loader))


# -- engines ------------------------------------------------------------------------------------
def run_inline(specs: Iterator[Spec], materialise: Materialiser) -> Iterator[LocalBatch]:
    for spec in specs:
        yield materialise(spec)


def run_threads(specs: Iterator[Spec], materialise: Materialiser, num_workers: int,
                name: str) -> Iterator[LocalBatch]:
    """Load the samples of the next batch while this one is collated and handed on. The pool
    lives as long as this generator (it is shut down when the generator is closed)."""
    pool = ThreadPoolExecutor(num_workers, thread_name_prefix=name)
    pending: deque[tuple[Spec, list[Future[Any]] | None]] = deque()

    def finish() -> LocalBatch:
        spec, futures = pending.popleft()
        if futures is None:
            return materialise(spec)
        return materialise.assemble(spec, [f.result() for f in futures])

    try:
        for spec in specs:
            futures = None if materialise.collated else [
                pool.submit(materialise.load, item) for item in spec.items]
            pending.append((spec, futures))
            if len(pending) > 1:
                yield finish()
        while pending:
            yield finish()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class _SpecDataset(Dataset):
    """A map-style view whose "index" is a spec: ``dataset[spec]`` is the materialised batch."""

    def __init__(self, materialise: Materialiser) -> None:
        self.materialise = materialise

    def __getitem__(self, spec: Spec) -> LocalBatch:  # type: ignore[override]
        return self.materialise(spec)


class _Specs:
    """The DataLoader's sampler: hands it the current pass's specs."""

    def __init__(self) -> None:
        self.specs: Iterator[Spec] = iter(())

    def __iter__(self) -> Iterator[Spec]:
        return self.specs


def _as_is(item: Any) -> Any:
    return item


class ProcessEngine:
    """Process workers that live as long as the dataset (started once, reused every epoch)."""

    def __init__(self, materialise: Materialiser, *, num_workers: int, prefetch: int,
                 timeout_seconds: float, start_method: Any,
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        self._sampler = _Specs()
        self._loader = DataLoader(
            _SpecDataset(materialise), batch_size=None,
            sampler=self._sampler,  # type: ignore[arg-type]
            collate_fn=_as_is, num_workers=num_workers,
            prefetch_factor=max(2, math.ceil(prefetch / num_workers)),
            persistent_workers=True, timeout=timeout_seconds,
            multiprocessing_context=start_method, worker_init_fn=worker_init_fn)

    def run(self, specs: Iterator[Spec]) -> Iterator[LocalBatch]:
        """One pass; a pass left early is discarded by the DataLoader when the next starts.
        Passes must not overlap (the distributed dataset ends one before starting another)."""
        self._sampler.specs = specs
        yield from iter(self._loader)


def check_picklable(obj: Any, what: str, start_method: str | None) -> None:
    """Process workers started by spawn/forkserver receive ``obj`` pickled: fail early, clearly."""
    import multiprocessing as mp

    method = start_method or mp.get_context().get_start_method()
    if obj is None or method == "fork":
        return
    try:
        pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure has the same fix
        raise TypeError(
            f"the {what} {getattr(obj, '__qualname__', type(obj).__name__)!r} cannot be "
            f"pickled, but process workers started with {method!r} receive it pickled "
            f"({type(exc).__name__}: {exc}). HINT: define it at module level (not a lambda or "
            "a nested function), or use InputOptions(worker_type='thread').") from exc
