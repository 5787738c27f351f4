"""The live engine's exchanges across the groups beyond the Manager's own calls: a step's
gradients as one flat tensor per dtype, payloads an all-reduce cannot sum all-gathered with the
Manager's error handling, and a quieter torchft log on a torch without NCCL.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from replicator.comm.gradient_sync import local_tensor


def flatten_grads(params: list[torch.nn.Parameter], weight: float, control: float,
                  allocate: Callable[[int, torch.dtype, torch.device], torch.Tensor]
                  ) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
    """The gradients of ``params`` times ``weight``, one flat tensor per dtype from
    ``allocate(numel, dtype, device)`` (zeros for a parameter without a gradient), with the
    parameters each holds; the first ends with one more element, ``control``."""
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
    """Make the averaged flat tensors the gradients (a plain parameter's: a view, no copy)."""
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def managed_all_gather(manager: Any, process_group: Any, payload: torch.Tensor,
                       what: str) -> list[torch.Tensor] | None:
    """Every group's ``payload`` over the Manager's ``process_group`` with its ``allreduce``'s
    error handling: skipped after an error in this step, zeros from a group not participating
    (healing), and a failure (a peer lost) reported to the Manager, so ``should_commit`` says
    no; ``None`` then. ``what`` names the exchange in the failure's line."""
    m, pg = manager, process_group  # torchft's Manager and ProcessGroupGloo (untyped)
    if m.errored():
        return None
    m.wait_quorum()
    if not m.is_participating():
        payload = torch.zeros_like(payload)
    try:
        parts = [torch.empty_like(payload) for _ in range(pg.size())]
        pg.allgather([parts], [payload], AllgatherOptions()).wait()
    except Exception as exc:  # noqa: BLE001 - gloo raises plain RuntimeErrors
        print(f"[replicator] {what} failed ({first_line(exc)}); the round is trained again "
              "with the next quorum", file=sys.stderr, flush=True)
        m.report_error(exc)
        return None
    return None if m.errored() else parts


def _no_flight_recorder_note(record: logging.LogRecord) -> bool:
    """Drops torchft's warning, at every quorum, that it cannot reset NCCL's flight recorder:
    a torch without NCCL (the CPU build) has none, and the groups talk over gloo anyway."""
    return "Unable to reset NCCL flight recorder" not in record.getMessage()


def quiet_flight_recorder_note() -> None:
    """On a torch without NCCL, filter that note out of torchft's manager log (once)."""
    log = logging.getLogger("torchft.manager")
    if not dist.is_nccl_available() and _no_flight_recorder_note not in log.filters:
        log.addFilter(_no_flight_recorder_note)
