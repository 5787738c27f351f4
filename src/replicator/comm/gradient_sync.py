"""Average gradients across replicas during ``backward()``, bucket by bucket (DDP's reducer).

Parameters are grouped into buckets in reverse creation order (roughly the order their
gradients become ready). A hook fires when a parameter's gradient is accumulated; once every
gradient of a bucket is in, that bucket's all-reduce starts while ``backward()`` goes on.
Buckets always start in the same order on every rank, so collectives match across ranks. At the
end of ``backward()`` the remaining buckets start, all are awaited, and the averaged gradients
are written back into ``.grad``: after ``loss.backward()`` returns, ``.grad`` holds the mean
over replicas, as with DDP.

A parameter that got no gradient in this pass contributes its current ``.grad`` (zeros when
``None``); it receives the average if any rank produced a non-zero gradient for it and keeps
``grad=None`` otherwise.

As in DDP's ``gradient_as_bucket_view``, once a gradient has been copied into its bucket,
``param.grad`` becomes a view of the bucket buffer, so the average lands in ``.grad`` without a
copy back; a ``.grad`` tensor kept across steps is therefore overwritten by the next
``backward()`` (``optimizer.zero_grad()`` works as usual).

Bucket buffers are made by the algorithm (``make_buffers``), so an algorithm can keep them
where it communicates fastest (shared memory). With ``destination=r`` the buckets are only
reduced onto rank ``r`` (central storage): rank ``r`` gets the averages, the other ranks keep
their local gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from replicator.comm.algorithms import CrossDeviceOps, Handle, NativeAllReduce
from replicator.comm.bucket_layout import BucketLayout
from replicator.comm.collectives import Collectives

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None
    launched: bool = False
    views: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def layout(self) -> BucketLayout:
        return BucketLayout(self.index, tuple(p.shape for p in self.params), tuple(self.offsets))


def make_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[_Bucket]:
    """Group ``params`` (reverse order, same dtype and device) into buckets of ~``bucket_bytes``.

    ``bucket_bytes=0`` gives one bucket per parameter.
    """
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            offsets, n = [], 0
            for p in current:
                offsets.append(n)
                n += p.numel()
            buckets.append(_Bucket(len(buckets), current, offsets, n, current[0].dtype,
                                   current[0].device))
        current, size = [], 0

    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        limit = first_bucket_bytes if not buckets else bucket_bytes
        if current and (p.dtype != current[0].dtype or p.device != current[0].device
                        or size + nbytes > limit):
            close()
        current.append(p)
        size += nbytes
        if bucket_bytes == 0:
            close()
    close()
    return buckets


class GradientSynchronizer:
    """Installs the hooks that average ``params``' gradients across replicas in ``backward()``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], collectives: Collectives,
                 algorithm: CrossDeviceOps | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 destination: int | None = None) -> None:
        if destination is not None and not 0 <= destination < collectives.world_size:
            raise ValueError(f"destination must be a rank in 0..{collectives.world_size - 1}, "
                             f"got {destination}")
        self.collectives = collectives
        self.algorithm = algorithm or NativeAllReduce()
        self.destination = destination
        self.params = [p for p in params if p.requires_grad]
        self.buckets = make_buckets(self.params, bucket_bytes)
        if collectives.world_size > 1 and self.buckets:
            with collectives.guard("allocation of gradient buckets"):
                buffers = self.algorithm.make_buffers(
                    [(b.numel, b.dtype, b.device) for b in self.buckets], collectives.group)
            for b, buf in zip(self.buckets, buffers):
                b.buffer = buf
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self.enabled = True
        self._pass_active = False
        self._next_launch = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for p in self.params]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the hot path ------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled or self.collectives.world_size == 1:
            return
        if param.grad is not None and param.grad.is_sparse:
            raise TypeError("sparse gradients are not supported by gradient averaging yet; "
                            "use a dense embedding (sparse=False)")
        if not self._pass_active:
            self._pass_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        bucket, i = self._where[id(param)]
        view = self._views(bucket)[i]
        grad = param.grad
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.destination is None:
                # from now on .grad *is* the bucket slice (DDP's gradient_as_bucket_view):
                # the averaged result lands in place, with no copy back
                param.grad = view
        bucket.ready.add(i)
        while (self._next_launch < len(self.buckets)
               and len(self.buckets[self._next_launch].ready)
               == len(self.buckets[self._next_launch].params)):
            self._launch(self.buckets[self._next_launch])

    def _views(self, bucket: _Bucket) -> list[torch.Tensor]:
        """Per-parameter views of the bucket buffer, shaped like the parameters."""
        if bucket.views is None:
            buf = self._buffer(bucket)
            bucket.views = [buf[o:o + p.numel()].view_as(p)
                            for o, p in zip(bucket.offsets, bucket.params)]
        return bucket.views

    def _buffer(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return bucket.buffer

    def _launch(self, bucket: _Bucket) -> None:
        what = (f"all_reduce of gradient bucket {bucket.index + 1} of {len(self.buckets)} "
                f"({bucket.nbytes / 1e6:.1f} MB)")
        with self.collectives.guard(what):
            if self.destination is None:
                bucket.handle = self.algorithm.all_reduce_sum_async(
                    bucket.buffer, self.collectives.group, layout=bucket.layout)
            else:
                bucket.handle = self.algorithm.reduce_sum_async(
                    bucket.buffer, self.destination, self.collectives.group,
                    layout=bucket.layout)
        bucket.launched = True
        self._next_launch += 1

    def _finish_pass(self) -> None:
        try:
            for bucket in self.buckets[self._next_launch:]:
                buf = self._buffer(bucket)
                for i, p in enumerate(bucket.params):
                    if i not in bucket.ready:
                        piece = buf[bucket.offsets[i]:bucket.offsets[i] + p.numel()]
                        if p.grad is None:
                            piece.zero_()
                        else:  # accumulated earlier, untouched by this pass
                            piece.copy_(p.grad.reshape(-1))
                self._launch(bucket)
            scale = 1.0 / self.collectives.world_size
            receives = self.destination is None or self.collectives.rank == self.destination
            for bucket in self.buckets:
                what = (f"all_reduce of gradient bucket {bucket.index + 1} of "
                        f"{len(self.buckets)} ({bucket.nbytes / 1e6:.1f} MB)")
                with self.collectives.guard(what):
                    bucket.handle.wait()
                if receives:
                    self._write_back(bucket, scale)
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.launched = False
                bucket.handle = None
            self._next_launch = 0
            self._pass_active = False

    def _write_back(self, bucket: _Bucket, scale: float) -> None:
        bucket.buffer.mul_(scale)
        with torch.no_grad():
            for i, p in enumerate(bucket.params):
                piece = self._views(bucket)[i]
                if p.grad is not None:
                    if p.grad.data_ptr() != piece.data_ptr():
                        p.grad.copy_(piece)
                elif i not in bucket.ready and bool(piece.any()):
                    p.grad = piece.clone()
