"""Data-parallel groups: 4 processes as two data groups, each iterating its own input.

A data x tensor mesh of 2 x 2 puts ranks {0, 2} and {1, 3} on the data axis together; a
blocked layout makes {0, 1} and {2, 3}. Each group gets its own input context and group; its
replicas see exactly the batches a 2-replica job sees, stop together, and agree without the
other group (whose input has another length).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.data import InputContext, InputOptions
from replicator.testing import run_distributed
from tests.data_helpers import (
    IdDataset,
    batch_ids,
    id_batches,
    read_id_file,
    take_steps,
    write_id_files,
)

LAYOUTS = {"strided": [[0, 2], [1, 3]], "blocked": [[0, 1], [2, 3]]}
BATCHES = {0: (9, 6), 1: (4, 7)}          # input_fn batches per (group, position)
FILES = {0: [12, 4, 8, 4], 1: [4, 16, 4, 8]}  # FILE shards: files r, r + 2 go to position r
SAMPLES = {0: 50, 1: 70}                   # map-style dataset per group (global batches of 8)
CPU = torch.device("cpu")


def _join(layout: str) -> tuple[int, int, Any]:
    """(group index, position in the group, the group) of this process; every process makes
    every group, in the same order, as torch requires."""
    rp.cluster.initialize()
    rank = dist.get_rank()
    made = [dist.new_group(ranks, timeout=timedelta(seconds=60)) for ranks in LAYOUTS[layout]]
    index = next(i for i, ranks in enumerate(LAYOUTS[layout]) if rank in ranks)
    return index, LAYOUTS[layout][index].index(rank), made[index]


def group_worker(layout: str, folder: str) -> dict[str, Any]:
    g, pos, group = _join(layout)
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=pos, num_replicas_in_sync=2)
    out: dict[str, Any] = {"group": g, "pos": pos}
    # input_fn pipelines of uneven length: the end-of-data agreement runs on the data group
    n = BATCHES[g][pos]
    for drop in (True, False):
        for prefetch in (0, 2):
            data = rp.data.distribute_datasets_from_function(
                lambda c: id_batches(n, 4, start=1000 * g + 100 * c.input_pipeline_id), ctx, CPU,
                drop_remainder=drop, options=InputOptions(prefetch=prefetch), group=group)
            out[f"fn-{drop}-{prefetch}"] = [[(batch_ids(b), data.mask.tolist()) for b in data]
                                            for _ in range(2)]
    # FILE shards of uneven length
    if pos == 0:
        write_id_files(f"{folder}/group{g}", FILES[g])
    dist.barrier(group=group)
    paths = [f"{folder}/group{g}/part-{k:03d}.jsonl" for k in range(len(FILES[g]))]
    for drop in (True, False):
        data = rp.data.distribute_dataset(paths, ctx, CPU, batch_size=8, reader=read_id_file,
                                          drop_remainder=drop, group=group,
                                          options=InputOptions(shard_policy="file"))
        out[f"file-{drop}"] = [batch_ids(b, data.mask) for b in data]
        out[f"file-{drop}-policy"] = data.shard_policy
    # global batches of a map-style dataset, shuffled: the group's two halves
    data = rp.data.distribute_dataset(IdDataset(SAMPLES[g]), ctx, CPU, batch_size=8,
                                      shuffle=True, seed=5, group=group)
    out["map"] = take_steps(data, 2 * len(data))
    # an empty input on position 1 of group 1 is reported by that group, naming global ranks
    if g == 1:
        empty = rp.data.distribute_datasets_from_function(
            lambda c: id_batches(3 if c.input_pipeline_id == 0 else 0, 4), ctx, CPU, group=group)
        try:
            list(empty)
            out["empty"] = "no error"
        except rp.data.EmptyShardError as exc:
            out["empty"] = str(exc)
    # a context that does not match the group is refused, naming this rank
    try:
        rp.data.distribute_datasets_from_function(
            lambda c: id_batches(1, 4), InputContext(4, dist.get_rank(), 4), CPU, group=group)
        out["mismatch"] = "no error"
    except rp.ReplicatorError as exc:
        out["mismatch"] = str(exc)
    dist.barrier()
    return out


def _shard_ids(g: int, pos: int) -> list[int]:
    """The ids in FILE shard ``pos`` of group ``g`` (files ``pos``, ``pos + 2``)."""
    starts = [sum(FILES[g][:k]) for k in range(len(FILES[g]))]
    return [i for k in (pos, pos + 2) for i in range(starts[k], starts[k] + FILES[g][k])]


def _reference_map(g: int) -> list[list[int]]:
    """What one replica with the whole global batch sees (two epochs)."""
    one = rp.OneDeviceStrategy("cpu")
    data = one.distribute_dataset(IdDataset(SAMPLES[g]), batch_size=8, shuffle=True, seed=5)
    return take_steps(data, 2 * len(data))


def _check(ranks: list[dict[str, Any]], layout: str) -> None:
    for g, members in enumerate(LAYOUTS[layout]):
        first, second = (ranks[r] for r in members)
        assert (first["group"], first["pos"], second["group"], second["pos"]) == (g, 0, g, 1)
        short, long = sorted(BATCHES[g])
        for prefetch in (0, 2):
            for epoch in range(2):
                # drop: both stop when this group's shorter input runs out
                stopped = [ranks[r][f"fn-True-{prefetch}"][epoch] for r in members]
                assert [len(s) for s in stopped] == [short, short], (layout, g)
                for pos, steps in enumerate(stopped):
                    expected = id_batches(short, 4, start=1000 * g + 100 * pos)
                    assert [ids for ids, _ in steps] == [b[0].tolist() for b in expected]
                # pad: both run this group's longer input; the short one is masked at the end
                padded = [ranks[r][f"fn-False-{prefetch}"][epoch] for r in members]
                assert [len(s) for s in padded] == [long, long], (layout, g)
                for pos, steps in enumerate(padded):
                    n = BATCHES[g][pos]
                    assert [sum(m) for _, m in steps] == [4.0] * n + [0.0] * (long - n)
                    real = [i for ids, m in steps for i, w in zip(ids, m) if w]
                    assert real == list(range(1000 * g + 100 * pos, 1000 * g + 100 * pos + 4 * n))
        # FILE shards: each position reads exactly its files, in per-replica batches of 4
        for drop in (True, False):
            seen = [ranks[r][f"file-{drop}"] for r in members]
            assert ranks[members[0]][f"file-{drop}-policy"] == "file"
            assert len(seen[0]) == len(seen[1]), (layout, g, drop)
            lengths = [len(_shard_ids(g, pos)) // 4 for pos in range(2)]
            assert len(seen[0]) == (min(lengths) if drop else max(lengths))
            for pos in range(2):
                ids = [i for batch in seen[pos] for i in batch]
                shard = _shard_ids(g, pos)
                assert ids == (shard[:4 * min(lengths)] if drop else shard)
        # map-style global batches: the two halves of each are the one-replica global batch
        reference = _reference_map(g)
        a, b = (ranks[r]["map"] for r in members)
        assert len(a) == len(b) == len(reference)
        for step, (x, y) in enumerate(zip(a, b)):
            assert x + y == reference[step], (layout, g, step)
        for r in members:
            assert f"rank {r} says 4 replicas" in ranks[r]["mismatch"]
            assert "group given to distribute_datasets_from_function has 2" in \
                ranks[r]["mismatch"]
    empty_rank = LAYOUTS[layout][1][1]  # position 1 of group 1, as a global rank
    for r in LAYOUTS[layout][1]:
        assert f"shard of rank {empty_rank} has" in ranks[r]["empty"], ranks[r]["empty"]
    # the groups agreed independently: their lengths differ
    assert len(ranks[LAYOUTS[layout][0][0]]["fn-True-0"][0]) != \
        len(ranks[LAYOUTS[layout][1][0]]["fn-True-0"][0])


@pytest.mark.timeout(240)
def test_strided_data_groups_agree_independently(tmp_path) -> None:
    ranks = run_distributed(group_worker, world_size=4, args=("strided", str(tmp_path)),
                            timeout_seconds=60)
    _check(ranks, "strided")


@pytest.mark.timeout(240)
def test_blocked_data_groups_agree_independently(tmp_path) -> None:
    ranks = run_distributed(group_worker, world_size=4, args=("blocked", str(tmp_path)),
                            timeout_seconds=60)
    _check(ranks, "blocked")
