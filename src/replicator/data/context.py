"""What an input pipeline is told and how it runs: ``InputContext``, ``AutoShardPolicy``,
``InputOptions``.

The context describes this process's place on the data-parallel axis (how many input
pipelines, which one this is, how many replicas run in sync); the strategy builds it from its
data-parallel group. The options and the shard policy say how the pipeline is split and run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from replicator.defaults import DEFAULT_TIMEOUT_SECONDS


@dataclass(frozen=True)
class InputContext:
    """Describes the input pipeline this process builds (tf.distribute's ``InputContext``).

    With one process per replica there is one input pipeline per replica:
    ``num_input_pipelines == num_replicas_in_sync`` and ``input_pipeline_id`` is the rank.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if self.num_input_pipelines < 1 or self.num_replicas_in_sync < 1:
            raise ValueError("an InputContext needs at least one pipeline and one replica")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(f"input_pipeline_id {self.input_pipeline_id} is outside "
                             f"0..{self.num_input_pipelines - 1}")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; raises if it does not divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync. HINT: use a multiple of "
                f"{self.num_replicas_in_sync}, e.g. "
                f"{global_batch_size - global_batch_size % self.num_replicas_in_sync}.")
        return global_batch_size // self.num_replicas_in_sync


class AutoShardPolicy(enum.Enum):
    """How the input is split between replicas (tf.data's ``AutoShardPolicy``).

    ``FILE``: each replica reads its own files (file ``i`` of the epoch's order goes to replica
    ``i % N``); needs a list of files and at least one file per replica.
    ``DATA``: each replica reads the elements of its part of every global batch; for a
    map-style dataset only those samples are loaded, for a stream every replica reads the
    stream and keeps its part before the transform runs.
    ``AUTO``: ``FILE`` for a list of at least ``N`` files, else ``DATA``.
    ``OFF``: each replica runs the whole pipeline (every sample of every global batch is loaded,
    transformed and collated) and keeps its slice of the collated global batch; the choice for
    a DataLoader whose batches cannot be rebuilt element by element (a custom batch sampler).
    """

    AUTO = "auto"
    FILE = "file"
    DATA = "data"
    OFF = "off"

    @classmethod
    def parse(cls, value: AutoShardPolicy | str) -> AutoShardPolicy:
        """``"file"`` -> ``AutoShardPolicy.FILE``; an unknown name raises ``ValueError``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"unknown shard policy {value!r}; use one of "
                         f"{', '.join(p.name for p in cls)} (rp.data.AutoShardPolicy)")


WORKER_TYPES = ("thread", "process")


@dataclass(frozen=True)
class InputOptions:
    """Options of a distributed input pipeline.

    ``prefetch``: batches kept ready ahead of the step by a background thread (0: each batch is
    read when the step asks for it; process workers still keep two batches each in flight).
    ``num_workers``: parallel workers for the per-sample work (reading a map-style sample and
    the ``transform``); ``None`` takes the DataLoader's ``num_workers`` when a DataLoader is
    given, else 0 (the work runs in the prefetch thread).
    ``worker_type``: ``"process"`` (like DataLoader: no GIL contention; the transform must be
    picklable unless workers are forked) or ``"thread"`` (no pickling, cheap start; best when
    the transform releases the GIL, as torch ops do). ``fetch_to_device``: copy each batch to
    the replica's device ahead of use (on CUDA from pinned memory on a side stream).
    ``pin_memory``: ``None`` pins on CUDA. ``shuffle_buffer``: the buffer size used to shuffle
    streams (IterableDatasets, files). ``shard_policy``: see :class:`AutoShardPolicy`.
    ``with_mask``: yield ``(batch, mask)`` pairs instead of batches (the mask is always also
    available as ``dist_dataset.mask``). ``pad_last_batch``: pad a short last batch up to the
    full per-replica batch with masked samples, so every batch has the same shape.
    ``timeout_seconds``: the longest wait for one batch from the pipeline.
    ``worker_start_method``: multiprocessing start method of process workers (``None``:
    the platform default, as DataLoader).
    """

    prefetch: int = 2
    num_workers: int | None = None
    worker_type: str = "process"
    fetch_to_device: bool = True
    pin_memory: bool | None = None
    shuffle_buffer: int = 1024
    shard_policy: AutoShardPolicy | str = AutoShardPolicy.AUTO
    with_mask: bool = False
    pad_last_batch: bool = False
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    worker_start_method: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_policy", AutoShardPolicy.parse(self.shard_policy))
        _check_int("prefetch", self.prefetch, 0)
        if self.num_workers is not None:
            _check_int("num_workers", self.num_workers, 0)
        _check_int("shuffle_buffer", self.shuffle_buffer, 1)
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"InputOptions(worker_type={self.worker_type!r}) is not one of "
                             f"{', '.join(map(repr, WORKER_TYPES))}")
        if not isinstance(self.timeout_seconds, (int, float)) or self.timeout_seconds <= 0:
            raise ValueError(f"InputOptions(timeout_seconds={self.timeout_seconds!r}) must be a "
                             "positive number of seconds")
        if self.worker_start_method not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(f"InputOptions(worker_start_method={self.worker_start_method!r}) "
                             "must be None, 'fork', 'spawn' or 'forkserver'")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"InputOptions({name}={value!r}) must be an integer >= {low}")
