"""The comm room: reduce ops, collectives, all-reduce algorithms and gradient averaging."""

from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce
from replicator.comm.collectives import Collectives
from replicator.comm.gradient_sync import GradientSynchronizer
from replicator.comm.options import CommunicationOptions
from replicator.comm.reduce_op import ReduceOp

__all__ = ["CrossDeviceOps", "NativeAllReduce", "Collectives", "GradientSynchronizer",
           "CommunicationOptions", "ReduceOp"]
