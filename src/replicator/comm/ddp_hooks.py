"""Any :class:`CrossDeviceOps` as a DDP communication hook::

    model = DistributedDataParallel(net)
    register_ddp_comm_hook(model, rp.comm.RingAllReduce(compression=rp.comm.Compression.fp16()))

Each hook is its own bucket owner, so two hooked models keep their compression state apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.bucket_layout import BucketLayout
from replicator.comm.groups import group_size
from replicator.comm.handles import as_torch_future

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

_OWNERS = itertools.count(-1, -1)


def ddp_comm_hook(ops: CrossDeviceOps) -> CommHook:
    """A hook for ``DistributedDataParallel.register_comm_hook(state, hook)``; ``state``: a group
    or ``None``."""
    if not isinstance(ops, CrossDeviceOps):
        raise TypeError(f"ddp_comm_hook takes a CrossDeviceOps such as rp.comm.RingAllReduce(), "
                        f"got {type(ops).__name__}")
    owner = next(_OWNERS)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        group = state if isinstance(state, dist.ProcessGroup) else None
        tensor = bucket.buffer()
        world = group_size(group)
        layout = BucketLayout.from_shapes(bucket.index(), [p.shape for p in bucket.parameters()],
                                          owner=owner)
        if layout.numel != tensor.numel():  # DDP padded the bucket: the shapes do not apply
            layout = BucketLayout.from_shapes(bucket.index(), [tensor.shape], owner=owner)
        handle = ops.all_reduce_sum_async(tensor, group, layout=layout)
        return as_torch_future(handle, tensor, lambda t: t.div_(world))

    # DDP inspects the annotations; give it the objects, not this module's postponed strings
    hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    hook.__name__ = f"{ops.name}_comm_hook"
    hook.__qualname__ = hook.__name__
    return hook


def register_ddp_comm_hook(model: torch.nn.parallel.DistributedDataParallel,
                           ops: CrossDeviceOps) -> None:
    """Make ``model`` (a DDP module) sum its gradient buckets with ``ops``."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_ddp_comm_hook takes a DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    model.register_comm_hook(model.process_group, ddp_comm_hook(ops))
