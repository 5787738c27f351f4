"""InputContext: what an ``input_fn`` needs to build its share of the input."""

from __future__ import annotations

from dataclasses import dataclass


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
