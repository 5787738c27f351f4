"""The data-parallel group given to the distributed dataset is checked before any input is read."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.data import InputContext, distribute_dataset, distribute_datasets_from_function
from tests.data_helpers import IdDataset, batch_ids, id_batches

CPU = torch.device("cpu")


def test_a_group_without_a_process_group_is_refused_with_a_hint() -> None:
    assert not dist.is_initialized()
    calls: list[InputContext] = []

    def input_fn(ctx: InputContext) -> list:
        calls.append(ctx)
        return id_batches(2, 4)

    with pytest.raises(rp.ReplicatorError, match="no process group is initialised.*HINT"):
        distribute_datasets_from_function(input_fn, InputContext(2, 0, 2), CPU,
                                          group=object())
    assert calls == []  # refused before the user's pipeline was built
    with pytest.raises(rp.ReplicatorError, match="distribute_dataset was given a data-parallel"):
        distribute_dataset(IdDataset(8), InputContext(2, 1, 2), CPU, batch_size=4,
                           group=object())


def test_no_group_is_the_default_group_and_one_process_sends_nothing() -> None:
    # a replica of a 2-replica job run alone: no collective, its own input to the end
    data = distribute_datasets_from_function(lambda ctx: id_batches(3, 4, start=10),
                                             InputContext(2, 1, 2), CPU, group=None)
    assert [batch_ids(b) for b in data] == [b[0].tolist() for b in id_batches(3, 4, start=10)]
