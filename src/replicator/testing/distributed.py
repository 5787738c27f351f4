"""``run_distributed``: run a function on N real worker processes from a test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replicator.launch.function_launch import launch

DEFAULT_TEST_TIMEOUT_SECONDS = 60.0


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, *,
                    timeout_seconds: float = DEFAULT_TEST_TIMEOUT_SECONDS,
                    max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` processes with a real gloo/NCCL group.

    Returns each rank's return value in rank order. A rank that raises makes this raise
    :class:`replicator.WorkerFailedError` carrying that rank and its traceback. Collectives
    time out after ``timeout_seconds`` (short by default, so a broken test fails fast).
    ``fn`` must be defined at module level so the workers can import it. The workers fork from
    a server process that imported torch and replicator once (``start_method="forkserver"``),
    so a test starts its processes in a fraction of a second rather than seconds each.
    """
    return launch(fn, num_replicas=world_size, args=args, kwargs=kwargs,
                  timeout_seconds=timeout_seconds, max_restarts=max_restarts,
                  start_method="forkserver")
