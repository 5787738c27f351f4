"""FILE sharding: each replica reads its own files, and resumes exactly, even on another world.

In epoch ``e`` the files are put in a seeded order (when shuffling); shard ``r`` of ``N`` is
files ``r, r + N, r + 2N, ...`` of that order, read one after the other and, when shuffling,
mixed by a seeded shuffle buffer. Replica ``r`` reads shard ``r`` in per-replica batches of
``B / N``. Shards differ in length, so replicas run out at different steps; the distributed
iterator makes them agree (stop together, or pad with masked batches).

Resume: all replicas take one step per step, so the position is one number of steps, and
shard ``r`` has given ``min(steps * B/N, len(shard r))`` samples. A restart with another
number of replicas ``M`` finishes the interrupted epoch on the *original* shards: shard ``r``
continues on replica ``r % M`` (a replica may carry several shards one after the other, or
none). Each such change adds a *phase* ``[world, per_replica_batch, steps]`` to the state; the
offsets into the shards are recomputed from the phases (counting the samples of a shard where
a replica carried several). The next epoch uses the new number of replicas from its start.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, islice
from typing import Any

from replicator.data.file_dataset import FileDataset
from replicator.data.materialise import Spec
from replicator.data.plans import Plan
from replicator.data.shuffle_buffer import buffer_shuffle, derived_seed, shuffled

Phase = tuple[int, int, int]  # (world, per-replica batch size, steps)


class FileShardPlan(Plan):
    """Per-replica batches from this replica's files (``AutoShardPolicy.FILE``)."""

    kind = "file_shards"
    known_end = False
    position_unit = "steps"

    def __init__(self, files: FileDataset, global_batch_size: int, rank: int, world: int, *,
                 shuffle: bool, seed: int, shuffle_buffer: int, drop_remainder: bool,
                 pad_last_batch: bool) -> None:
        self.files = files
        self.rank, self.world = rank, world
        self.per_replica = global_batch_size // world
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch
        self.phases: list[Phase] = []      # earlier phases of epoch ``phases_epoch``
        self.phases_epoch: int | None = None
        self._lengths: dict[tuple[int, int, int], int] = {}

    def describe(self) -> str:
        return f"FILE shards ({len(self.files.files)} files, {self.world} replicas)"

    # -- shards ---------------------------------------------------------------------------------
    def file_order(self, epoch: int) -> list[str]:
        files = self.files.files
        return shuffled(files, derived_seed(self.seed, epoch)) if self.shuffle else list(files)

    def shard_stream(self, epoch: int, shard_world: int, index: int) -> Iterator[Any]:
        paths = self.file_order(epoch)[index::shard_world]
        stream: Iterator[Any] = chain.from_iterable(self.files.read(p) for p in paths)
        if self.shuffle:
            stream = buffer_shuffle(stream, self.shuffle_buffer,
                                    derived_seed(self.seed, epoch, shard_world, index))
        return stream

    def _length(self, epoch: int, shard_world: int, index: int) -> int:
        key = (epoch, shard_world, index)
        if key not in self._lengths:
            self._lengths[key] = sum(1 for _ in self.shard_stream(epoch, shard_world, index))
        return self._lengths[key]

    def _phases(self, epoch: int) -> list[Phase]:
        return self.phases if self.phases_epoch == epoch else []

    def segments(self, epoch: int) -> tuple[int, list[tuple[int, int]]]:
        """``(shard_world, [(shard index, samples already given), ...])`` for this replica."""
        phases = self._phases(epoch)
        if not phases:
            return self.world, [(self.rank, 0)]
        n0 = phases[0][0]
        offsets = [0] * n0
        for world, per_replica, steps in phases:
            for q in range(world):
                left = steps * per_replica
                mine = list(range(q, n0, world))
                for i, r in enumerate(mine):
                    if left <= 0:
                        break
                    if i == len(mine) - 1:  # overshoot past the end is harmless
                        offsets[r] += left
                        break
                    took = min(left, max(0, self._length(epoch, n0, r) - offsets[r]))
                    offsets[r] += took
                    left -= took
        return n0, [(r, offsets[r]) for r in range(self.rank, n0, self.world)]

    # -- plan -----------------------------------------------------------------------------------
    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        shard_world, segments = self.segments(epoch)
        stream: Iterator[Any] = chain.from_iterable(
            islice(self.shard_stream(epoch, shard_world, r), offset, None)
            for r, offset in segments)
        b = self.per_replica
        if sum(1 for _ in islice(stream, position * b)) < position * b:
            return
        step = position
        while True:
            items = list(islice(stream, b))
            if not items:
                return
            full = len(items) == b
            if not full and self.drop_remainder:
                return
            step += 1
            size = b if (full or self.pad_last_batch) else len(items)
            yield Spec(tuple(items), None, len(items), size, full, step)
            if not full:
                return

    def template_spec(self, epoch: int) -> Spec | None:
        for path in self.file_order(epoch):
            for sample in self.files.read(path):
                return Spec((sample,), None, 0, self.per_replica, True, 0)
        return None

    def fresh(self, epoch: int, position: int) -> bool:
        return position == 0 and not self._phases(epoch)

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        phases = [list(p) for p in self._phases(epoch)]
        return {"phases": phases + [[self.world, self.per_replica, position]]}

    def load_state(self, state: dict[str, Any], epoch: int, position: int) -> int:
        raw = state.get("phases") or []
        try:
            phases = [(int(w), int(b), int(s)) for w, b, s in raw]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the input state's 'phases' must be a list of [world, batch, "
                             f"steps] triples, got {raw!r}") from exc
        self._lengths.clear()
        self.phases_epoch = epoch
        if phases and phases[-1][:2] == (self.world, self.per_replica):
            self.phases = phases[:-1]   # same layout: continue the last phase
            return phases[-1][2]
        self.phases = phases           # new layout: a new phase starts here
        return 0
