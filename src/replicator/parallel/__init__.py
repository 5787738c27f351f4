"""The parallel room: plain functions that apply one parallelism to a module over a mesh.

Each takes the module, the (sub-)mesh of its axis and its options, and changes the module in
place; none knows which strategy called it (the guard and device come as arguments).
:class:`~replicator.strategies.MeshStrategy` composes them, innermost first: pipeline
(:class:`PipelineRunner`, with ``pipeline_split`` and ``pipeline_tied``), tensor
(:func:`apply_tensor_parallel`, with sequence parallelism), fully sharded (:func:`apply_fsdp`).
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
