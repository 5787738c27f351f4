"""CommunicationOptions: tf.distribute's knobs for cross-replica communication."""

from __future__ import annotations

from dataclasses import dataclass

_IMPLEMENTATIONS = ("auto", "ring", "nccl", "gloo", "hierarchical", "reduce_to_one",
                    "shared_memory")


@dataclass(frozen=True)
class CommunicationOptions:
    """How gradients travel between replicas.

    ``bytes_per_pack``: bucket size in bytes for gradient all-reduce (0 = the default, 25 MB).
    ``timeout_seconds``: how long a collective may wait for the other replicas.
    ``implementation``: the all-reduce algorithm when no ``cross_device_ops`` is given:
    ``"auto"`` (the backend's own: NCCL on GPUs, gloo on CPUs), ``"nccl"``, ``"gloo"``,
    ``"ring"``, ``"hierarchical"``, ``"reduce_to_one"`` or ``"shared_memory"`` (CPU, one host).
    ``check_collectives``: fingerprint each backward pass's gradient averaging against the
    other replicas' calls (on by default; a mismatch raises ``CollectiveMismatchError``). The
    check of ``reduce``/``gather``/metrics/checkpoint agreement is always on.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: str = "auto"
    check_collectives: bool = True

    def __post_init__(self) -> None:
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds}")
        if isinstance(self.implementation, str):  # accept "RING" as tf.distribute spells it
            object.__setattr__(self, "implementation", self.implementation.strip().lower())
        if self.implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {self.implementation!r}; use one of "
                             f"{', '.join(_IMPLEMENTATIONS)}")
