"""What the live engine asks of torchft beyond its Manager's own calls: an all-gather over the
Manager's process group with the Manager's error handling (for payloads an all-reduce cannot
sum), and a quieter torchft log on a torch without NCCL.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

__all__ = ["first_line", "managed_all_gather", "quiet_flight_recorder_note"]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def managed_all_gather(manager: Any, process_group: Any, payload: torch.Tensor,
                       what: str) -> list[torch.Tensor] | None:
    """Every group's ``payload`` over ``process_group`` (the one the Manager reconfigures),
    with the Manager's error handling as its ``allreduce``: skipped after an error in this
    step, zeros from a group that is not participating (healing), and a failure (a peer lost:
    gloo's timeout bounds the wait) reported to the Manager, so ``should_commit`` says no;
    ``None`` then. ``what`` names the exchange in the failure's line."""
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


class _NoFlightRecorderNote(logging.Filter):
    """Drops torchft's warning, at every quorum, that it cannot reset NCCL's flight recorder:
    a torch without NCCL (the CPU build) has none, and the groups talk over gloo anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def quiet_flight_recorder_note() -> None:
    """On a torch without NCCL, filter :class:`_NoFlightRecorderNote` out of torchft's
    manager logger (once per process; a logging configuration, torchft itself unchanged)."""
    log = logging.getLogger("torchft.manager")
    if dist.is_nccl_available() or any(isinstance(f, _NoFlightRecorderNote)
                                       for f in log.filters):
        return
    log.addFilter(_NoFlightRecorderNote())
