"""Which rank is missing? A daemon thread publishes the collective this rank last entered to the
store twice a second, so a timeout can name the ranks that never arrived."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist

from replicator.comm.groups import group_ranks

PUBLISH_INTERVAL_SECONDS = 0.5
_TAGS_IN_USE: Counter[str] = Counter()


def group_tag(ranks: Sequence[int]) -> str:
    """A short name for the group of global ``ranks`` (``r0-1-2``, or a hash when long)."""
    text = "-".join(str(r) for r in ranks)
    if len(text) > 48:
        text = f"{len(ranks)}x{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    return "r" + text


class CollectiveTracker:
    """Counts this rank's collectives and publishes its position for the others to read
    (``ranks``: the group's global ranks)."""

    def __init__(self, rank: int, world_size: int, store: dist.Store | None, *,
                 ranks: Sequence[int], roles: Mapping[int, str] | None = None,
                 tag: str | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks)
        if len(self.ranks) != world_size or not 0 <= rank < world_size:
            raise ValueError(f"a tracker for position {rank} of a group of {world_size} got "
                             f"the global ranks {self.ranks}")
        self.roles = dict(roles or {})
        if tag is None:
            base = group_tag(self.ranks)
            _TAGS_IN_USE[base] += 1
            n = _TAGS_IN_USE[base]
            tag = base if n == 1 else f"{base}.{n}"
        self.tag = tag
        self.store = store
        self.seq = 0
        self.current = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and world_size > 1:
            self._thread = threading.Thread(target=self._publish_loop, daemon=True,
                                            name="replicator-progress")
            self._thread.start()

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, store: dist.Store | None, *,
                  roles: Mapping[int, str] | None = None) -> CollectiveTracker:
        """A tracker for this process in ``group`` (``None``: the whole job)."""
        ranks = group_ranks(group)
        return cls(ranks.index(dist.get_rank()), len(ranks), store, ranks=ranks, roles=roles)

    def name(self, global_rank: int) -> str:
        """``rank 3`` or ``rank 3 (ps)`` when a role is known."""
        role = self.roles.get(global_rank)
        return f"rank {global_rank}" + (f" ({role})" if role else "")

    def _key(self, global_rank: int) -> str:
        return f"progress/{self.tag}/{global_rank}"

    def enter(self, name: str) -> int:
        self.seq += 1
        self.current = name
        return self.seq

    def _publish_loop(self) -> None:
        key, store = self._key(self.ranks[self.rank]), self.store
        assert store is not None, "the thread runs only with a store"
        while True:
            try:
                store.set(key, f"{self.seq}|{self.current}|{time.time()}")
            except Exception:  # noqa: BLE001 - the store may be gone at shutdown
                return
            if self._stop.wait(PUBLISH_INTERVAL_SECONDS):
                return

    def explain(self, seq: int, name: str) -> str:
        """A sentence naming the ranks that did not reach collective ``seq`` (``name``)."""
        if self.store is None or self.world_size == 1:
            return ""
        behind, silent = [], []
        now = time.time()
        for pos, r in enumerate(self.ranks):
            if pos == self.rank:
                continue
            key = self._key(r)
            try:
                self.store.set_timeout(timedelta(seconds=2))
                if not self.store.check([key]):
                    silent.append(r)
                    continue
                their_seq, their_op, stamp = self.store.get(key).decode().split("|", 2)
            except Exception:  # noqa: BLE001 - explaining must never raise
                silent.append(r)
                continue
            if int(their_seq) == 0:
                behind.append(f"{self.name(r)} (has entered no collective yet; last heard from "
                              f"{now - float(stamp):.1f} s ago)")
            elif int(their_seq) < seq:
                behind.append(f"{self.name(r)} (still at collective #{their_seq} {their_op}; last "
                              f"heard from {now - float(stamp):.1f} s ago)")
        parts = ["did not arrive: " + ", ".join(behind)] if behind else []
        if silent:
            parts.append("never reported progress: " + ", ".join(self.name(r) for r in silent))
        return "; ".join(parts)

    def close(self) -> None:
        """Stop publishing and wait for the thread, so no store call outlives the store."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2.0)
