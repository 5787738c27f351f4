"""The algorithms as DDP communication hooks, on a real DistributedDataParallel model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import replicator as rp
from replicator.comm import (
    Compression,
    HierarchicalAllReduce,
    NativeAllReduce,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
    ddp_comm_hook,
    register_ddp_comm_hook,
)
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import make_mlp, regression_data

STEPS = 10


def _train_ddp(ops: rp.comm.CrossDeviceOps | None) -> dict:
    model = DDP(make_mlp(), bucket_cap_mb=0.001)  # tiny buckets: several per step
    if ops is not None:
        register_ddp_comm_hook(model, ops)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = regression_data()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        batch = slice(step * 32 + rank * 32 // world, step * 32 + (rank + 1) * 32 // world)
        loss = F.cross_entropy(model(data.tensors[0][batch]), data.tensors[1][batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "losses": losses}


def _ddp_with_each_hook(_: int) -> dict:
    rp.MirroredStrategy()  # the process group
    hooks = {"default": None, "native": NativeAllReduce(), "ring": RingAllReduce(),
             "hierarchical": HierarchicalAllReduce(), "reduce_to_one": ReductionToOneDevice(),
             "shared_memory": SharedMemoryAllReduce(),
             "ring_fp16": RingAllReduce(compression=Compression.fp16()),
             "native_powersgd": NativeAllReduce(compression=Compression.powersgd(rank=1))}
    return {name: _train_ddp(ops) for name, ops in hooks.items()}


@pytest.mark.timeout(120)
def test_algorithms_plug_into_ddp_as_comm_hooks():
    a, b = run_distributed(_ddp_with_each_hook, world_size=2, args=(0,))
    ref = a["default"]["params"]
    for name in ("native", "ring", "hierarchical", "reduce_to_one", "shared_memory"):
        assert_params_close(ref, a[name]["params"], atol=1e-6, label=f"{name}: ")
    assert_params_close(ref, a["ring_fp16"]["params"], atol=1e-3, label="ring_fp16: ")
    assert_params_close(ref, a["native_powersgd"]["params"], atol=0.1, label="powersgd: ")
    changed = max(float((a["native_powersgd"]["params"][k] - ref[k]).abs().max()) for k in ref)
    assert changed > 0, "PowerSGD rank 1 should only approximate the gradients"
    for name in a:
        assert_params_close(a[name]["params"], b[name]["params"], atol=0.0,
                            label=f"{name} replicas: ")


def test_ddp_comm_hook_rejects_what_is_not_an_algorithm():
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        ddp_comm_hook("ring")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_ddp_comm_hook(torch.nn.Linear(1, 1), RingAllReduce())  # type: ignore[arg-type]
