"""Pick the all-reduce algorithm from ``CommunicationOptions.implementation``."""

from __future__ import annotations

import torch

from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce
from replicator.comm.options import CommunicationOptions
from replicator.errors import ClusterConfigError


def algorithm_for(options: CommunicationOptions, device: torch.device) -> CrossDeviceOps:
    """The algorithm ``options.implementation`` names, for replicas computing on ``device``.

    ``"auto"``: the backend's own all-reduce (NCCL on GPUs, gloo on CPUs). ``"nccl"`` needs
    GPUs; ``"gloo"`` needs CPUs; ``"ring"``, ``"hierarchical"``, ``"reduce_to_one"`` and
    ``"shared_memory"`` (CPU, one host) pick those algorithms.
    """
    impl = options.implementation
    timeout = options.timeout_seconds
    if impl == "nccl" and device.type != "cuda":
        raise ClusterConfigError(
            f"CommunicationOptions(implementation='nccl') needs CUDA devices, but the replicas "
            f"compute on {device}. HINT: use implementation='auto' (gloo on CPU) or 'ring'.")
    if impl == "gloo" and device.type == "cuda":
        raise ClusterConfigError(
            "CommunicationOptions(implementation='gloo') was given for CUDA replicas, whose "
            "process group is NCCL. HINT: use implementation='auto' or 'nccl' on GPUs.")
    if impl in ("auto", "nccl", "gloo"):
        return NativeAllReduce(timeout_seconds=timeout)
    if impl == "ring":
        from replicator.comm.ring import RingAllReduce

        return RingAllReduce(timeout_seconds=timeout)
    if impl == "hierarchical":
        from replicator.comm.hierarchical import HierarchicalAllReduce

        return HierarchicalAllReduce(timeout_seconds=timeout)
    if impl == "reduce_to_one":
        from replicator.comm.reduce_to_one import ReductionToOneDevice

        return ReductionToOneDevice(timeout_seconds=timeout)
    if impl == "shared_memory":
        if device.type != "cpu":
            raise ClusterConfigError(
                f"CommunicationOptions(implementation='shared_memory') works on CPU replicas, "
                f"these compute on {device}. HINT: use implementation='auto' (NCCL) on GPUs.")
        from replicator.comm.shared_memory import SharedMemoryAllReduce

        return SharedMemoryAllReduce(timeout_seconds=timeout)
    raise ValueError(f"unknown implementation {impl!r}")  # options validated it already
