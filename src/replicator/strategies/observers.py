"""Step observers (``replicator bench`` and ``plan`` time steps this way): told when
``strategy.run`` starts and ends and when the loop calls ``reduce``, ``gather`` or
``forward_backward``; without one each call costs one empty-list test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StepObserver", "add_step_observer", "called", "run_finished", "run_started"]


class StepObserver:
    """The calls an observer receives (each a no-op here; override what you need)."""

    def run_started(self, strategy: Any, args: tuple) -> tuple:
        """At the start of ``strategy.run``: return the step's arguments (as given, or
        changed: a profile cuts the batch). May raise to stop the loop before the step."""
        return args

    def run_finished(self, strategy: Any) -> None:
        """At the end of ``strategy.run`` (also when the step raised)."""

    def called(self, strategy: Any, name: str) -> None:
        """The loop called ``strategy.<name>`` (``reduce``, ``gather``, ``forward_backward``)."""


_observers: list[StepObserver] = []


def add_step_observer(observer: StepObserver) -> Callable[[], None]:
    """Observe every strategy's steps in this process; returns the function that stops it."""
    if not isinstance(observer, StepObserver):
        raise TypeError(f"add_step_observer needs a StepObserver, got {type(observer).__name__}")
    _observers.append(observer)

    def remove() -> None:
        if observer in _observers:
            _observers.remove(observer)

    return remove


def run_started(strategy: Any, args: tuple) -> tuple:
    for observer in tuple(_observers):
        args = observer.run_started(strategy, args)
    return args


def run_finished(strategy: Any) -> None:
    for observer in tuple(_observers):
        observer.run_finished(strategy)


def called(strategy: Any, name: str) -> None:
    for observer in tuple(_observers):
        observer.called(strategy, name)
