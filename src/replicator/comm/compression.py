"""Gradient compression for the all-reduce: fp16, bf16 and (in ``powersgd.py``) PowerSGD.

Compression is given to an algorithm, whichever transport it uses::

    fp16 = rp.comm.Compression.fp16()
    rp.MirroredStrategy(cross_device_ops=rp.comm.NativeAllReduce(compression=fp16))
    rp.comm.RingAllReduce(compression=rp.comm.Compression.powersgd(rank=2))

A :class:`Compression` receives the flat gradient bucket and a ``sum_fn`` that sums a tensor
uncompressed across replicas with the chosen algorithm; it sends a smaller tensor through
``sum_fn`` and writes the (approximate) sum back into the bucket. Compressions with error
feedback remember, per bucket, what the compression lost and add it to the next step's
gradient, so the error does not accumulate.

Per-bucket state is keyed by the bucket's :attr:`BucketLayout.key`, ``(owner, index)``: one
algorithm (and its Compression) may serve several models, whose synchronizers each number
their buckets from 0. The state is bounded: at most ``max_buckets`` buckets are remembered
(the least recently used is forgotten first, which only restarts its error feedback or
warm start), and :meth:`Compression.release` drops an owner's buckets at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from replicator.comm.bucket_layout import BucketLayout

if TYPE_CHECKING:
    from replicator.comm.powersgd import PowerSGD

SumFn = Callable[[torch.Tensor], None]
BucketKey = tuple[int, int]
#: Buckets whose compression state is kept at most (per Compression object).
DEFAULT_MAX_BUCKETS = 4096
_State = TypeVar("_State")


class BucketStates(Generic[_State]):
    """Per-bucket state keyed by ``BucketLayout.key``, least recently used forgotten first."""

    def __init__(self, max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
            raise ValueError(f"max_buckets must be a positive integer, got {max_buckets!r}")
        self.max_buckets = max_buckets
        self._items: OrderedDict[BucketKey, _State] = OrderedDict()

    def get(self, key: BucketKey) -> _State | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: BucketKey, value: _State) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_buckets:
            self._items.popitem(last=False)

    def release(self, owner: int | None = None) -> None:
        """Forget ``owner``'s buckets (``None``: every bucket)."""
        if owner is None:
            self._items.clear()
            return
        for key in [k for k in self._items if k[0] == owner]:
            del self._items[key]

    def keys(self) -> list[BucketKey]:
        return list(self._items)

    def values(self) -> list[_State]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


class Compression(ABC):
    """How a gradient bucket is compressed before it travels (see the module doc)."""

    name: str = "compression"

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        """Replace ``tensor`` (in place) with the sum over replicas, sending compressed data
        through ``sum_fn``. ``layout`` identifies the bucket and its gradients' shapes."""

    def release(self, owner: int | None = None) -> None:  # noqa: B027 - stateless by default
        """Forget the per-bucket state of ``owner``'s buckets (``None``: of every bucket)."""

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
                 seed: int = 0, max_buckets: int = DEFAULT_MAX_BUCKETS) -> PowerSGD:
        """Low-rank (rank ``rank``) compression of each gradient matrix (Vogels et al. 2019)."""
        from replicator.comm.powersgd import PowerSGD

        return PowerSGD(rank, warm_up_steps=warm_up_steps, error_feedback=error_feedback,
                        seed=seed, max_buckets=max_buckets)


class CastCompression(Compression):
    """Send the gradients in a narrower float type (float16 or bfloat16).

    ``error_feedback``: keep, per bucket, the rounding error of this replica's contribution and
    add it to the next step's gradients (needs the bucket ``layout``; without one the error is
    dropped). The sum itself is accumulated in the narrow type by the transport.
    ``max_buckets``: buckets whose error is remembered at most (see the module doc).
    """

    def __init__(self, dtype: torch.dtype, error_feedback: bool = False, *,
                 max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompression sends float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self._errors: BucketStates[torch.Tensor] = BucketStates(max_buckets)

    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compression needs a floating-point tensor, got "
                            f"{tensor.dtype}")
        if tensor.dtype == self.dtype or tensor.element_size() <= 2:
            sum_fn(tensor)  # already as narrow as the compression
            return
        x = tensor
        key = layout.key if (self.error_feedback and layout is not None) else None
        error = self._errors.get(key) if key is not None else None
        if error is not None and error.shape == x.shape:
            x = x + error
        scaled = x / world_size
        low = scaled.to(self.dtype)
        if key is not None:
            self._errors.put(key, (scaled - low.to(x.dtype)).mul_(world_size))
        sum_fn(low)
        tensor.copy_(low).mul_(world_size)

    def release(self, owner: int | None = None) -> None:
        self._errors.release(owner)

    def __repr__(self) -> str:
        return f"Compression.{self.name}(error_feedback={self.error_feedback})"
