"""A short last batch on 2 real processes: tf's ``partial_batch="empty"`` trains like one
device, and ``input_fn`` pipelines stop before the first short batch of any replica."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.data import InputOptions
from replicator.testing import assert_equivalent, run_distributed
from tests.data_helpers import IdDataset, batch_ids


def nine_samples() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(9, 3, generator=gen), torch.randn(9, 1, generator=gen))


def train_with_empty_batches(strategy: rp.Strategy) -> dict:
    """Global batches of 4 over 9 samples: the last one (1 sample) leaves rank 1 0 rows."""
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []

    def step(batch):
        x, y = batch
        rows.append(int(x.shape[0]))
        per_example = ((model(x) - y) ** 2).mean(1)
        loss = rp.compute_average_loss(per_example)  # counts the rows of every replica
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    dist = strategy.distribute_dataset(DataLoader(nine_samples(), batch_size=4),
                                       partial_batch="empty")
    for _ in range(2):
        for batch in dist:
            strategy.run(step, args=(batch,))
    expected = {1: [4, 4, 1], 2: [2, 2, 1] if strategy.replica_id == 0 else [2, 2, 0]}
    assert rows == expected[strategy.num_replicas_in_sync] * 2, rows
    return model.state_dict()


@pytest.mark.timeout(120)
def test_empty_partial_batches_train_exactly_like_one_device() -> None:
    assert_equivalent(train_with_empty_batches, strategies=["one_device", "mirrored"],
                      world_size=2, atol=1e-6)


def uneven_input_fn_worker() -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id

    def input_fn(ctx: rp.InputContext) -> DataLoader:
        # rank 0: 10 samples (4, 4, 2); rank 1: 20 samples (five batches of 4)
        return DataLoader(IdDataset(10 if rank == 0 else 20), batch_size=4)

    out: dict = {}
    for drop in (True, False):
        dist = strategy.distribute_datasets_from_function(
            input_fn, drop_remainder=drop, options=InputOptions(prefetch=2))
        out[drop] = [(batch_ids(b), dist.mask.tolist()) for b in dist]
    empty = rp.data.distribute_datasets_from_function(
        input_fn, strategy.input_context, strategy.device, drop_remainder=False,
        partial_batch="empty")
    out["empty"] = [(batch_ids(b), tuple(b[1].shape), empty.mask.tolist()) for b in empty]
    return out


@pytest.mark.timeout(120)
def test_input_fn_stops_before_the_first_short_batch_or_keeps_every_batch() -> None:
    ranks = run_distributed(uneven_input_fn_worker, world_size=2)
    # drop_remainder=True (the default): both stop before rank 0's short third batch
    assert [ids for ids, _ in ranks[0][True]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ids for ids, _ in ranks[1][True]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # False: every batch; rank 0, out of data, gets masked copies for rank 1's last two
    assert [len(m) for _, m in ranks[0][False]] == [4, 4, 2, 2, 2]
    assert [sum(m) for _, m in ranks[0][False]] == [4, 4, 2, 0, 0]
    assert [ids for ids, _ in ranks[1][False]][-1] == [16, 17, 18, 19]
    # partial_batch="empty": batches of 0 rows instead of masked copies
    assert [(shape, mask) for _, shape, mask in ranks[0]["empty"][3:]] == [((0, 2), [])] * 2
    assert [ids for ids, _, _ in ranks[0]["empty"][:3]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
