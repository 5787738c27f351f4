"""Exactly-once input for asynchronous workers: a ledger of batch claims on server 0.

Each epoch is cut into numbered per-replica batches (the same cut on every worker: a seeded
permutation). A worker *claims* the next batch from the ledger, trains on it, and its update
*consumes* the claim when server 0 applies it. A worker that is lost before its update lands
gives its claims back, and the next worker to ask takes them: every batch of an epoch is
consumed by exactly one applied update (counted at server 0). An epoch ends for a worker when
no batch is left unclaimed and none is still in flight with another worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Epoch:
    total: int
    next_fresh: int = 0
    returned: list[int] = field(default_factory=list)
    in_flight: dict[int, set[int]] = field(default_factory=dict)   # worker -> batches
    consumed: list[int] = field(default_factory=list)
    by_worker: dict[int, int] = field(default_factory=dict)


#: What :meth:`ClaimLedger.claim` answers when the caller must wait for batches in flight.
WAIT = -2
#: ... and when the epoch has no batch left for anyone.
EPOCH_DONE = -1


class ClaimLedger:
    """Batch claims per epoch (the caller holds the server's lock around every call)."""

    def __init__(self) -> None:
        self.epochs: dict[int, _Epoch] = {}

    def claim(self, worker: int, epoch: int, total: int) -> int:
        """The batch ``worker`` takes next in ``epoch`` (of ``total``), :data:`WAIT`, or
        :data:`EPOCH_DONE`. A worker asking again has finished with its earlier claims."""
        state = self.epochs.setdefault(epoch, _Epoch(total=total))
        if total != state.total:
            raise ValueError(f"epoch {epoch} has {state.total} batches on the server but a "
                             f"worker counts {total}. HINT: every worker must build the same "
                             "dataset and batch size.")
        for index in sorted(state.in_flight.get(worker, set())):
            self.consume(worker, epoch, index)  # used without an optimizer step
        if state.returned:
            index = state.returned.pop(0)
        elif state.next_fresh < state.total:
            index = state.next_fresh
            state.next_fresh += 1
        elif any(state.in_flight.values()):
            return WAIT
        else:
            return EPOCH_DONE
        state.in_flight.setdefault(worker, set()).add(index)
        return index

    def consume(self, worker: int, epoch: int, index: int) -> None:
        """``worker``'s update for batch ``index`` of ``epoch`` was applied."""
        state = self.epochs.get(epoch)
        if state is None:
            return
        mine = state.in_flight.get(worker, set())
        if index in mine:
            mine.discard(index)
        state.consumed.append(index)
        state.by_worker[worker] = state.by_worker.get(worker, 0) + 1

    def give_back(self, worker: int) -> int:
        """Return every batch ``worker`` claimed without an applied update (it was lost);
        the number returned."""
        n = 0
        for state in self.epochs.values():
            mine = state.in_flight.pop(worker, set())
            state.returned.extend(sorted(mine))
            n += len(mine)
        return n

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per epoch: batches, batches consumed (distinct), repeats, and consumed per worker."""
        return {e: {"batches": s.total, "consumed": len(set(s.consumed)),
                    "repeated": len(s.consumed) - len(set(s.consumed)),
                    "by_worker": dict(s.by_worker),
                    "in_flight": sum(len(v) for v in s.in_flight.values())}
                for e, s in sorted(self.epochs.items())}

    def state(self) -> dict[str, Any]:
        """JSON for a checkpoint (batches in flight count as not consumed)."""
        return {str(e): {"total": s.total, "next": s.next_fresh,
                         "returned": sorted(s.returned + [i for v in s.in_flight.values()
                                                          for i in v]),
                         "consumed": s.consumed,
                         "by_worker": {str(w): n for w, n in s.by_worker.items()}}
                for e, s in self.epochs.items()}

    def load(self, state: dict[str, Any]) -> None:
        self.epochs = {int(e): _Epoch(total=int(s["total"]), next_fresh=int(s["next"]),
                                      returned=[int(i) for i in s["returned"]],
                                      consumed=[int(i) for i in s["consumed"]],
                                      by_worker={int(w): int(n)
                                                 for w, n in s["by_worker"].items()})
                       for e, s in state.items()}
