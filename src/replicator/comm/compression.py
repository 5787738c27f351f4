"""Gradient compression for the all-reduce: fp16, bf16 and (in ``powersgd.py``) PowerSGD.

Compression is given to an algorithm, whichever transport it uses::

    rp.MirroredStrategy(cross_device_ops=rp.NativeAllReduce(compression=rp.Compression.fp16()))
    rp.RingAllReduce(compression=rp.Compression.powersgd(rank=2))

A :class:`Compression` receives the flat gradient bucket and a ``sum_fn`` that sums a tensor
uncompressed across replicas with the chosen algorithm; it sends a smaller tensor through
``sum_fn`` and writes the (approximate) sum back into the bucket. Compressions with error
feedback remember, per bucket, what the compression lost and add it to the next step's
gradient, so the error does not accumulate. One Compression object serves one strategy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from replicator.comm.bucket_layout import BucketLayout

if TYPE_CHECKING:
    from replicator.comm.powersgd import PowerSGD

SumFn = Callable[[torch.Tensor], None]


class Compression(ABC):
    """How a gradient bucket is compressed before it travels (see the module doc)."""

    name: str = "compression"

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        """Replace ``tensor`` (in place) with the sum over replicas, sending compressed data
        through ``sum_fn``. ``layout`` identifies the bucket and its gradients' shapes."""

    @staticmethod
    def fp16(error_feedback: bool = False) -> CastCompression:
        """Send float16: half the bytes. Values are divided by the world size first, so the
        sum cannot overflow float16's range (65504)."""
        return CastCompression(torch.float16, error_feedback)

    @staticmethod
    def bf16(error_feedback: bool = False) -> CastCompression:
        """Send bfloat16: half the bytes, float32's range, 8 bits of mantissa."""
        return CastCompression(torch.bfloat16, error_feedback)

    @staticmethod
    def powersgd(rank: int = 1, *, warm_up_steps: int = 0, error_feedback: bool = True,
                 seed: int = 0) -> PowerSGD:
        """Low-rank (rank ``rank``) compression of each gradient matrix (Vogels et al. 2019)."""
        from replicator.comm.powersgd import PowerSGD

        return PowerSGD(rank, warm_up_steps=warm_up_steps, error_feedback=error_feedback,
                        seed=seed)


class CastCompression(Compression):
    """Send the gradients in a narrower float type (float16 or bfloat16).

    ``error_feedback``: keep, per bucket, the rounding error of this replica's contribution and
    add it to the next step's gradients (needs the bucket ``layout``; without one the error is
    dropped). The sum itself is accumulated in the narrow type by the transport.
    """

    def __init__(self, dtype: torch.dtype, error_feedback: bool = False) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompression sends float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self._errors: dict[int, torch.Tensor] = {}

    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compression needs a floating-point tensor, got "
                            f"{tensor.dtype}")
        if tensor.dtype == self.dtype or tensor.element_size() <= 2:
            sum_fn(tensor)  # already as narrow as the compression
            return
        x = tensor
        key = layout.index if (self.error_feedback and layout is not None) else None
        if key is not None and key in self._errors and self._errors[key].shape == x.shape:
            x = x + self._errors[key]
        scaled = x / world_size
        low = scaled.to(self.dtype)
        if key is not None:
            self._errors[key] = (scaled - low.to(x.dtype)).mul_(world_size)
        sum_fn(low)
        tensor.copy_(low).mul_(world_size)

    def __repr__(self) -> str:
        return f"Compression.{self.name}(error_feedback={self.error_feedback})"
