"""Fingerprints, call sites and mismatch messages; trackers' store keys; single-process
behaviour of Collectives and GradientSynchronizer (no process group needed)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from replicator.comm.collective_tracker import CollectiveTracker, group_tag
from replicator.comm.collectives import (
    Collectives,
    call_site,
    describe_tensor,
    digest,
    mismatch_error,
)
from replicator.comm.gradient_sync import GradientSynchronizer
from replicator.comm.reduce_op import ReduceOp
from replicator.errors import CollectiveMismatchError


def test_digest_is_stable_non_negative_and_fits_after_negation():
    h = digest("reduce(mean)|all_reduce mean of shape () float32|3")
    assert h == digest("reduce(mean)|all_reduce mean of shape () float32|3")
    assert h != digest("reduce(mean)|all_reduce mean of shape () float32|4")
    for text in ("", "a", "barrier|barrier|1"):
        v = digest(text)
        assert 0 <= v < 2 ** 62
        torch.tensor([v, -v], dtype=torch.int64)  # no overflow


def test_the_max_trick_detects_any_difference():
    """all_reduce MAX of [h, -h] is [max h, -min h]: equal entries iff every h was equal."""
    def verdict(hs: list[int]) -> bool:
        stacked = torch.tensor([[h, -h] for h in hs], dtype=torch.int64).amax(0).tolist()
        return stacked[0] == -stacked[1]

    assert verdict([5, 5, 5])
    assert not verdict([5, 5, 6])
    assert not verdict([7, 5, 5])


def test_describe_tensor_hides_only_the_gathered_axis():
    t = torch.zeros(3, 4, dtype=torch.float16)
    assert describe_tensor(t) == "shape (3, 4) float16"
    assert describe_tensor(t, 0) == "shape (*, 4) float16"
    assert describe_tensor(torch.tensor(1.0)) == "shape () float32"
    assert describe_tensor(torch.zeros(2)) == "shape (2,) float32"


def test_call_site_is_the_first_frame_outside_the_library():
    line = sys._getframe().f_lineno + 1
    site = call_site()
    assert site == f"{__file__}:{line}"


def test_mismatch_error_lists_every_rank_and_a_hint():
    exc = mismatch_error({1: "gradient averaging at b.py:9", 0: "reduce(mean) at a.py:3"})
    assert isinstance(exc, CollectiveMismatchError)
    text = str(exc)
    assert text.index("rank 0: reduce(mean) at a.py:3") < text.index("rank 1: gradient")
    assert "HINT" in text and "depends on the rank" in text
    assert exc.calls == {0: "reduce(mean) at a.py:3", 1: "gradient averaging at b.py:9"}


def test_tracker_keys_carry_the_group_and_the_global_rank():
    assert group_tag([0, 2]) == "r0-2"
    assert len(group_tag(list(range(500)))) < 40
    a = CollectiveTracker(1, 2, None, ranks=[4, 7], roles={7: "ps"}, tag="test-a")
    assert a._key(7) == "progress/test-a/7"
    assert a.name(7) == "rank 7 (ps)" and a.name(4) == "rank 4"
    first = CollectiveTracker(0, 2, None, ranks=[11, 12])
    second = CollectiveTracker(0, 2, None, ranks=[11, 12])
    assert first.tag == "r11-12" and second.tag != first.tag  # two strategies, one group
    with pytest.raises(ValueError, match="global ranks"):
        CollectiveTracker(0, 3, None, ranks=[0, 1])


def test_single_process_collectives_need_no_group_and_check_nothing():
    coll = Collectives(0, 1, torch.device("cpu"), 5.0)
    assert coll.all_reduce(torch.tensor(3), ReduceOp.MEAN).item() == 3.0
    assert coll.all_gather_uneven(torch.ones(2, 3), 1).shape == (2, 3)
    assert coll.all_gather_bytes(b"abc") == [b"abc"]
    assert coll.start_check("x", "y") is None
    coll.barrier()
    with pytest.raises(ValueError, match="src must be a rank"):
        coll.broadcast_([torch.ones(1)], src=1)
    with pytest.raises(ValueError, match="rank must be"):
        Collectives(2, 2, torch.device("cpu"), 5.0)
    alone = Collectives.for_group(None, torch.device("cpu"), 5.0)
    assert (alone.rank, alone.world_size, alone.global_rank) == (0, 1, 0)


def test_synchronizer_options_and_remove_twice():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    coll = Collectives(0, 1, torch.device("cpu"), 5.0)
    with pytest.raises(ValueError, match="buffer_sync must be one of"):
        GradientSynchronizer(list(model.parameters()), coll, buffer_sync="average")
    first = GradientSynchronizer(list(model.parameters()), coll,
                                 buffers=list(model.buffers()), check=False)
    second = GradientSynchronizer(list(model.parameters()), coll, buffer_sync="none")
    assert first.index + 1 == second.index
    assert first.owner != second.owner
    assert {b.layout.owner for b in first.buckets} == {first.owner}
    assert len(first.buffers) == 3 and second.buffers == []
    first.remove()
    first.remove()
    assert first.buffers == [] and first.buckets == [] and first.params == []
    model(torch.randn(4, 3)).sum().backward()  # single replica: plain local gradients
    assert model[0].weight.grad is not None
