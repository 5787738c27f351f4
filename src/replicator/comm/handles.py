"""Handles for communication in flight (the backend's ``Work``, :data:`DONE` or a
:class:`ThreadHandle`), and :func:`as_torch_future` for DDP communication hooks."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from replicator.errors import ReplicaTimeoutError


class Handle(Protocol):
    """Anything with ``wait()``: returns once the tensor holds the result, raises on failure."""

    def wait(self) -> object: ...


class Done:
    """A handle for work that already finished."""

    def wait(self) -> bool:
        return True


DONE = Done()


@dataclass(eq=False)
class ThreadHandle:
    """Work on a communication thread; ``wait()`` is bounded by ``timeout_seconds`` and re-raises
    its error."""

    future: concurrent.futures.Future
    what: str
    rank: int
    timeout_seconds: float
    done_event: torch.cuda.Event | None = None

    def wait(self) -> bool:
        finished, _ = concurrent.futures.wait([self.future], timeout=self.timeout_seconds)
        if not finished:
            raise ReplicaTimeoutError(
                f"{self.what} on rank {self.rank} did not finish within "
                f"{self.timeout_seconds:g} s. HINT: another replica may be stuck or on another "
                "code path; every rank must make the same collective calls in the same order.")
        self.future.result()  # re-raises the communication thread's error here
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)
        return True


def as_torch_future(handle: Handle, value: torch.Tensor,
                    then: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.futures.Future:
    """A ``torch.futures.Future`` completed with ``then(value)`` when ``handle`` is done."""
    finish = then or (lambda t: t)
    if isinstance(handle, torch.distributed.Work):
        return handle.get_future().then(lambda _: finish(value))
    devices: list[int | str | torch.device] | None = \
        [value.device] if value.device.type == "cuda" else None
    fut: torch.futures.Future = torch.futures.Future(devices=devices)
    if isinstance(handle, ThreadHandle):
        def complete(error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
                return
            try:
                fut.set_result(finish(value))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
                fut.set_exception(exc)

        handle.future.add_done_callback(lambda f: complete(f.exception()))  # on the lane
        return fut
    handle.wait()
    fut.set_result(finish(value))
    return fut
