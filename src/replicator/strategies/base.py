"""The Strategy base class: one API for every way of running a step.

Public methods validate and normalise their input once, then call a small private hook that
each strategy implements (tf.distribute's split between ``Strategy`` and ``StrategyExtended``).
Identity, ``collectives``, the reduce/gather/barrier hooks and ``no_sync`` are written here once,
over the strategy's :class:`~replicator.strategies.replicas.ReplicaGroup`.
"""

from __future__ import annotations

import contextlib
import itertools
from abc import ABC
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.weak import WeakIdKeyDictionary

from replicator.comm.reduce_op import ReduceOp
from replicator.compilation import compile_in_use, keep_library_eager
from replicator.data.context import InputContext, InputOptions
from replicator.data.dataset import (
    DistributedDataset,
    distribute_dataset,
    distribute_datasets_from_function,
)
from replicator.strategies import replica_context
from replicator.strategies.scope_capture import RegistrationCapture, named_state
from replicator.strategies.undistributed import UndistributedGuard

if TYPE_CHECKING:
    from replicator.comm.collectives import Collectives
    from replicator.optim.accumulation import GradientAccumulator
    from replicator.precision import MixedPrecision
    from replicator.strategies.replicas import ReplicaGroup

_SERIALS = itertools.count(1)


def as_tensor(value: Any, call: str) -> torch.Tensor:
    """``value`` as a tensor; a clear ``TypeError`` naming ``call`` otherwise."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    try:
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)):
            return torch.as_tensor(value)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{call}() takes a tensor or a Python number, got {type(value).__name__}")


class Strategy(ABC):
    """How a step function runs across replicas. A subclass opens its replica group (as
    ``self._replica_group``, before ``Strategy.__init__``) and implements the ``_hooks`` that
    are its own."""

    name: ClassVar[str] = "strategy"
    #: The replicas this strategy keeps in step: device, group, tracker, collectives, identity,
    #: and the data-parallel gradient engine (see :mod:`replicator.strategies.replicas`).
    _replica_group: ReplicaGroup
    #: The mixed-precision policy given to ``scope(precision=...)`` (``None``: full precision).
    _precision: MixedPrecision | None = None

    def __init__(self) -> None:
        self._scope_depth = 0
        self._capture: RegistrationCapture | None = None
        #: unique for the process's lifetime (never reused, unlike ``id(self)``)
        self.serial = next(_SERIALS)
        # modules and tensors this strategy has set up, held weakly: a tensor freed later
        # cannot make a new one with the same id look distributed
        self._set_up_modules: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._distributed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._guard: UndistributedGuard | None = None
        self._closed = False
        replica_context.created(self)

    # -- identity ------------------------------------------------------------------------------
    @property
    def _data_group(self) -> dist.ProcessGroup | None:
        """The process group of the data-parallel replicas (``None``: the default group); the
        input pipeline agrees on uneven ends over it."""
        return self._replica_group.group

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each synchronous step."""
        return self._replica_group.world_size

    @property
    def replica_id(self) -> int:
        """This process's replica index (``replica_id_in_sync_group``)."""
        return self._replica_group.rank

    @property
    def is_chief(self) -> bool:
        """True on the replica that prints, logs and writes shared files."""
        return self.replica_id == 0

    @property
    def device(self) -> torch.device:
        """The device this process's replica computes on."""
        return self._replica_group.device

    @property
    def collectives(self) -> Collectives:
        """The collectives over this strategy's replicas (a single-rank one where there is
        one replica), for other rooms built on the public API (checkpoint exchange)."""
        return self._replica_group.collectives

    @property
    def shards_model(self) -> bool:
        """True when no rank holds the whole model (pipeline stages, tensor or FSDP shards):
        its state is then saved by every rank. False for replicating strategies."""
        return False

    def prepare_optimizers(self, *optimizers: torch.optim.Optimizer) -> None:
        """Make ``optimizers`` step the parameters as the strategy set them up (a strategy
        that replaced parameters by sharded ones points optimizers built in ``scope()`` at
        the new ones). Runs before every optimizer step; call it before loading or saving an
        optimizer's state outside a step. A no-op for strategies that keep parameters."""
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"prepare_optimizers takes torch optimizers, got "
                                f"{type(optimizer).__name__}")
            self._prepare_optimizer(optimizer)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook: see :meth:`prepare_optimizers` (one optimizer)."""
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replicas={self.num_replicas_in_sync}, "
                f"replica_id={self.replica_id}, device={self.device})")

    # -- scope -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, precision: MixedPrecision | str | None = None) -> Iterator[Strategy]:
        """Modules created inside become distributed when the block ends (see the strategy).

        ``precision``: a :class:`~replicator.MixedPrecision` policy (or its dtype name, e.g.
        ``"bf16"``) whose autocast the forward pass of every module set up from now on runs
        under; the strategy keeps it (``strategy.precision``).
        """
        self._check_open("scope")
        if precision is not None:
            self._set_precision(precision)
        outermost = self._scope_depth == 0
        if outermost:
            self._capture = RegistrationCapture()
            self._capture.start()
        self._scope_depth += 1
        device_ctx = torch.device(self.device) if self.device.type != "cpu" else \
            contextlib.nullcontext()
        ok = False
        try:
            with replica_context.entered(self), device_ctx:
                yield self
            ok = True
        finally:
            self._scope_depth -= 1
            if outermost:
                assert self._capture is not None
                modules = self._capture.stop()
                self._capture = None
                if ok:
                    self._distribute_modules(modules)

    def distribute_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make a model built outside ``scope()`` distributed; returns the same module."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"distribute_model takes a torch.nn.Module, got "
                            f"{type(model).__name__}")
        self._check_open("distribute_model")
        if self.device.type != "cpu":
            model.to(self.device)
        self._distribute_modules([model])
        return model

    def _distribute_modules(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            if module not in self._set_up_modules:
                if self._precision is not None:
                    self._precision.apply(module)
                self._setup_module(module)
                self._set_up_modules[module] = True
                for _, t in [*module.named_parameters(), *module.named_buffers()]:
                    self._distributed[t] = True

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` belongs to a module this strategy has set up."""
        return tensor in self._distributed

    def _setup_module(self, module: torch.nn.Module) -> None:
        """Hook: make one top-level ``module`` distributed (called once per module, at scope
        exit and by :meth:`distribute_model`). The default passes the module's parameters and
        buffers not yet distributed to :meth:`_on_new_state`; a strategy that shards, wraps or
        places modules overrides this hook (and registers torch's state-dict hooks on the
        module when its checkpoint layout differs from the module's own)."""
        params, buffers = named_state(module)
        params = [(n, p) for n, p in params if p not in self._distributed]
        buffers = [(n, b) for n, b in buffers if b not in self._distributed]
        if not params and not buffers and self.num_replicas_in_sync == 1:
            return
        self._on_new_state(module, params, buffers)

    def _on_new_state(self, module: torch.nn.Module,
                      params: list[tuple[str, torch.nn.Parameter]],
                      buffers: list[tuple[str, torch.Tensor]]) -> None:
        """Hook: make ``module``'s new (named) parameters and buffers distributed (sync initial
        values, add gradient hooks)."""
        return None

    def close(self) -> None:
        """Release what the strategy installed (gradient hooks, helper threads); idempotent.
        The strategy cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.close()
        self._close()
        replicas = getattr(self, "_replica_group", None)
        if replicas is not None:
            replicas.close()

    def _close(self) -> None:
        """Hook: release the strategy's own resources."""
        return None

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"{call}() on a closed {type(self).__name__}. HINT: create a new "
                               "strategy; close() releases its hooks for good.")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; the next synced
        backward averages the accumulated sum (gradient accumulation without extra
        communication)."""
        with self._replica_group.no_sync():
            yield

    def accumulate(self, k: int) -> GradientAccumulator:
        """Gradient accumulation over ``k`` micro-batches, built on :meth:`no_sync`: ``k``
        global batches of ``B`` give the gradient of one batch of ``k * B`` (see
        :class:`~replicator.optim.GradientAccumulator`)."""
        from replicator.optim.accumulation import GradientAccumulator

        return GradientAccumulator(k, self.no_sync)

    # -- mixed precision ---------------------------------------------------------------------
    @property
    def precision(self) -> MixedPrecision | None:
        """The mixed-precision policy of this strategy (``None``: full precision)."""
        return self._precision

    def _set_precision(self, precision: MixedPrecision | str) -> None:
        from replicator.precision import MixedPrecision

        if isinstance(precision, str):
            if self._precision is not None and \
                    self._precision.compute_dtype == MixedPrecision(precision).compute_dtype:
                return
            precision = MixedPrecision(precision)
        if not isinstance(precision, MixedPrecision):
            raise TypeError(f"scope(precision=...) takes rp.MixedPrecision('bf16') or a dtype "
                            f"name, got {type(precision).__name__}")
        if self._precision is not None and self._precision is not precision:
            raise ValueError(f"{type(self).__name__} already has the policy {self._precision!r}; "
                             f"got {precision!r}. HINT: give precision= to the first scope() "
                             "only, or use one strategy per policy")
        precision.bind(self)
        self._precision = precision

    # -- running a step ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple | list = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` on this process's replica and return its result."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable step function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"run(fn, args=...) takes a tuple of arguments, got "
                            f"{type(args).__name__}. HINT: write args=(batch,)")
        self._check_open("run")
        if compile_in_use():
            keep_library_eager()
        if self.num_replicas_in_sync > 1 and self._guards_undistributed:
            if self._guard is None:
                self._guard = UndistributedGuard(self)
            with replica_context.entered(self), self._guard.watching():
                return self._run(fn, tuple(args), dict(kwargs or {}))
        with replica_context.entered(self):
            return self._run(fn, tuple(args), dict(kwargs or {}))

    #: Whether ``run`` refuses trainable parameters this strategy never distributed (on for
    #: synchronous replica strategies, where they would silently train N separate models).
    _guards_undistributed: ClassVar[bool] = False

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return fn(*args, **kwargs)

    # -- one training step's forward and backward -------------------------------------------
    def forward_backward(self, model: torch.nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """``loss = loss_fn(model(inputs), target); loss.backward()``, returning the loss
        (detached). The same call works under every strategy; a pipeline runs it as one
        schedule run with the loss on the last stage (no second forward pass)."""
        loss = loss_fn(model(inputs), target)
        loss.backward()
        return loss.detach()

    # -- cross-replica values ----------------------------------------------------------------
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine a per-replica value across replicas (and along ``axis`` if given).

        ``reduce("mean", x, axis=0)`` is the mean over every replica's rows of ``x``, counted
        per row, so uneven batches give the true global mean.
        """
        op = ReduceOp.parse(op)
        tensor = as_tensor(value, "reduce")
        if axis is None:
            return self._reduce(op, tensor)
        if tensor.dim() == 0:
            raise ValueError("reduce(..., axis=...) needs a tensor with at least one dimension")
        if op is ReduceOp.MEAN:
            total = tensor.sum(axis, dtype=torch.float64 if not tensor.is_floating_point()
                               else None)
            count = torch.tensor(float(tensor.shape[axis]), dtype=total.dtype)
            total, count = self._reduce_many(ReduceOp.SUM, [total, count])
            return total / count
        local = {ReduceOp.SUM: lambda t: t.sum(axis), ReduceOp.MIN: lambda t: t.amin(axis),
                 ReduceOp.MAX: lambda t: t.amax(axis)}[op](tensor)
        return self._reduce(op, local)

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        """Concatenate every replica's ``value`` along ``axis`` (sizes there may differ)."""
        tensor = as_tensor(value, "gather")
        if tensor.dim() and not -tensor.dim() <= axis < tensor.dim():
            raise ValueError(f"gather axis {axis} is out of range for a tensor of shape "
                             f"{tuple(tensor.shape)}")
        return self._gather(tensor, axis)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas (one per process here)."""
        return (value,)

    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        return self._replica_group.reduce(op, tensor)

    def _reduce_many(self, op: ReduceOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._replica_group.reduce_many(op, tensors)

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self._replica_group.gather(tensor, axis)

    def barrier(self) -> None:
        """Wait until every replica reaches this point."""
        self._replica_group.barrier()

    # -- input -----------------------------------------------------------------------------------
    @property
    def input_context(self) -> InputContext:
        return InputContext(num_input_pipelines=self.num_replicas_in_sync,
                            input_pipeline_id=self.replica_id,
                            num_replicas_in_sync=self.num_replicas_in_sync)

    def distribute_dataset(self, dataset: DataLoader | Dataset | Sequence[str], *,
                           batch_size: int | None = None, shuffle: bool | None = None,
                           seed: int = 0, drop_last: bool | None = None,
                           drop_remainder: bool | None = None,
                           transform: Callable[[Any], Any] | None = None,
                           reader: Callable[[str], Iterable[Any]] | None = None,
                           options: InputOptions | None = None,
                           partial_batch: str = "mask") -> DistributedDataset:
        """Split each *global* batch of ``dataset`` across replicas.

        Give a ``DataLoader`` built with the global batch size (its ``shuffle`` and
        ``drop_last`` are kept; shuffling is re-seeded from ``seed`` and the epoch so every
        world size sees the same global batches), a ``Dataset`` with ``batch_size=``, or a list
        of files with ``reader=``. ``drop_remainder`` (alias ``drop_last``) drops a short last
        batch; otherwise it is kept, and a replica that would get nothing gets a masked copy
        (``partial_batch="mask"``) or 0 rows (``"empty"``, tf's). ``transform`` runs per
        sample in the workers; ``options`` is ``rp.data.InputOptions`` (prefetch, workers,
        sharding policy, device copy).
        """
        return distribute_dataset(dataset, self.input_context, self.device,
                                  batch_size=batch_size, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last, drop_remainder=drop_remainder,
                                  transform=transform, reader=reader, options=options,
                                  group=self._data_group, partial_batch=partial_batch)

    experimental_distribute_dataset = distribute_dataset

    def distribute_datasets_from_function(
            self, input_fn: Callable[[InputContext], Iterable[Any]], *,
            drop_remainder: bool | None = None,
            options: InputOptions | None = None) -> DistributedDataset:
        """Call ``input_fn(ctx)`` to build this replica's own pipeline of per-replica batches.

        Replicas whose pipelines end at different steps stop together
        (``drop_remainder=True``, the default) or pad with masked batches (``False``).
        """
        return distribute_datasets_from_function(input_fn, self.input_context, self.device,
                                                 drop_remainder=drop_remainder, options=options,
                                                 group=self._data_group)
