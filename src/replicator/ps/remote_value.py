"""What ``ClusterCoordinator.schedule`` and ``create_per_worker_dataset`` hand back.

:class:`RemoteValue`: the future result of a scheduled function; ``fetch()`` waits for it
(and raises the function's error with the worker's rank and traceback). :class:`PerWorkerValues`:
one value per worker, held by the workers (a per-worker dataset's iterator); passed to
``schedule`` it becomes the running worker's own. tf.distribute's names and behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from replicator.ps.values import ResourceRef


class _Coordinator(Protocol):
    """What a value needs of the coordinator that made it (``ClusterCoordinator``); a protocol
    rather than an import, so the two modules do not import each other."""

    def _fetch(self, value: RemoteValue) -> Any: ...

    def _value_done(self, value: RemoteValue) -> bool: ...


class RemoteValue:
    """The result of one scheduled function, available once it ran on some worker."""

    def __init__(self, coordinator: _Coordinator, number: int, name: str) -> None:
        self._coordinator = coordinator
        self._number = number
        self._name = name

    def fetch(self) -> Any:
        """Wait for the function and return its value (tensors come back as CPU tensors);
        raises what it raised, as ``RemoteFunctionError`` naming the worker and its traceback.
        The chief may call it alone (it needs nothing from the workers); on a worker it runs
        functions meanwhile and returns the same value, or raises the same class, as on the
        chief."""
        return self._coordinator._fetch(self)

    def done(self) -> bool:
        """Whether the function has finished (a worker asks the chief; the chief may call it
        alone)."""
        return self._coordinator._value_done(self)

    def __repr__(self) -> str:
        return f"<RemoteValue of {self._name} (schedule #{self._number})>"


class PerWorkerValues:
    """One value per worker, living on the workers; a function given it as an argument gets
    the value of the worker it runs on."""

    def __init__(self, number: int, local: Any = None) -> None:
        self._resource_ref = ResourceRef(number)
        self._local = local

    def __repr__(self) -> str:
        return f"<PerWorkerValues #{self._resource_ref.number}>"


class PerWorkerDataset:
    """The dataset ``input_fn`` builds on each worker; ``iter()`` gives a
    :class:`PerWorkerValues` of iterators (``next(it)`` inside a scheduled function takes the
    running worker's next element)."""

    def __init__(self, make_iterator: Callable[[], PerWorkerValues]) -> None:
        self._make_iterator = make_iterator

    def __iter__(self) -> Iterator[Any]:
        return self._make_iterator()  # type: ignore[return-value]
