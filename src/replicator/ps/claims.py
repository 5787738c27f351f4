"""Exactly-once input for asynchronous workers: a ledger of batch claims on server 0.

Each epoch of each input stream (every dataset a strategy distributes, numbered in creation
order, the same on every worker) is cut into numbered per-replica batches, the same cut on
every worker (a seeded permutation). A worker *claims* the next batch from the ledger, trains
on it, and its update *consumes* the claim when server 0 applies it. A worker that is lost
before its update lands gives its claims back, and the next worker to ask takes them: every
batch of an epoch is consumed by exactly one applied update (counted at server 0). An epoch
ends for a worker when no batch is left unclaimed and none is in flight with another worker.
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


#: An epoch of an input stream: ``(stream, epoch)``.
Key = tuple[int, int]


class ClaimLedger:
    """Batch claims per stream and epoch (the caller holds the server's lock around calls)."""

    def __init__(self) -> None:
        self.epochs: dict[Key, _Epoch] = {}

    def claim(self, worker: int, key: Key, total: int) -> int:
        """The batch ``worker`` takes next in epoch ``key`` (of ``total``), :data:`WAIT`, or
        :data:`EPOCH_DONE`. A worker asking again has finished with its earlier claims."""
        state = self.epochs.setdefault(key, _Epoch(total=total))
        if total != state.total:
            raise ValueError(f"epoch {key[1]} of input {key[0]} has {state.total} batches on "
                             f"the server but a worker counts {total}. HINT: every worker must "
                             "build the same datasets, in the same order, with the same batch "
                             "size.")
        for index in sorted(state.in_flight.get(worker, set())):
            self.consume(worker, key, index)  # used without an optimizer step
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

    def consume(self, worker: int, key: Key, index: int) -> None:
        """``worker``'s update for batch ``index`` of epoch ``key`` was applied."""
        state = self.epochs.get(key)
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

    def summary(self, stream: int = 0) -> dict[int, dict[str, Any]]:
        """Per epoch of ``stream``: batches, batches consumed (distinct), repeats, consumed
        per worker, and batches in flight."""
        return {e: {"batches": s.total, "consumed": len(set(s.consumed)),
                    "repeated": len(s.consumed) - len(set(s.consumed)),
                    "by_worker": dict(s.by_worker),
                    "in_flight": sum(len(v) for v in s.in_flight.values())}
                for (st, e), s in sorted(self.epochs.items()) if st == stream}

    def state(self) -> dict[str, Any]:
        """JSON for a checkpoint (batches in flight count as not consumed)."""
        return {f"{k[0]}:{k[1]}": {"total": s.total, "next": s.next_fresh,
                         "returned": sorted(s.returned + [i for v in s.in_flight.values()
                                                          for i in v]),
                         "consumed": s.consumed,
                         "by_worker": {str(w): n for w, n in s.by_worker.items()}}
                for k, s in self.epochs.items()}

    def load(self, state: dict[str, Any]) -> None:
        self.epochs = {_key(k): _Epoch(total=int(s["total"]), next_fresh=int(s["next"]),
                                      returned=[int(i) for i in s["returned"]],
                                      consumed=[int(i) for i in s["consumed"]],
                                      by_worker={int(w): int(n)
                                                 for w, n in s["by_worker"].items()})
                       for k, s in state.items()}


def _key(text: str) -> Key:
    stream, epoch = text.split(":")
    return int(stream), int(epoch)
