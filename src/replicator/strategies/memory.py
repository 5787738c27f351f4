"""What a rank holds (``strategy.memory_report()``, docs/model_parallel.md); measuring
activations costs, so replicating strategies measure their first runs only, splitting ones all.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from replicator.comm.gradient_sync import local_tensor


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for ``t`` (a DTensor's local shard only)."""
    if t is None:
        return 0
    t = local_tensor(t)
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by one rank. ``peak_activation_bytes`` is the most bytes saved for
    backward alive at once during any ``strategy.run`` so far (0 before the first step)."""

    rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes
                + self.peak_activation_bytes)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {n / 2**20:.2f} MB" for name, n in (
            ("parameters", self.parameter_bytes), ("gradients", self.gradient_bytes),
            ("optimizer state", self.optimizer_state_bytes),
            ("peak activations", self.peak_activation_bytes)))
        return f"rank {self.rank}: {parts} (total {self.total_bytes / 2**20:.2f} MB)"


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Local bytes of every tensor in the optimizers' state (moments, momentum, steps)."""
    return sum(local_bytes(v) for opt in optimizers for state in opt.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


class _Saved:
    """A tensor saved for backward; tells the meter when autograd frees it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: the peak bytes of tensors saved for backward alive at once."""

    def __init__(self) -> None:
        super().__init__(self._pack, self._unpack)
        self.current = 0
        self.peak_bytes = 0
        self._refs: dict[tuple[int, int], int] = {}  # view -> saved tensors using it

    def _pack(self, t: torch.Tensor) -> _Saved:
        local = local_tensor(t)
        # a view counts its own bytes (microbatches are views of one batch), once
        size = local_bytes(local)
        try:
            key = (local.data_ptr(), size)
        except RuntimeError:  # no data pointer (a tensor subclass without storage)
            key = (id(local), size)
        holder = _Saved(t)
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or \
                size == 0:  # parameters (and FSDP's gathered views of them) are not activations
            return holder
        if self._refs.get(key, 0) == 0:
            self.current += size
            self.peak_bytes = max(self.peak_bytes, self.current)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(holder, self._release, key, size)
        return holder

    def _release(self, key: tuple[int, int], size: int) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.current -= size
        else:
            self._refs[key] = n

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def __enter__(self) -> ActivationMeter:  # type: ignore[override]
        super().__enter__()
        return self


class MemoryTracker:
    """What ``memory_report`` needs across steps (``samples``: runs measured; ``None``: all)."""

    def __init__(self, is_ours: Callable[[torch.Tensor], bool], samples: int | None) -> None:
        self._is_ours = is_ours
        self._samples = samples
        self.peak_activation_bytes = 0
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = \
            weakref.WeakKeyDictionary()

    def note(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state when it holds one of the strategy's parameters."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._checked.get(optimizer) == count:
            return
        self._checked[optimizer] = count
        if any(self._is_ours(p) for g in optimizer.param_groups for p in g["params"]):
            self.optimizers.add(optimizer)

    @contextlib.contextmanager
    def measuring(self, run: int) -> Iterator[None]:
        """Around ``strategy.run`` number ``run`` (from 1): measure its activations while
        sampling."""
        if self._samples is not None and run > self._samples:
            yield
            return
        with ActivationMeter() as meter:
            yield
        self.peak_activation_bytes = max(self.peak_activation_bytes, meter.peak_bytes)

    def report(self, rank: int, modules: Iterable[torch.nn.Module]) -> MemoryReport:
        """The report of global ``rank`` for ``modules`` (each parameter counted once)."""
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        return MemoryReport(rank=rank, parameter_bytes=sum(local_bytes(p) for p in params),
                            gradient_bytes=sum(local_bytes(p.grad) for p in params),
                            optimizer_state_bytes=optimizer_state_bytes(self.optimizers),
                            peak_activation_bytes=self.peak_activation_bytes)

