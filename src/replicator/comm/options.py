"""CommunicationOptions: tf.distribute's knobs for cross-replica communication."""

from __future__ import annotations

from dataclasses import dataclass

_IMPLEMENTATIONS = ("auto", "ring", "nccl", "gloo")


@dataclass(frozen=True)
class CommunicationOptions:
    """How gradients travel between replicas.

    ``bytes_per_pack``: bucket size in bytes for gradient all-reduce (0 = the default, 25 MB).
    ``timeout_seconds``: how long a collective may wait for the other replicas.
    ``implementation``: ``"auto"`` (the backend's own), ``"ring"``, ``"nccl"`` or ``"gloo"``.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: str = "auto"

    def __post_init__(self) -> None:
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds}")
        if self.implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {self.implementation!r}; use one of "
                             f"{', '.join(_IMPLEMENTATIONS)}")
