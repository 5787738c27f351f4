"""Choosing and configuring algorithms without starting any process."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.comm import (
    BucketLayout,
    CommunicationOptions,
    HierarchicalAllReduce,
    NativeAllReduce,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
    algorithm_for,
)
from replicator.comm.algorithms import as_torch_future
from replicator.comm.comm_thread import DONE
from replicator.errors import ClusterConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize("impl, cls", [("auto", NativeAllReduce), ("gloo", NativeAllReduce),
                                       ("ring", RingAllReduce), ("RING", RingAllReduce),
                                       ("hierarchical", HierarchicalAllReduce),
                                       ("reduce_to_one", ReductionToOneDevice),
                                       ("shared_memory", SharedMemoryAllReduce)])
def test_implementation_selects_the_algorithm(impl, cls):
    algo = algorithm_for(CommunicationOptions(implementation=impl, timeout_seconds=7), CPU)
    assert type(algo) is cls and algo.timeout_seconds == 7


def test_nccl_on_cpu_and_shared_memory_on_gpu_explain_themselves():
    with pytest.raises(ClusterConfigError, match="needs CUDA"):
        algorithm_for(CommunicationOptions(implementation="nccl"), CPU)
    with pytest.raises(ClusterConfigError, match="CPU"):
        algorithm_for(CommunicationOptions(implementation="shared_memory"),
                      torch.device("cuda", 0))


def test_unknown_implementation_lists_the_known_ones():
    with pytest.raises(ValueError, match="ring"):
        CommunicationOptions(implementation="butterfly")


def test_mirrored_refuses_two_choices_of_algorithm():
    with pytest.raises(ValueError, match="only one"):
        rp.MirroredStrategy(cross_device_ops=RingAllReduce(),
                            communication_options=CommunicationOptions(implementation="ring"))


@pytest.mark.parametrize("make", [lambda: RingAllReduce(segment_bytes=0),
                                  lambda: RingAllReduce(depth=0),
                                  lambda: HierarchicalAllReduce(ranks_per_node=0),
                                  lambda: ReductionToOneDevice(destination=-1),
                                  lambda: SharedMemoryAllReduce(piece_bytes=8),
                                  lambda: NativeAllReduce(timeout_seconds=0)])
def test_bad_parameters_are_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_hierarchical_inter_node_must_be_an_algorithm():
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        HierarchicalAllReduce(inter_node="ring")  # type: ignore[arg-type]


def test_without_a_process_group_every_algorithm_is_the_identity():
    for algo in (NativeAllReduce(), RingAllReduce(), HierarchicalAllReduce(),
                 ReductionToOneDevice(), SharedMemoryAllReduce()):
        x = torch.arange(5.0)
        algo.all_reduce_sum_async(x).wait()
        algo.reduce_sum_async(x, 0).wait()
        assert torch.equal(x, torch.arange(5.0))


def test_tensors_must_be_dense_and_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        RingAllReduce().all_reduce_sum_async(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="dense"):
        RingAllReduce().all_reduce_sum_async(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="tensor"):
        RingAllReduce().all_reduce_sum_async([1.0])  # type: ignore[arg-type]


def test_bucket_layout_views_and_sizes():
    layout = BucketLayout.from_shapes(2, [(2, 3), (4,), ()])
    assert layout.offsets == (0, 6, 10) and layout.numel == 11
    flat = torch.arange(11.0)
    a, b, c = layout.views(flat)
    assert a.shape == (2, 3) and torch.equal(b, torch.arange(6.0, 10.0)) and float(c) == 10
    with pytest.raises(ValueError, match="needs 11"):
        layout.views(torch.zeros(3))


def test_a_finished_handle_becomes_a_completed_future():
    fut = as_torch_future(DONE, torch.ones(2), lambda t: t * 3)
    assert fut.done() and torch.equal(fut.wait(), torch.full((2,), 3.0))


@pytest.mark.parametrize("make", [lambda: HierarchicalAllReduce(intra_host="nvlink"),
                                  lambda: HierarchicalAllReduce(
                                      inter_node=HierarchicalAllReduce())])
def test_hierarchical_options_are_checked(make):
    with pytest.raises((ValueError, TypeError), match="intra_host|hierarchical"):
        make()


@pytest.mark.parametrize("dst", [1, -1, 0.0, True])
def test_reduce_destination_is_a_group_rank_and_checked(dst):
    with pytest.raises(ValueError, match="group rank"):
        NativeAllReduce().reduce_sum_async(torch.ones(3), dst)  # a lone process: only 0 exists
