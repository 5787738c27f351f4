"""The gradients of a live step as one flat tensor per dtype, for the cross-group all-reduce.

One all-reduce per dtype instead of one per parameter; the first tensor carries one control
element more (a group announces that it leaves in the step's own all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replicator.comm.gradient_sync import local_tensor

#: Makes a flat tensor of ``(numel, dtype, device)`` (``torch.empty``'s arguments).
Allocate = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def flatten_grads(params: list[torch.nn.Parameter], weight: float, control: float,
                  allocate: Allocate = _empty
                  ) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
    """The gradients of ``params`` times ``weight``, one flat tensor per dtype from
    ``allocate`` (zeros for a parameter without a gradient), with the parameters each holds;
    the first tensor ends with one more element, ``control`` (summed across groups: a group
    announces leaving)."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(local_tensor(p).dtype, []).append(p)
    buckets: list[tuple[list[torch.nn.Parameter], torch.Tensor]] = []
    for dtype, group in by_dtype.items():
        n = sum(local_tensor(p).numel() for p in group)
        extra = 0 if buckets else 1
        flat = allocate(n + extra, dtype, local_tensor(group[0]).device)
        offset = 0
        for p in group:  # one pass: each gradient is scaled straight into its place
            size = local_tensor(p).numel()
            if p.grad is None:
                flat[offset:offset + size].zero_()
            else:
                torch.mul(local_tensor(p.grad).reshape(-1), weight,
                          out=flat[offset:offset + size])
            offset += size
        if extra:
            flat[n] = control
        buckets.append((group, flat))
    if not buckets:
        buckets.append(([], torch.full((1,), control)))
    return buckets


def unflatten_grads(buckets: list[tuple[list[torch.nn.Parameter], torch.Tensor]]) -> None:
    """Make the averaged flat tensors the parameters' gradients: a plain parameter's gradient
    becomes its view of the flat tensor (no copy; the next step's flattening then scales it
    in place), a sharded one's is copied into."""
    with torch.no_grad():
        for group, flat in buckets:
            offset = 0
            for p in group:
                local = local_tensor(p)
                piece = flat[offset:offset + local.numel()].view_as(local)
                offset += local.numel()
                if p.grad is None and not bool(piece.any()):
                    continue  # no gradient anywhere: stays without one
                if local is p:
                    p.grad = piece
                elif p.grad is None:
                    p.grad = like_param(p, piece.clone())
                else:
                    local_tensor(p.grad).copy_(piece)


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` laid out like ``param``: a DTensor on its mesh and placements, else itself."""
    if not callable(getattr(param, "to_local", None)):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                              run_check=False)
