"""Where each gradient sits inside a flat bucket, so compression can see the matrix shapes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
