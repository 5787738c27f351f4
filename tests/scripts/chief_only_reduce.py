"""A collective on the chief only: rank 1 finishes its script while rank 0 waits in reduce."""

import torch

import replicator as rp

strategy = rp.MirroredStrategy()
strategy.reduce("sum", torch.ones(3))  # every rank: fine
if strategy.is_chief:
    total = strategy.reduce("sum", torch.ones(3))  # the chief only: rank 1 never joins
print(f"rank {strategy.replica_id} done", flush=True)
