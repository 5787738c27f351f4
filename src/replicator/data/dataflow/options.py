"""``rp.data.AUTOTUNE`` and ``rp.data.Options``: the knobs of a dataflow pipeline, all optional.

The CPU budget is what the input may use beside training: the cores this process may run on,
less the threads of the training processes on this host (each runs ``torch.get_num_threads()``
threads; ``LOCAL_WORLD_SIZE`` of them share the host), shared by those processes' pipelines.
The RAM budget bounds what is kept in flight (results in flight and prefetched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from replicator.defaults import DEFAULT_TIMEOUT_SECONDS

#: Let the pipeline choose (tf.data's ``tf.data.AUTOTUNE``): parallelism and prefetch depth are
#: tuned while it runs.
AUTOTUNE = -1

ON_ERROR = ("raise", "skip")
WORKER_TYPES = ("process", "thread")


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_training_processes() -> int:
    """Training processes on this host (``LOCAL_WORLD_SIZE`` as launchers set it, else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_cpu_budget() -> int:
    """Cores left to this process's input: cores less the training processes' threads, shared
    by the training processes of this host; at least 1."""
    import torch

    local = local_training_processes()
    left = available_cores() - local * torch.get_num_threads()
    return max(1, left // local)


def default_ram_budget() -> int:
    """Bytes: a tenth of the host's memory per training process (at least 256 MiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(256 << 20, total // 10 // local_training_processes())


@dataclass(frozen=True)
class Options:
    """Options of a dataflow pipeline (tf.data's ``Options`` / ``AutotuneOptions``).

    ``cpu_budget``: cores the parallel stages may use together (``None``: the cores training
    leaves, measured while it runs; ``cores - torch threads`` until measured).
    ``ram_budget``: bytes kept in flight and prefetched together (``None``: a tenth of the
    host's memory per training process).
    ``deterministic``: ``None`` keeps each ``map``'s own setting; ``True``/``False`` overrides
    them all (``False`` hands results on as they finish). ``worker_type``: ``"process"``
    (workers hand results back through shared memory) or ``"thread"`` (for functions that
    release the GIL). ``start_method``: of process workers (``None``: ``"fork"`` where the
    platform has it, so functions need not be picklable).
    ``seed``: the default seed of ``shuffle``. ``timeout_seconds``: the longest wait for one
    result of a worker.
    """

    cpu_budget: int | None = None
    ram_budget: int | None = None
    deterministic: bool | None = None
    worker_type: str = "process"
    start_method: str | None = None
    seed: int = 0
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        for name in ("cpu_budget", "ram_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"Options({name}={value!r}) must be a positive integer or None")
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"Options(worker_type={self.worker_type!r}) must be one of "
                             f"{WORKER_TYPES}")
        if self.start_method not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(f"Options(start_method={self.start_method!r}) must be None, "
                             "'fork', 'spawn' or 'forkserver'")
        if not isinstance(self.timeout_seconds, (int, float)) or self.timeout_seconds <= 0:
            raise ValueError(f"Options(timeout_seconds={self.timeout_seconds!r}) must be a "
                             "positive number of seconds")

    @property
    def cpus(self) -> int:
        return self.cpu_budget if self.cpu_budget is not None else default_cpu_budget()

    @property
    def ram(self) -> int:
        return self.ram_budget if self.ram_budget is not None else default_ram_budget()

    def merge(self, other: Options) -> Options:
        """``other``'s settings where they differ from the defaults, these elsewhere."""
        base = Options()
        changes: dict[str, Any] = {f: getattr(other, f) for f in self.__dataclass_fields__
                                   if getattr(other, f) != getattr(base, f)}
        return replace(self, **changes)


def check_parallel(value: object, what: str) -> int:
    """``AUTOTUNE`` or a positive integer (``None`` means 1: sequential)."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != AUTOTUNE):
        raise ValueError(f"{what} must be rp.data.AUTOTUNE or a positive integer, got {value!r}")
    return value


def check_on_error(value: object) -> str:
    if value not in ON_ERROR:
        raise ValueError(f"on_error must be 'raise' (stop with an error naming the sample) or "
                         f"'skip' (skip it, count it in stats() and log it once), got {value!r}")
    return str(value)
