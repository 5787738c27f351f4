"""PowerSGD: send a rank-``r`` approximation of each gradient matrix (Vogels et al., 2019).

For a gradient matrix ``M`` (``n x m``; convolution kernels are flattened to
``out_channels x rest``) and a persistent ``Q`` (``m x r``) each step does one power iteration::

    P = M Q;  P <- sum over replicas;  P <- orthonormal columns of P
    Q = M^T P;  Q <- sum over replicas;  sum of the M's ~ P Q^T

so a replica sends ``(n + m) r`` numbers instead of ``n m``. Tensors where that saves nothing
(vectors such as biases, small or thin matrices) travel uncompressed, together with ``P`` in
one all-reduce. ``Q`` is kept between steps (a warm start, so the approximation improves over
time), and with error feedback each replica adds what its last approximation missed,
``M - P P^T M``, to its next gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replicator.comm.bucket_layout import BucketLayout
from replicator.comm.compression import (
    DEFAULT_MAX_BUCKETS,
    BucketStates,
    Compression,
    SumFn,
)


@dataclass
class _BucketState:
    shapes: tuple[torch.Size, ...]
    steps: int = 0
    qs: dict[int, torch.Tensor] = field(default_factory=dict)
    errors: dict[int, torch.Tensor] = field(default_factory=dict)


class PowerSGD(Compression):
    """Rank-``rank`` PowerSGD with warm start and error feedback.

    ``warm_up_steps``: steps per bucket that travel uncompressed first (PowerSGD converges
    better when the early, large gradients are exact). ``seed``: seeds the initial ``Q``
    identically on every replica (per bucket index, so a model's factors start alike whether
    or not other models share this object). ``max_buckets``: buckets whose state is kept at
    most (see :mod:`replicator.comm.compression`).
    """

    name = "powersgd"

    def __init__(self, rank: int = 1, *, warm_up_steps: int = 0, error_feedback: bool = True,
                 seed: int = 0, max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
        if warm_up_steps < 0:
            raise ValueError(f"warm_up_steps must be >= 0, got {warm_up_steps}")
        self.rank = rank
        self.warm_up_steps = warm_up_steps
        self.error_feedback = error_feedback
        self.seed = seed
        self._buckets: BucketStates[_BucketState] = BucketStates(max_buckets)

    def compressible(self, shape: torch.Size) -> bool:
        """True when a rank-``rank`` factorisation of ``shape`` is smaller than the tensor."""
        if len(shape) < 2:
            return False
        n, m = shape[0], shape.numel() // max(1, shape[0])
        r = min(self.rank, n, m)
        return r > 0 and (n + m) * r < n * m

    def all_reduce_sum(self, tensor: torch.Tensor, layout: BucketLayout | None, sum_fn: SumFn,
                       world_size: int) -> None:
        if layout is None or not tensor.is_floating_point():
            sum_fn(tensor)  # no shapes to factorise: send it as it is
            return
        state = self._buckets.get(layout.key)
        if state is None or state.shapes != layout.shapes:
            state = _BucketState(layout.shapes)
            self._buckets.put(layout.key, state)
        state.steps += 1
        views = layout.views(tensor)
        matrices = [i for i, v in enumerate(views) if self.compressible(v.shape)]
        if state.steps <= self.warm_up_steps or not matrices:
            sum_fn(tensor)
            return
        work = torch.float32 if tensor.element_size() < 4 else tensor.dtype
        plain = [i for i in range(len(views)) if i not in set(matrices)]

        ms, ps = {}, {}
        for i in matrices:
            m = views[i].reshape(views[i].shape[0], -1).to(work, copy=True)
            if self.error_feedback and i in state.errors:
                m += state.errors[i]
            ms[i] = m
            ps[i] = m @ self._q(state, layout.index, i, m)

        # one all-reduce carries the uncompressed tensors and every P
        first = torch.cat([views[i].reshape(-1).to(work) for i in plain]
                          + [ps[i].reshape(-1) for i in matrices])
        sum_fn(first)
        offset = 0
        for i in plain:
            n = views[i].numel()
            views[i].copy_(first[offset:offset + n].view_as(views[i]))
            offset += n
        qs = {}
        for i in matrices:
            p = first[offset:offset + ps[i].numel()].view_as(ps[i])
            offset += ps[i].numel()
            ps[i] = torch.linalg.qr(p, mode="reduced").Q
            qs[i] = ms[i].t() @ ps[i]
            if self.error_feedback:
                state.errors[i] = ms[i] - ps[i] @ qs[i].t()

        second = torch.cat([qs[i].reshape(-1) for i in matrices])
        sum_fn(second)
        offset = 0
        for i in matrices:
            q = second[offset:offset + qs[i].numel()].view_as(qs[i])
            offset += qs[i].numel()
            views[i].copy_((ps[i] @ q.t()).view_as(views[i]))
            state.qs[i] = q / world_size  # the warm start for the next step

    def _q(self, state: _BucketState, bucket: int, i: int, m: torch.Tensor) -> torch.Tensor:
        q = state.qs.get(i)
        if q is None:
            r = min(self.rank, m.shape[0], m.shape[1])
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket * 1009 + i)
            q = torch.randn(m.shape[1], r, generator=gen, dtype=torch.float64)
            q = q.to(device=m.device, dtype=m.dtype)
            state.qs[i] = q
        return q

    def release(self, owner: int | None = None) -> None:
        self._buckets.release(owner)

    def error_bytes(self) -> int:
        """Bytes held for error feedback (for memory accounting)."""
        return sum(e.numel() * e.element_size() for s in self._buckets.values()
                   for e in s.errors.values())

    def __repr__(self) -> str:
        return (f"Compression.powersgd(rank={self.rank}, warm_up_steps={self.warm_up_steps}, "
                f"error_feedback={self.error_feedback})")
