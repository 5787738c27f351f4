"""The parallel room: plain functions that apply one parallelism to a module over a mesh, in
place, given the guard and device (none knows which strategy called it); ``MeshStrategy``
composes them innermost first: pipeline, tensor (with sequence parallelism), fully sharded.
"""

from replicator.parallel.fsdp import apply_fsdp, is_unsharded_view, shard_units
from replicator.parallel.pipeline import (
    SCHEDULES,
    Guard,
    PipelineRunner,
    check_pipeline_options,
    pipeline_degree,
)
from replicator.parallel.pipeline_split import PipelineSplitError
from replicator.parallel.tensor_parallel import (
    TensorPlanError,
    apply_tensor_parallel,
    default_plan,
    sequence_parallel_plan,
    validate_plan,
)

__all__ = ["apply_fsdp", "shard_units", "is_unsharded_view", "apply_tensor_parallel",
           "default_plan", "sequence_parallel_plan", "validate_plan", "TensorPlanError",
           "PipelineRunner", "Guard", "SCHEDULES", "check_pipeline_options", "pipeline_degree",
           "PipelineSplitError"]
