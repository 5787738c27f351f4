"""Optimizers for large global batches (LARS, LAMB) and gradient accumulation.

``rp.optim.LARS`` and ``rp.optim.LAMB`` are ``torch.optim.Optimizer`` subclasses: create them
in ``strategy.scope()`` like any other optimizer. ``strategy.accumulate(k)`` returns a
:class:`GradientAccumulator`.
"""

from replicator.optim.accumulation import GradientAccumulator
from replicator.optim.layerwise import LAMB, LARS, exclude_1d, full_norm, trust_ratio

__all__ = ["LARS", "LAMB", "GradientAccumulator", "exclude_1d", "full_norm", "trust_ratio"]
