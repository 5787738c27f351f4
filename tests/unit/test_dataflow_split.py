"""An rp.data.Dataset split across replicas in one process (each replica's context in turn):
the global batches of the pipeline, a short last batch masked, a skipped sample a masked row,
and the pipelines distribute_dataset refuses."""

from __future__ import annotations

import pytest
import torch

from replicator.data import Dataset, InputContext, Options
from replicator.data.dataset import distribute_dataset

pytestmark = pytest.mark.timeout(120)


def fail_on_five(x: torch.Tensor) -> torch.Tensor:
    if int(x) == 5:
        raise ValueError("five cannot be read")
    return x


def parts(ds_fn, world: int) -> list[list[tuple[list[int], list[float]]]]:
    out = []
    for rank in range(world):
        dist = distribute_dataset(ds_fn(), InputContext(world, rank, world), torch.device("cpu"))
        out.append([(b.tolist(), dist.mask.tolist()) for b in dist])
        dist.close()
    return out


def test_a_skipped_sample_is_a_masked_row_and_the_rest_is_kept() -> None:
    def build() -> Dataset:
        return (Dataset.from_tensor_slices(torch.arange(10))
                .map(fail_on_five, on_error="skip").batch(4)
                .with_options(Options(worker_type="thread", cpu_budget=2)))
    got = parts(build, 2)
    ds = build()
    dist = distribute_dataset(ds, InputContext(2, 0, 2), torch.device("cpu"))
    assert len(list(dist)) == 3 and ds.runtime.pools
    dist.close()  # stops the pipeline's workers too
    assert not ds.runtime.pools
    real = sorted(v for rank in got for batch, mask in rank for v, m in zip(batch, mask) if m)
    assert real == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    rank0_step1 = got[0][1]  # samples 4, 5 of the second global batch: 5 is skipped
    assert rank0_step1 == ([4, 4], [1.0, 0.0])
    assert [len(b) for b, _ in got[1]] == [2, 2, 1]  # the short last batch, split


def test_what_distribute_dataset_refuses() -> None:
    ctx, cpu = InputContext(2, 0, 2), torch.device("cpu")
    ds = Dataset.from_tensor_slices(torch.arange(10))
    with pytest.raises(ValueError, match="only map"):
        distribute_dataset(ds.batch(4).repeat(), ctx, cpu)
    with pytest.raises(ValueError, match="no batch"):
        distribute_dataset(ds, ctx, cpu)
    with pytest.raises(ValueError, match="disagree"):
        distribute_dataset(ds.batch(4), ctx, cpu, batch_size=8)
    with pytest.raises(ValueError, match="belong in the pipeline"):
        distribute_dataset(ds.batch(4), ctx, cpu, shuffle=True)
    with pytest.raises(ValueError, match="divisible"):
        distribute_dataset(ds.batch(5), ctx, cpu)
    dist = distribute_dataset(ds, ctx, cpu, batch_size=4)  # batch_size= batches it
    assert len(dist) == 3 and [b.tolist() for b in dist] == [[0, 1], [4, 5], [8]]
