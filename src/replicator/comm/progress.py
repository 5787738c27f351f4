"""Which rank is missing? Each rank publishes the collective it last entered, so a timeout can
name the ranks that never arrived instead of only saying that something timed out.

A daemon thread writes ``(sequence number, operation, time)`` to the rendezvous store twice a
second (so the age of the entry also tells whether the rank is alive); the hot path only bumps
a counter.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

PUBLISH_INTERVAL_SECONDS = 0.5


class CollectiveTracker:
    """Counts this rank's collectives and publishes its position for the others to read."""

    def __init__(self, rank: int, world_size: int, store: dist.Store | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.seq = 0
        self.current = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and world_size > 1:
            self._thread = threading.Thread(target=self._publish_loop, daemon=True,
                                            name="replicator-progress")
            self._thread.start()

    def enter(self, name: str) -> int:
        self.seq += 1
        self.current = name
        return self.seq

    def _publish_loop(self) -> None:
        while True:
            try:
                self.store.set(f"progress/{self.rank}", f"{self.seq}|{self.current}|{time.time()}")
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
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"progress/{r}"
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
                behind.append(f"rank {r} (has entered no collective yet; last heard from "
                              f"{now - float(stamp):.1f} s ago)")
            elif int(their_seq) < seq:
                behind.append(f"rank {r} (still at collective #{their_seq} {their_op}; last "
                              f"heard from {now - float(stamp):.1f} s ago)")
        parts = []
        if behind:
            parts.append("did not arrive: " + ", ".join(behind))
        if silent:
            parts.append("never reported progress: " + ", ".join(f"rank {r}" for r in silent))
        return "; ".join(parts)

    def close(self) -> None:
        """Stop publishing and wait for the thread, so no store call outlives the store."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2.0)
