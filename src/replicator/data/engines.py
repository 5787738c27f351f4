"""Engines: run a plan's specs through workers and yield materialised batches, in order.

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
import pickle
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import DataLoader, Dataset

from replicator.data.materialise import LocalBatch, Materialiser, Spec


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


def _as_is(item: LocalBatch) -> LocalBatch:
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
