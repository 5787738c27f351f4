"""An ``rp.data.Dataset`` as the global-batch pipeline of ``strategy.distribute_dataset``.

The pipeline's ``batch(B)`` makes *global* batches. Everything before it (the "head": sources,
shuffles, filters, caches, interleaves) is a stream every replica reads in the same order, a
function of the seed and the epoch only; the maps fused into the batch (``ops.lower``: the
decode and augment) run only on this replica's part of each global batch, in the pipeline's
own workers. Splitting is the input room's one splitter (:class:`StreamPlan` over
``batching.replica_part``), so the global batches, the mask of a short last batch, and the
position saved in a state (elements of the head stream) are those of any other global-batch
input: a state saved on N replicas resumes on M with every remaining sample exactly once.
Maps before an order operator that cannot move (``filter``, ``cache``) run on every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from replicator.data.batching import (
    LocalBatch,
    Materialiser,
    Spec,
    check_divisible,
    check_partial_batch,
)
from replicator.data.context import AutoShardPolicy, InputContext, InputOptions
from replicator.data.dataflow.dataset import Dataset
from replicator.data.dataflow.graph import Ctx, Node, Runtime
from replicator.data.dataflow.ops import Batch, Map, Prefetch, _report
from replicator.data.dataflow.options import AUTOTUNE
from replicator.data.dataflow.work import BatchWork, default_batch_collate
from replicator.data.pipeline import Pipeline
from replicator.data.sharding import StreamPlan


class DataflowPlan(StreamPlan):
    """The head stream split into global batches; resumes by skipping without computing."""

    kind = "dataflow"

    def __init__(self, head: Node, runtime: Runtime, batch_size: int, rank: int, world: int,
                 **settings: Any) -> None:
        super().__init__(self._open, batch_size, rank, world, shuffle_buffer=1, **settings)
        self.head, self.runtime = head, runtime

    def _open(self, epoch: int) -> Iterator[Any]:
        return self.head.iterate(Ctx(epoch, self.runtime))

    def stream_from(self, epoch: int, position: int) -> Iterator[Any] | None:
        return self.head.iterate(Ctx(epoch, self.runtime), position)

    def steps_per_epoch(self) -> int | None:
        size = self.head.cardinality()
        if size < 0:
            return None
        full, rest = divmod(size, self.global_batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def describe(self) -> str:
        return (f"dataflow {self.head.describe()}, global batches of {self.global_batch_size} "
                f"over {self.world} replicas")


class _Collate:
    """The batch's collate, then the maps that followed the batch (on this replica's part)."""

    def __init__(self, collate: Callable[[list[Any]], Any], after: tuple[Callable, ...]) -> None:
        self.collate, self.after = collate, after

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate(samples)
        for fn in self.after:
            batch = fn(batch)
        return batch


@dataclass
class DataflowMaterialiser(Materialiser):
    """Maps (fused into the batch) and collates this replica's samples; a sample skipped by
    ``on_error="skip"`` becomes a masked row, so every replica's batch keeps its shape."""

    work: BatchWork | None = None

    def run(self, spec: Spec) -> tuple[LocalBatch, list[str]]:
        assert self.work is not None
        samples, failures = self.work.load(list(spec.items))
        kept = spec._replace(real=max(0, spec.real - len(failures))) if failures else spec
        return self.assemble(kept, samples), failures

    def __call__(self, spec: Spec, mapper: Any = map) -> LocalBatch:
        return self.run(spec)[0]





class _Engine:
    """Runs a plan's specs through the dataset's pool (one task per replica's batch)."""

    def __init__(self, runtime: Runtime, materialiser: DataflowMaterialiser, name: str,
                 parallel: int, deterministic: bool, key: Any) -> None:
        self.runtime, self.materialiser, self.key = runtime, materialiser, key
        self.name, self.parallel, self.deterministic = name, parallel, deterministic

    def close(self) -> None:
        """Stop this stage's workers (the next pass starts new ones)."""
        pool = self.runtime.pools.pop(self.key, None)
        if pool is not None:
            pool.close()

    def __call__(self, specs: Iterator[Spec]) -> Iterator[LocalBatch]:
        ctx = Ctx(0, self.runtime)
        if self.parallel == 1:  # num_parallel_calls=None: in the prefetch thread
            results: Iterator[Any] = map(self.materialiser.run, specs)
        else:
            pool = self.runtime.pool(self.key, self.name, self.materialiser.run, self.parallel)
            results = pool.imap(specs, self.deterministic,
                                lambda s: f"a batch ending at element {s.position}")
        for item, failures in results:
            _report(ctx, ([], failures))
            yield item


def _split_tail(node: Node, batch_size: int | None) -> tuple[Batch, tuple[Callable, ...]]:
    """The batch node and the maps after it (prefetches dropped: the distributed dataset
    prefetches); anything else after the batch is refused."""
    after: list[Callable] = []
    while not isinstance(node, Batch):
        if isinstance(node, Prefetch):
            node = node.up
        elif isinstance(node, Map) and node.pure and any(isinstance(n, Batch)
                                                          for n in node.chain()):
            after.insert(0, node.fn)
            node = node.up
        elif any(isinstance(n, Batch) for n in node.chain()):
            raise ValueError(
                f"distribute_dataset splits the pipeline's global batches, so only map() and "
                f"prefetch() may follow batch(); this pipeline has {node.describe()} after it. "
                "HINT: the distributed dataset runs epochs itself (no repeat()); put take/skip/"
                "filter before batch()")
        else:
            if batch_size is None:
                raise ValueError("this pipeline has no batch(): call .batch(GLOBAL_BATCH) or "
                                 "pass distribute_dataset(ds, batch_size=GLOBAL_BATCH)")
            from replicator.data.dataflow.ops import lower

            return _split_tail(lower(Batch(node, batch_size, False, None)), batch_size)
    if batch_size is not None and batch_size != node.size:
        raise ValueError(f"the pipeline's batch({node.size}) and batch_size={batch_size} "
                         "disagree; give the global batch size once")
    return node, tuple(after)


def build_dataflow(data: Dataset, ctx: InputContext, *, batch_size: int | None,
                   shuffle: bool | None, seed: int, drop_remainder: bool | None,
                   transform: Any, reader: Any, options: InputOptions | None, group: Any,
                   partial_batch: str) -> Pipeline:
    """The :class:`Pipeline` of ``distribute_dataset(dataflow_dataset)``."""
    options = options or InputOptions()
    if transform is not None or reader is not None or shuffle:
        raise ValueError("with an rp.data.Dataset, transform=, reader= and shuffle= belong in "
                         "the pipeline: ds.map(transform), ds.shuffle(buffer, seed)")
    if options.shard_policy not in (AutoShardPolicy.AUTO, AutoShardPolicy.DATA):
        raise ValueError("an rp.data.Dataset is split by global batches (AutoShardPolicy.DATA)"
                         "; for per-replica pipelines use distribute_datasets_from_function")
    batch, after = _split_tail(data.lowered(), batch_size)
    rank, world = ctx.input_pipeline_id, ctx.num_replicas_in_sync
    check_divisible(batch.size, world)
    drop = batch.drop_remainder if drop_remainder is None else bool(drop_remainder)
    partial_batch = check_partial_batch(partial_batch, options.pad_last_batch)
    runtime = data.runtime
    plan = DataflowPlan(batch.up, runtime, batch.size, rank, world, shuffle=False,
                        seed=data.options.seed, drop_remainder=drop,
                        pad_last_batch=options.pad_last_batch, load_all=False,
                        empty_part=partial_batch == "empty")
    work = batch.work()
    collate = _Collate(batch.collate or default_batch_collate, after)
    work.collate = collate
    materialiser = DataflowMaterialiser(collate=collate, work=work)
    engine = None
    if batch.maps:
        parallel = min((m.parallel for m in batch.maps if m.parallel != AUTOTUNE),
                       default=AUTOTUNE)
        if options.num_workers is not None:
            parallel = max(1, options.num_workers)
        forced = data.options.deterministic
        deterministic = all(m.deterministic for m in batch.maps) if forced is None else forced
        # one pool per batch stage, however often the dataset is distributed
        engine = _Engine(runtime, materialiser, batch.describe(), parallel, deterministic,
                         key=("distributed", id(batch)))
    return Pipeline(plan, materialiser, options, rank, world, AutoShardPolicy.DATA,
                    data.options.seed, False, batch.size, drop, 0, None, None, group,
                    partial_batch, data, engine)
