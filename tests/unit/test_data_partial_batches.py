"""A short last batch, one process: ``partial_batch`` ("mask" or tf's "empty"), the
``drop_remainder`` of ``input_fn`` pipelines, and the DataLoader-like ``dataset`` and
``batch_size`` of a distributed dataset."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from replicator.data import (
    InputContext,
    InputOptions,
    distribute_dataset,
    distribute_datasets_from_function,
)
from tests.data_helpers import IdDataset, IdStream, batch_ids

CPU = torch.device("cpu")


def replica(data, rank: int, world: int, **kwargs):
    return distribute_dataset(data, InputContext(world, rank, world), CPU, **kwargs)


def last_steps(data, world: int, **kwargs) -> list[tuple[list[int], list[float]]]:
    """Every replica's last batch: (ids, mask)."""
    out = []
    for rank in range(world):
        dist = replica(data, rank, world, **kwargs)
        out.append([(b[0].tolist(), dist.mask.tolist()) for b in dist][-1])
    return out


@pytest.mark.parametrize("data", [IdDataset(9), IdStream(9)], ids=["map", "stream"])
def test_partial_batch_empty_gives_replicas_without_a_sample_zero_rows(data) -> None:
    # 9 samples, global batch 8 over 4 replicas: the last global batch has 1 sample
    assert last_steps(data, 4, batch_size=8) == [([8], [1.0]), ([8], [0.0]), ([8], [0.0]),
                                                 ([8], [0.0])]
    empty = last_steps(data, 4, batch_size=8, partial_batch="empty")
    assert empty == [([8], [1.0]), ([], []), ([], []), ([], [])]
    dist = replica(data, 3, 4, batch_size=8, partial_batch="empty")
    last = list(dist)[-1]
    assert last[1].shape == (0, 2) and last[1].dtype == torch.float32  # the structure, 0 rows
    assert dist.mask.shape == (0,)


def test_partial_batch_empty_with_a_loader_of_custom_batches() -> None:
    loader = DataLoader(IdDataset(9), batch_sampler=[list(range(8)), [8]])
    parts = last_steps(loader, 2, partial_batch="empty")
    assert parts == [([8], [1.0]), ([], [])]


def test_partial_batch_is_validated() -> None:
    with pytest.raises(ValueError, match="partial_batch must be 'mask'.*or 'empty'.*got 'zero'"):
        replica(IdDataset(9), 0, 2, batch_size=4, partial_batch="zero")
    with pytest.raises(ValueError, match="choose one of them"):
        replica(IdDataset(9), 0, 2, batch_size=4, partial_batch="empty",
                options=InputOptions(pad_last_batch=True))
    with pytest.raises(ValueError, match="partial_batch must be"):
        distribute_datasets_from_function(lambda ctx: [], InputContext(1, 0, 1), CPU,
                                          partial_batch=None)


def short_last_batch(ctx: InputContext) -> DataLoader:
    """10 samples in per-replica batches of 4: 4, 4, then a short batch of 2."""
    return DataLoader(IdDataset(10), batch_size=4)


def test_input_fn_drop_remainder_stops_before_the_first_short_batch() -> None:
    ctx = InputContext(1, 0, 1)
    dropped = distribute_datasets_from_function(short_last_batch, ctx, CPU)  # default: True
    assert [batch_ids(b) for b in dropped] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    kept = distribute_datasets_from_function(short_last_batch, ctx, CPU, drop_remainder=False)
    assert [batch_ids(b) for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # an iterable with no batch_size: a batch shorter than the epoch's first is short
    plain = [(torch.arange(0, 3),), (torch.arange(3, 6),), (torch.arange(6, 7),)]
    dropped = distribute_datasets_from_function(lambda c: plain, ctx, CPU)
    assert [batch_ids(b) for b in dropped] == [[0, 1, 2], [3, 4, 5]]


def test_input_fn_drop_remainder_resumes_at_the_same_step() -> None:
    ctx = InputContext(1, 0, 1)
    dist = distribute_datasets_from_function(short_last_batch, ctx, CPU)
    it = iter(dist)
    next(it)
    state = dist.state_dict()
    again = distribute_datasets_from_function(short_last_batch, ctx, CPU)
    again.load_state_dict(state)
    assert [batch_ids(b) for b in again] == [[4, 5, 6, 7]]  # still stops before [8, 9]


def test_distributed_dataset_answers_like_a_dataloader() -> None:
    data = TensorDataset(torch.arange(100.0).unsqueeze(1), torch.arange(100))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    dist = replica(loader, 1, 2)
    assert dist.dataset is data and len(dist.dataset) == 100
    assert dist.batch_size == 32 and len(dist) == 4
    # the official PyTorch MNIST example's progress line, unchanged
    lines = []
    for batch_idx, (x, _) in enumerate(dist):
        lines.append(f"Train Epoch: 1 [{batch_idx * len(x)}/{len(dist.dataset)} "
                     f"({100.0 * batch_idx / len(dist):.0f}%)]")
    assert len(lines) == 4 and lines[-1].endswith("/100 (75%)]")
    assert replica(data, 0, 2, batch_size=8).dataset is data
    assert replica(data, 0, 2, batch_size=8).batch_size == 8
    fn_dist = distribute_datasets_from_function(short_last_batch, InputContext(2, 0, 2), CPU)
    assert isinstance(fn_dist.dataset, IdDataset)
    assert fn_dist.batch_size == 8  # per-replica 4 x 2 replicas
    generated = distribute_datasets_from_function(lambda c: iter([]), InputContext(1, 0, 1), CPU)
    assert generated.batch_size is None


def test_strategy_input_fn_takes_partial_batch() -> None:
    """The strategy's distribute_datasets_from_function passes partial_batch on (and checks it)."""
    import replicator as rp

    strategy = rp.OneDeviceStrategy("cpu")
    data = TensorDataset(torch.arange(10.0))

    def input_fn(ctx: rp.InputContext) -> DataLoader:
        return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(4))

    batches = list(strategy.distribute_datasets_from_function(
        input_fn, drop_remainder=False, partial_batch="empty"))
    assert [int(b[0].shape[0]) for b in batches] == [4, 4, 2]
    with pytest.raises(ValueError, match="partial_batch"):
        strategy.distribute_datasets_from_function(input_fn, partial_batch="pad")
