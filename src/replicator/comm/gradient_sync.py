"""Average gradients across replicas during ``backward()``, bucket by bucket (DDP's reducer;
docs/collectives.md): ``.grad`` becomes a view of its bucket, a parameter without a gradient
contributes zeros. ``automatic=False``: no hooks, :meth:`synchronize` averages all at once;
``enabled`` gates both (``no_sync``); ``destination=r`` reduces onto rank ``r`` only; DTensors
sync their local shard."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replicator.comm.algorithms import CrossDeviceOps, Handle, NativeAllReduce
from replicator.comm.collectives import Collectives, dtype_name
from replicator.comm.compression import BucketLayout, pack, unpack_into

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024
BUFFER_SYNC_MODES = ("mean", "broadcast", "none")
_OWNERS = itertools.count(1)  # BucketLayout.owner: unique per synchronizer, never reused


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``t``: a DTensor's local shard, a plain tensor itself."""
    if not _is_distributed_tensor(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined]


def _is_distributed_tensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


def local_grad(param: torch.Tensor, sharded: bool = True) -> torch.Tensor | None:
    """The local tensor of ``param.grad``, redistributed like ``param`` first; ``sharded=False``
    skips that (hot path)."""
    grad = param.grad
    if grad is None or not sharded:
        return grad
    if _is_distributed_tensor(grad) and \
            tuple(grad.placements) != tuple(param.placements):  # type: ignore[attr-defined]
        with torch.no_grad():
            grad = grad.redistribute(param.device_mesh,  # type: ignore[attr-defined]
                                     param.placements)  # type: ignore[attr-defined]
        param.grad = grad
    return local_tensor(grad)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    layout: BucketLayout  # of the local tensors (a DTensor's shard)
    sharded: list[bool]  # which parameters are DTensors
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None
    views: list[torch.Tensor] | None = None

    @property
    def what(self) -> str:
        nbytes = self.layout.numel * self.dtype.itemsize
        return f"all_reduce of gradient bucket {self.layout.index + 1} ({nbytes / 1e6:.1f} MB)"


def make_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES, owner: int = 0) -> list[_Bucket]:
    """``params`` (reversed; same dtype, device) in buckets of ~``bucket_bytes`` (0: one each)."""
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            first = local_tensor(current[0])
            layout = BucketLayout.from_shapes(len(buckets),
                                              [local_tensor(p).shape for p in current], owner)
            buckets.append(_Bucket(current, layout, [_is_distributed_tensor(p) for p in current],
                                   first.dtype, first.device))
        current, size = [], 0

    for p in reversed(list(params)):
        local = local_tensor(p)
        nbytes = local.numel() * local.element_size()
        limit = first_bucket_bytes if not buckets else bucket_bytes
        head = local_tensor(current[0]) if current else None
        if head is not None and (local.dtype != head.dtype or local.device != head.device
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
                 algorithm: CrossDeviceOps | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 destination: int | None = None, *, buffers: Sequence[torch.Tensor] = (),
                 buffer_sync: str = "mean", check: bool = True, automatic: bool = True) -> None:
        if destination is not None and not 0 <= destination < collectives.world_size:
            raise ValueError(f"destination must be a rank in 0..{collectives.world_size - 1}, "
                             f"got {destination}")
        if buffer_sync not in BUFFER_SYNC_MODES:
            raise ValueError(f"buffer_sync must be one of {', '.join(BUFFER_SYNC_MODES)}, got "
                             f"{buffer_sync!r}")
        self.collectives = collectives
        self.algorithm = algorithm or NativeAllReduce()
        self.destination = destination
        self.check = check
        self.buffer_sync = buffer_sync
        self.automatic = automatic
        self.owner = next(_OWNERS)
        self.index = collectives.next_synchronizer_index()
        self.params = [p for p in params if p.requires_grad]
        self.buckets = make_buckets(self.params, bucket_bytes, owner=self.owner)
        self.buffers = [local_tensor(b) for b in buffers if b.numel() > 0] \
            if buffer_sync != "none" else []
        groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        for t in self.buffers:
            how = "mean" if buffer_sync == "mean" and t.is_floating_point() else "broadcast"
            groups.setdefault((how, t.dtype), []).append(t)
        #: ``(how, dtype, tensors)``: one coalesced collective each, in a fixed order
        self._buffer_groups = [(how, d, ts) for (how, d), ts in
                               sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        if collectives.world_size > 1 and self.buckets:
            with collectives.guard("allocation of gradient buckets"):
                bufs = self.algorithm.make_buffers(
                    [(b.layout.numel, b.dtype, b.device) for b in self.buckets], collectives.group)
            for b, buf in zip(self.buckets, bufs):
                b.buffer = buf
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.what = f"gradient averaging of synchronizer {self.index}"
        self._detail = self._describe()
        self.enabled = True
        self._pass_active = False
        self._next_launch = 0
        self._pass_task: int | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for p in self.params] if automatic else []

    def remove(self) -> None:
        """Remove the hooks and drop every reference (safe twice; does nothing afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.enabled = False
        self.params = []
        self.buckets = []
        self.buffers = []
        self._buffer_groups = []
        self._where = {}

    def _describe(self) -> str:
        """What every rank must agree on for one synced pass (hashed into its fingerprint)."""
        dtypes = sorted({dtype_name(b.dtype) for b in self.buckets})
        n = len(self.buckets)
        text = (f"{'loss.backward()' if self.automatic else 'synchronize()'} averaging "
                f"{len(self.params)} gradients in {n} bucket{'s' if n != 1 else ''}, "
                f"{sum(b.layout.numel for b in self.buckets)} elements {'/'.join(dtypes)}")
        if self.destination is not None:
            text += f", onto group rank {self.destination}"
        if self._buffer_groups:
            text += f", then {self.buffer_sync} of {len(self.buffers)} buffers (" + ", ".join(
                f"{sum(t.numel() for t in ts)} {dtype_name(d)}"
                for _, d, ts in self._buffer_groups) + ")"
        return text

    # -- the hot path ------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled or self.collectives.world_size == 1:
            return
        if param.grad is not None and param.grad.is_sparse:
            raise TypeError("sparse gradients are not supported by gradient averaging yet; "
                            "use a dense embedding (sparse=False)")
        try:
            task = torch._C._current_graph_task_id()  # the backward pass of this thread
            if self._pass_active and task != self._pass_task:
                self._reset()  # an error aborted the previous backward before its end ran
            if not self._pass_active:
                self._pass_active = True
                self._pass_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
                if self.check:  # overlaps the rest of backward; awaited before bucket 1 leaves
                    self.collectives.start_check(self.what, self._detail, async_op=True)
            bucket, i = self._where[id(param)]
            view = self._views(bucket)[i]
            grad = local_grad(param, bucket.sharded[i])
            if grad is None:  # the hook fires after accumulation: not reached in practice
                return
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                if self.destination is None and not bucket.sharded[i]:
                    # from now on .grad *is* the bucket slice (DDP's gradient_as_bucket_view):
                    # the averaged result lands in place, with no copy back
                    param.grad = view
            bucket.ready.add(i)
            while (self._next_launch < len(self.buckets)
                   and len(self.buckets[self._next_launch].ready)
                   == len(self.buckets[self._next_launch].params)):
                self._launch(self.buckets[self._next_launch])
        except BaseException:
            self._reset()  # backward is aborted: the queued end-of-pass callback will not run
            raise

    def _views(self, bucket: _Bucket) -> list[torch.Tensor]:
        """Per-parameter views of the bucket buffer, shaped like the parameters."""
        if bucket.views is None:
            bucket.views = bucket.layout.views(self._buffer(bucket))
        return bucket.views

    def _buffer(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.layout.numel, dtype=bucket.dtype,
                                        device=bucket.device)
        return bucket.buffer

    def _launch(self, bucket: _Bucket) -> None:
        self.collectives.settle()  # this pass's fingerprint verdict, before any payload
        with self.collectives.guard(bucket.what):
            if self.destination is None:
                bucket.handle = self.algorithm.all_reduce_sum_async(
                    self._buffer(bucket), self.collectives.group, layout=bucket.layout)
            else:
                bucket.handle = self.algorithm.reduce_sum_async(
                    self._buffer(bucket), self.destination, self.collectives.group,
                    layout=bucket.layout)
        self._next_launch += 1

    def synchronize(self) -> None:
        """Average every gradient now, on every replica at the same point (the manual trigger);
        not under ``no_sync``."""
        if not self.enabled or self.collectives.world_size == 1 or not self.buckets:
            return
        if self._pass_active:
            raise RuntimeError(f"{self.what}: synchronize() was called while a synced backward "
                               "pass is running. HINT: build the synchronizer with "
                               "automatic=False when the caller triggers it")
        self._pass_active = True
        if self.check:
            self.collectives.start_check(self.what, self._detail, async_op=True)
        self._finish_pass()

    def _finish_pass(self) -> None:
        try:
            self.collectives.settle()
            for bucket in self.buckets[self._next_launch:]:
                views = self._views(bucket)
                for i, p in enumerate(bucket.params):
                    if i not in bucket.ready:
                        grad = local_grad(p, bucket.sharded[i])
                        if grad is None:
                            views[i].zero_()
                        else:  # accumulated earlier, untouched by this pass
                            views[i].copy_(grad)
                self._launch(bucket)
            scale = 1.0 / self.collectives.world_size
            receives = self.destination is None or self.collectives.rank == self.destination
            for bucket in self.buckets:
                if bucket.handle is not None:
                    with self.collectives.guard(bucket.what):
                        bucket.handle.wait()
                if receives:
                    self._write_back(bucket, scale)
            self._sync_buffers()
        finally:
            self._reset()

    def _reset(self) -> None:
        """Forget the pass in progress (after it ended, or after an error aborted it)."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle = None
        self._next_launch = 0
        self._pass_active = False

    def _sync_buffers(self) -> None:
        """Make the buffers equal across replicas: one coalesced collective per dtype."""
        coll = self.collectives
        for how, dtype, tensors in self._buffer_groups:
            what = f"{how} of {len(tensors)} {dtype_name(dtype)} buffers ({self.what})"
            flat = pack(tensors, coll.device)
            with coll.guard(what):
                if how == "mean":
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=coll.group)
                else:
                    dist.broadcast(flat, group=coll.group, group_src=0)
            if how == "mean":
                flat.div_(coll.world_size)
            unpack_into(flat, tensors)

    def _write_back(self, bucket: _Bucket, scale: float) -> None:
        self._buffer(bucket).mul_(scale)
        with torch.no_grad():
            for i, p in enumerate(bucket.params):
                piece = self._views(bucket)[i]
                grad = local_grad(p, bucket.sharded[i])
                if grad is not None:
                    if grad.data_ptr() != piece.data_ptr():
                        grad.copy_(piece)
                elif i not in bucket.ready and bool(piece.any()):
                    p.grad = piece.clone()
                    if bucket.sharded[i]:  # a DTensor like the parameter
                        from torch.distributed.tensor import DTensor

                        p.grad = DTensor.from_local(p.grad, p.device_mesh,  # type: ignore[attr-defined]
                                                    p.placements, run_check=False)  # type: ignore[attr-defined]
