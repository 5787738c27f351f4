"""CommunicationOptions: tf.distribute's knobs for cross-replica communication."""

from __future__ import annotations

from dataclasses import dataclass

_IMPLEMENTATIONS = ("auto", "ring", "nccl", "gloo", "hierarchical", "reduce_to_one",
                    "shared_memory")


@dataclass(frozen=True)
class CommunicationOptions:
    """How gradients travel between replicas: bucket bytes (0: 25 MB), timeout, algorithm, and
    whether each backward's averaging is fingerprinted."""

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
