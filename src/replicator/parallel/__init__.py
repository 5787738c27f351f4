"""The parallel room: plain functions that apply one parallelism to a module over a mesh.

Each function takes the module, the ``DeviceMesh`` (or 1-D sub-mesh) of its axis and its
options, and returns the module changed in place; none knows which strategy called it, and
what it needs from one (the guard that names a hung peer, the device) comes as an argument.
:class:`~replicator.strategies.MeshStrategy` composes them, innermost first: pipeline
(:class:`PipelineRunner`, which cuts with :mod:`replicator.parallel.pipeline_split` and keeps
tied weights in step with :mod:`replicator.parallel.pipeline_tied`), tensor
(:func:`apply_tensor_parallel`, with sequence parallelism), fully sharded (:func:`apply_fsdp`).

This room sits below ``replicator.strategies`` and imports only the rooms under it (cluster,
comm, data, optim, errors) and torch.
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
