"""The comm room: collectives, all-reduce algorithms, compression and gradient averaging."""

from replicator.comm.algorithms import (
    CrossDeviceOps,
    NativeAllReduce,
    ReductionToOneDevice,
    ddp_comm_hook,
    register_ddp_comm_hook,
)
from replicator.comm.collectives import Collectives
from replicator.comm.compression import BucketLayout, CastCompression, Compression, PowerSGD
from replicator.comm.gradient_sync import GradientSynchronizer
from replicator.comm.hierarchical import HierarchicalAllReduce
from replicator.comm.options import CommunicationOptions
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.ring import RingAllReduce
from replicator.comm.selection import algorithm_for
from replicator.comm.shared_memory import SharedMemoryAllReduce

__all__ = ["CrossDeviceOps", "NativeAllReduce", "RingAllReduce", "HierarchicalAllReduce",
           "ReductionToOneDevice", "SharedMemoryAllReduce", "Compression", "CastCompression",
           "PowerSGD", "BucketLayout", "ddp_comm_hook", "register_ddp_comm_hook",
           "algorithm_for", "Collectives", "GradientSynchronizer", "CommunicationOptions",
           "ReduceOp"]
