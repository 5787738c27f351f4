"""Optimizers for large global batches (LARS, LAMB: created in ``strategy.scope()`` like any
other) and gradient accumulation (``strategy.accumulate(k)``)."""

from replicator.optim.accumulation import GradientAccumulator
from replicator.optim.layerwise import LAMB, LARS, exclude_1d, full_norm, trust_ratio

__all__ = ["LARS", "LAMB", "GradientAccumulator", "exclude_1d", "full_norm", "trust_ratio"]
