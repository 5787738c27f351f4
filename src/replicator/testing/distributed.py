"""``run_distributed``: run a function on N real worker processes from a test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replicator.launch.script_launch import launch

DEFAULT_TEST_TIMEOUT_SECONDS = 60.0


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, *,
                    timeout_seconds: float = DEFAULT_TEST_TIMEOUT_SECONDS,
                    max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (module-level) in ``world_size`` processes with a real gloo/NCCL
    group and return each rank's result; a rank that raises makes this raise ``WorkerFailedError``.
    Short collective timeouts; workers fork from a forkserver that imported torch once.
    """
    return launch(fn, num_replicas=world_size, args=args, kwargs=kwargs,
                  timeout_seconds=timeout_seconds, max_restarts=max_restarts,
                  start_method="forkserver")
