"""Average the gradients of model-parallel pieces across the data-parallel replicas.

Tensor-parallel shards (DTensor parameters) and pipeline stages are replicated along the
``data`` axis of a mesh; each replica's backward leaves its own gradients, which must be
averaged before the optimizer steps. Automatic mode queues one averaging at the end of every
backward pass that produced a gradient (DDP's ``queue_callback``), so ``.grad`` after
``loss.backward()`` is already the average; the pipeline calls :meth:`average` itself after
its schedule, whose backward passes are nested.
"""

from __future__ import annotations

import torch

from replicator.comm.collectives import Collectives
from replicator.comm.reduce_op import ReduceOp


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard, a plain tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class DataParallelGradients:
    """Averages ``params``' gradients over ``collectives``' group, one collective per dtype."""

    def __init__(self, params: list[torch.nn.Parameter], collectives: Collectives, *,
                 automatic: bool = True) -> None:
        self._params = params
        self._collectives = collectives
        self._queued = False
        self._handles = []
        self.enabled = True
        if automatic:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                             for p in params]

    def _on_grad(self, _: torch.Tensor) -> None:
        if self._queued or not self.enabled:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._at_backward_end)

    def _at_backward_end(self) -> None:
        self._queued = False
        self.average()

    def average(self) -> None:
        """Replace every gradient with its mean over the replicas (in place)."""
        if self._collectives.world_size == 1:
            return
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                flat = torch.cat([g.reshape(-1) for g in group])
                mean = self._collectives.all_reduce(
                    flat, ReduceOp.MEAN, f"gradient average over replicas ({dtype})")
                offset = 0
                for g in group:
                    g.copy_(mean[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    def remove(self) -> None:
        """Stop averaging (the strategy is closed)."""
        for h in self._handles:
            h.remove()
        self._handles = []
