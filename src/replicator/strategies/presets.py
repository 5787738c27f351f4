"""FSDPStrategy, TensorParallelStrategy, PipelineStrategy: :class:`MeshStrategy` with one axis.
Each checks its arguments where it is built and picks its axis (plus ``data`` for processes
left); the parallelisms are :mod:`replicator.parallel`'s functions, applied at scope exit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replicator.errors import ClusterConfigError
from replicator.parallel.pipeline import check_pipeline_options, pipeline_degree
from replicator.parallel.tensor_parallel import validate_plan
from replicator.strategies.live.settings import LiveSettings
from replicator.strategies.mesh_strategy import MeshStrategy


class FSDPStrategy(MeshStrategy):
    """Fully sharded data parallelism on every process (FSDP2 ``fully_shard`` per block).
    ``reshard_after_forward=True`` (ZeRO-3, least memory) or ``False`` (ZeRO-2, one gather fewer),
    also as ``zero_stage=3|2``; ``tensor``: add a tensor-parallel axis (``tensor_plan``).
    """

    name = "fsdp"
    #: Sharded inside a replica group, replicated across groups (HSDP) when the job runs
    #: replica groups (without a tensor axis: every rank of a group is then a data replica).
    _supports_live = True

    def __init__(self, reshard_after_forward: bool | None = None, *,
                 zero_stage: int | None = None, tensor: int = 1,
                 tensor_plan: dict[str, Any] | None = None,
                 timeout_seconds: float | None = None, check_finite: bool = False) -> None:
        if zero_stage is not None:
            if zero_stage not in (2, 3):
                raise ValueError(
                    f"zero_stage must be 2 or 3, got {zero_stage!r}. HINT: FSDP always shards "
                    "gradients and optimizer state (stage 2); stage 3 also frees parameters "
                    "after forward. For stage 1 (sharded optimizer state only) use "
                    "rp.MirroredStrategy, whose memory is then dominated by parameters anyway.")
            if reshard_after_forward is not None and reshard_after_forward != (zero_stage == 3):
                raise ValueError(f"zero_stage={zero_stage} contradicts reshard_after_forward="
                                 f"{reshard_after_forward}. HINT: give only one of them.")
            reshard_after_forward = zero_stage == 3
        validate_plan(tensor_plan)
        if tensor != 1 and LiveSettings.from_env() is not None:
            raise ClusterConfigError(
                "FSDPStrategy(tensor=...) cannot run in replica groups yet: the ranks of a "
                "tensor axis share their samples. HINT: FSDPStrategy() without tensor=, or "
                "launch without --replica-groups")
        super().__init__(fsdp=-1, tensor=tensor, tensor_plan=tensor_plan,
                         reshard_after_forward=True if reshard_after_forward is None
                         else bool(reshard_after_forward),
                         timeout_seconds=timeout_seconds, check_finite=check_finite)


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism on every process (or ``tensor`` of them, the rest data parallel).
    ``plan``: module name or pattern -> ``"colwise"``, ``"rowwise"``, ``"embedding"`` or a
    ``ParallelStyle`` (``None``: ``default_plan``); ``sequence_parallel``: see
    :mod:`replicator.parallel.tensor_parallel`. ``num_replicas_in_sync`` counts data replicas.
    """

    name = "tensor_parallel"

    def __init__(self, plan: Mapping[str, Any] | None = None, *, tensor: int = -1,
                 sequence_parallel: bool = False,
                 timeout_seconds: float | None = None, check_finite: bool = False) -> None:
        validate_plan(plan, sequence_parallel)
        data = 1 if tensor == -1 else -1
        super().__init__(data=data, tensor=tensor, tensor_plan=plan,
                         timeout_seconds=timeout_seconds, check_finite=check_finite)
        self._sequence_parallel = bool(sequence_parallel)


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism: ``num_stages`` stages fed ``num_microbatches`` microbatches;
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` or ``"zbv"``
    (two stages per rank for the interleaved). An ``nn.Sequential`` is cut by parameters, by
    measured time (``balance="time"``) or at ``split_points``; processes left are data replicas.
    """

    name = "pipeline"

    def __init__(self, num_stages: int = 2, num_microbatches: int = 4,
                 schedule: str = "1f1b", *, split_points: Sequence[str] | None = None,
                 balance: str = "params", timeout_seconds: float | None = None,
                 check_finite: bool = False) -> None:
        schedule = check_pipeline_options(num_stages, num_microbatches, schedule, balance)
        super().__init__(pipeline=pipeline_degree(num_stages, schedule), data=-1,
                         pipeline_options={"num_stages": num_stages,
                                           "num_microbatches": num_microbatches,
                                           "schedule": schedule,
                                           "split_points": split_points,
                                           "balance": balance},
                         timeout_seconds=timeout_seconds, check_finite=check_finite)

    def describe_stages(self) -> str:
        """Which blocks each stage holds, and on which pipeline rank."""
        return " | ".join(r.describe() for r in self._pipelines)
