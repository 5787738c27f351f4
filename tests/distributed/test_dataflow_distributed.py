"""rp.data.Dataset under strategy.distribute_dataset, in real processes with gloo: every sample
once per epoch with 1, 2 and 3 replicas and 0, 2 and 4 workers, one global order for all of
them, and a state saved mid-epoch on 2 (3) replicas finished on 3 (2) with each remaining
sample exactly once."""

from __future__ import annotations

import json

import pytest
import torch

import replicator as rp
from replicator.data import Dataset, Options
from replicator.testing import run_distributed

N, BATCH, EPOCHS = 50, 6, 2
WORKERS = (None, 2, 4)  # num_parallel_calls: inline, 2 and 4 process workers


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def plus_thousand(x: torch.Tensor) -> torch.Tensor:
    return x + 1000


def pipeline(workers: int | None) -> Dataset:
    return (Dataset.from_dataset(Ids(), num_parallel_calls=workers).shuffle(16, seed=7)
            .map(plus_thousand, num_parallel_calls=workers).batch(BATCH)
            .with_options(Options(cpu_budget=4, worker_type="process")))


def real_ids(batch: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return [int(v) - 1000 for v, m in zip(batch.tolist(), mask.tolist()) if m]


def epochs_worker() -> dict:
    strategy = rp.MirroredStrategy()
    out = {}
    for workers in WORKERS:
        dist = strategy.distribute_dataset(pipeline(workers))
        out[str(workers)] = [[real_ids(b, dist.mask) for b in dist] for _ in range(EPOCHS)]
        dist.close()
        dist.pipeline.dataset.close()
    return out


def reference() -> list[list[list[int]]]:
    ds = pipeline(None)
    return [[[int(v) - 1000 for v in b] for b in ds] for _ in range(EPOCHS)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_once_in_one_global_order(world: int) -> None:
    ref = reference()
    results = run_distributed(epochs_worker, world_size=world)
    for workers in WORKERS:
        for epoch in range(EPOCHS):
            steps = [r[str(workers)][epoch] for r in results]
            assert len({len(s) for s in steps}) == 1  # every replica ran every step
            global_batches = [sum((s[k] for s in steps), []) for k in range(len(steps[0]))]
            assert global_batches == ref[epoch], (world, workers, epoch)
            assert sorted(sum(global_batches, [])) == list(range(N))
    assert ref[0] != ref[1]


def save_worker(steps: int) -> dict:
    strategy = rp.MirroredStrategy()
    dist = strategy.distribute_dataset(pipeline(2))
    it = iter(dist)
    seen = [real_ids(next(it), dist.mask) for _ in range(steps)]
    state = json.dumps(dist.state_dict())
    dist.close()
    return {"seen": seen, "state": state}


def resume_worker(state: str) -> list[list[int]]:
    strategy = rp.MirroredStrategy()
    dist = strategy.distribute_dataset(pipeline(2))
    dist.load_state_dict(json.loads(state))
    rest = [real_ids(b, dist.mask) for b in dist]
    dist.close()
    return rest


@pytest.mark.timeout(240)
@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_resume_on_another_number_of_replicas(before: int, after: int) -> None:
    ref = reference()[0]
    saved = run_distributed(save_worker, world_size=before, args=(3,))
    assert len({s["state"] for s in saved}) == 1  # one state for every rank
    rest = run_distributed(resume_worker, world_size=after, args=(saved[0]["state"],))
    seen = [i for s in saved for step in s["seen"] for i in step]
    remaining = [sum((r[k] for r in rest), []) for k in range(len(rest[0]))]
    assert remaining == ref[3:]  # the same global batches an uninterrupted run gives
    assert sorted(seen + sum(remaining, [])) == list(range(N))


def per_replica_input(ctx: rp.InputContext) -> Dataset:
    return (Dataset.from_tensor_slices(torch.arange(40)).shuffle(40, seed=1)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id).map(plus_thousand).batch(4))


def from_function_worker() -> list[list[int]]:
    strategy = rp.MirroredStrategy()
    dist = strategy.distribute_datasets_from_function(per_replica_input)
    return [[int(v) - 1000 for v in b] for b in dist]


@pytest.mark.timeout(120)
def test_an_input_fn_returning_a_dataset() -> None:
    results = run_distributed(from_function_worker, world_size=2)
    assert len(results[0]) == len(results[1]) == 5
    assert sorted(sum(results[0] + results[1], [])) == list(range(40))
