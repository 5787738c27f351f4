"""Gradient compression for any algorithm's all-reduce: fp16, bf16 and PowerSGD, sending a
smaller tensor through the algorithm's sum, with error feedback (docs/collectives.md).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

SumFn = Callable[[torch.Tensor], None]
BucketKey = tuple[int, int]
#: Buckets whose compression state is kept at most (per Compression object).
DEFAULT_MAX_BUCKETS = 4096
_State = TypeVar("_State")


@dataclass(frozen=True)
class BucketLayout:
    """Bucket ``index``: tensors of ``shapes`` at element ``offsets``; ``(owner, index)`` keeps
    two models' compression state apart."""

    index: int
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    owner: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """The bucket's identity for per-bucket state: ``(owner, index)``."""
        return (self.owner, self.index)

    @classmethod
    def from_shapes(cls, index: int, shapes: Sequence[Sequence[int]],
                    owner: int = 0) -> BucketLayout:
        """Tensors of ``shapes`` packed back to back, in order."""
        sizes = [torch.Size(s) for s in shapes]
        offsets = itertools.accumulate((s.numel() for s in sizes[:-1]), initial=0)
        return cls(index, tuple(sizes), tuple(offsets), owner)

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.shapes[-1].numel() if self.shapes else 0

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of this layout as views into ``flat``."""
        if flat.numel() < self.numel:
            raise ValueError(f"bucket {self.index} needs {self.numel} elements, the buffer has "
                             f"{flat.numel()}")
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` flattened back to back into one new tensor on ``device``."""
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors])


def unpack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` (as made by :func:`pack`) back into ``tensors``, in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


class BucketStates(Generic[_State]):
    """Per-bucket state keyed by ``BucketLayout.key``, at most ``max_buckets``: the least
    recently used is forgotten first, which only restarts its error feedback."""

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
        for key in [k for k in self._items if owner is None or k[0] == owner]:
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
    #: Per-bucket state, forgotten by :meth:`release` (``None``: a stateless compression).
    _buckets: BucketStates[Any] | None = None

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        """Replace ``tensor`` in place by the replicas' sum, compressed data sent by ``sum_fn``."""

    def release(self, owner: int | None = None) -> None:
        """Forget the per-bucket state of ``owner``'s buckets (``None``: of every bucket)."""
        if self._buckets is not None:
            self._buckets.release(owner)

    @staticmethod
    def fp16(error_feedback: bool = False) -> CastCompression:
        """Send float16, divided by the world size first so the sum cannot overflow (65504)."""
        return CastCompression(torch.float16, error_feedback)

    @staticmethod
    def bf16(error_feedback: bool = False) -> CastCompression:
        """Send bfloat16: half the bytes, float32's range, 8 bits of mantissa."""
        return CastCompression(torch.bfloat16, error_feedback)

    @staticmethod
    def powersgd(rank: int = 1, *, warm_up_steps: int = 0, error_feedback: bool = True,
                 seed: int = 0, max_buckets: int = DEFAULT_MAX_BUCKETS) -> PowerSGD:
        """Low-rank (rank ``rank``) compression of each gradient matrix (Vogels et al. 2019)."""
        return PowerSGD(rank, warm_up_steps=warm_up_steps, error_feedback=error_feedback,
                        seed=seed, max_buckets=max_buckets)


class CastCompression(Compression):
    """Send the gradients in float16 or bfloat16, summed in that type; ``error_feedback`` needs
    the ``layout``."""

    def __init__(self, dtype: torch.dtype, error_feedback: bool = False, *,
                 max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompression sends float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self._buckets: BucketStates[torch.Tensor] = BucketStates(max_buckets)

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
        error = self._buckets.get(key) if key is not None else None
        if error is not None and error.shape == x.shape:
            x = x + error
        scaled = x / world_size
        low = scaled.to(self.dtype)
        if key is not None:
            self._buckets.put(key, (scaled - low.to(x.dtype)).mul_(world_size))
        sum_fn(low)
        tensor.copy_(low).mul_(world_size)

    def __repr__(self) -> str:
        return f"Compression.{self.name}(error_feedback={self.error_feedback})"


@dataclass
class _BucketState:
    shapes: tuple[torch.Size, ...]
    steps: int = 0
    qs: dict[int, torch.Tensor] = field(default_factory=dict)
    errors: dict[int, torch.Tensor] = field(default_factory=dict)


class PowerSGD(Compression):
    """Send a rank-``rank`` approximation of each gradient matrix, by one power iteration per
    step from a warm-started ``Q`` (Vogels et al., 2019; docs/collectives.md): ``P = sum(M Q)``
    orthonormalised, ``Q = sum(M^T P)``, the sum ~ ``P Q^T``. ``seed``: the first ``Q``."""

    name = "powersgd"

    def __init__(self, rank: int = 1, *, warm_up_steps: int = 0, error_feedback: bool = True,
                 seed: int = 0, max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
        if warm_up_steps < 0:
            raise ValueError(f"warm_up_steps must be >= 0, got {warm_up_steps}")
        self.rank = rank
        self.warm_up_steps = warm_up_steps
        self.error_feedback = error_feedback
        self.seed = seed
        self._buckets: BucketStates[_BucketState] = BucketStates(max_buckets)

    def compressible(self, shape: torch.Size) -> bool:
        """True when a rank-``rank`` factorisation of ``shape`` is smaller than the tensor."""
        if len(shape) < 2:
            return False
        n, m = shape[0], shape.numel() // max(1, shape[0])
        r = min(self.rank, n, m)
        return r > 0 and (n + m) * r < n * m

    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        if layout is None or not tensor.is_floating_point():
            sum_fn(tensor)  # no shapes to factorise: send it as it is
            return
        state = self._buckets.get(layout.key)
        if state is None or state.shapes != layout.shapes:
            state = _BucketState(layout.shapes)
            self._buckets.put(layout.key, state)
        state.steps += 1
        views = layout.views(tensor)
        matrices = [i for i, v in enumerate(views) if self.compressible(v.shape)]
        if state.steps <= self.warm_up_steps or not matrices:
            sum_fn(tensor)
            return
        work = torch.float32 if tensor.element_size() < 4 else tensor.dtype
        plain = [i for i in range(len(views)) if i not in set(matrices)]

        ms, ps = {}, {}
        for i in matrices:
            m = views[i].reshape(views[i].shape[0], -1).to(work, copy=True)
            if self.error_feedback and i in state.errors:
                m += state.errors[i]
            ms[i] = m
            if i not in state.qs:  # the first Q: the same on every replica per bucket and tensor
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layout.index * 1009 + i)
                state.qs[i] = torch.randn(m.shape[1], min(self.rank, *m.shape), generator=gen,
                                          dtype=torch.float64).to(device=m.device, dtype=m.dtype)
            ps[i] = m @ state.qs[i]

        # one all-reduce carries the uncompressed tensors and every P
        first = torch.cat([views[i].reshape(-1).to(work) for i in plain]
                          + [ps[i].reshape(-1) for i in matrices])
        sum_fn(first)
        unpack_into(first, [views[i] for i in plain])
        summed_ps = first[sum(views[i].numel() for i in plain):].split(
            [ps[i].numel() for i in matrices])
        qs = {}
        for i, p in zip(matrices, summed_ps):
            ps[i] = torch.linalg.qr(p.view_as(ps[i]), mode="reduced").Q
            qs[i] = ms[i].t() @ ps[i]
            if self.error_feedback:
                state.errors[i] = ms[i] - ps[i] @ qs[i].t()

        second = torch.cat([qs[i].reshape(-1) for i in matrices])
        sum_fn(second)
        for i, q in zip(matrices, second.split([qs[i].numel() for i in matrices])):
            q = q.view_as(qs[i])
            views[i].copy_((ps[i] @ q.t()).view_as(views[i]))
            state.qs[i] = q / world_size  # the warm start for the next step

    def error_bytes(self) -> int:
        """Bytes held for error feedback (for memory accounting)."""
        return sum(e.numel() * e.element_size() for s in self._buckets.values()
                   for e in s.errors.values())

    def __repr__(self) -> str:
        return (f"Compression.powersgd(rank={self.rank}, warm_up_steps={self.warm_up_steps}, "
                f"error_feedback={self.error_feedback})")
