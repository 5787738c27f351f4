"""Rank 1 raises while rank 0 waits in a collective: the launcher must report rank 1 once."""

import torch

import replicator as rp

strategy = rp.MirroredStrategy()
if strategy.replica_id == 1:
    raise ValueError("bad value on purpose in rank 1")
strategy.reduce("sum", torch.ones(3))
