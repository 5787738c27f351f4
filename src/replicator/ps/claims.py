"""Exactly-once input for asynchronous workers: server 0's ledger of batch claims per input stream
and epoch. A claim is consumed when its worker's update is applied; a lost worker's claims go back
to the others, so every batch of an epoch is consumed by exactly one update. The worker's side is
:class:`ClaimedBatches`: batches claimed one by one, so fast workers take more."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate


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
            raise ValueError(f"epoch {key[1]} of input {key[0]} has {state.total} batches on the "
                             f"server but a worker counts {total}. HINT: every worker must build "
                             "the same datasets, in the same order, with the same batch size.")
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
        state.in_flight.get(worker, set()).discard(index)
        state.consumed.append(index)
        state.by_worker[worker] = state.by_worker.get(worker, 0) + 1

    def give_back(self, worker: int) -> int:
        """Give back the batches lost ``worker`` claimed without an applied update; how many."""
        n = 0
        for state in self.epochs.values():
            mine = state.in_flight.pop(worker, set())
            state.returned.extend(sorted(mine))
            n += len(mine)
        return n

    def summary(self, stream: int = 0) -> dict[int, dict[str, Any]]:
        """Per epoch of ``stream``: batches, distinct consumed, repeats, by worker, in flight."""
        return {e: {"batches": s.total, "consumed": len(set(s.consumed)),
                    "repeated": len(s.consumed) - len(set(s.consumed)),
                    "by_worker": dict(s.by_worker),
                    "in_flight": sum(len(v) for v in s.in_flight.values())}
                for (st, e), s in sorted(self.epochs.items()) if st == stream}

    def state(self) -> dict[str, Any]:
        """JSON for a checkpoint (batches in flight count as not consumed)."""
        return {f"{k[0]}:{k[1]}": {
            "total": s.total, "next": s.next_fresh, "consumed": s.consumed,
            "returned": sorted(s.returned + [i for v in s.in_flight.values() for i in v]),
            "by_worker": {str(w): n for w, n in s.by_worker.items()}}
            for k, s in self.epochs.items()}

    def load(self, state: dict[str, Any]) -> None:
        self.epochs = {}
        for k, s in state.items():
            stream, epoch = k.split(":")
            self.epochs[int(stream), int(epoch)] = _Epoch(
                total=int(s["total"]), next_fresh=int(s["next"]),
                returned=[int(i) for i in s["returned"]], consumed=[int(i) for i in s["consumed"]],
                by_worker={int(w): int(n) for w, n in s["by_worker"].items()})


class ClaimedBatches:
    """Per-replica batches of ``dataset`` claimed one by one; every worker cuts an epoch alike
    (a permutation seeded by ``seed + epoch``), and iterating once runs one epoch."""

    def __init__(self, claim: Callable[[int, int, int], int],
                 claimed: Callable[[tuple[int, int, int] | None], None], stream: int,
                 dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self._claim, self._claimed = claim, claimed  # server 0's claim; the batch in use
        self.stream, self.dataset, self.batch_size = stream, dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self.size = len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Batches in one epoch, over all workers together."""
        return self.size // self.batch_size if self.drop_last else \
            math.ceil(self.size / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at ``epoch`` (a restarted job continues where it was)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        seeded = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.size, generator=seeded) if self.shuffle else \
            torch.arange(self.size)
        total = len(self)
        try:
            while True:
                index = self._claim(self.stream, epoch, total)
                if index < 0:
                    return
                rows = order[index * self.batch_size:(index + 1) * self.batch_size].tolist()
                batch = self.collate_fn([self.dataset[i] for i in rows])
                self._claimed((self.stream, epoch, index))
                yield batch
        finally:
            self._claimed(None)
