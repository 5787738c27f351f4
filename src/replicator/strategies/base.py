"""The Strategy base class: one API for every way of running a step. Public methods validate
their input, then call a private hook each strategy implements (tf.distribute's
``Strategy``/``StrategyExtended`` split); the rest is written once over the ``ReplicaGroup``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from abc import ABC
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
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
from replicator.data.epochs import Epochs
from replicator.data.live_split import map_input
from replicator.errors import ClusterConfigError
from replicator.optim.accumulation import GradientAccumulator
from replicator.precision import MixedPrecision
from replicator.strategies import observers
from replicator.strategies.live.dataset import LiveDataset
from replicator.strategies.live.engine import LiveEngine
from replicator.strategies.live.settings import LiveSettings
from replicator.strategies.memory import MemoryReport, MemoryTracker
from replicator.strategies.nest import Axis, gather_value, reduce_value
from replicator.strategies.scope_capture import WATCH, RegistrationCapture

if TYPE_CHECKING:
    from replicator.comm.collectives import Collectives
    from replicator.strategies.replicas import ReplicaGroup

_SERIALS = itertools.count(1)
_CURRENT: list[Strategy] = []
_LAST_CREATED: list[weakref.ref[Strategy]] = []
#: The open strategies in creation order, served by one pair of global optimizer-step hooks
#: never removed (a removal from a finalizer during another optimizer's step raised
#: "OrderedDict mutated during iteration").
_OPEN: weakref.WeakValueDictionary[int, Strategy] = weakref.WeakValueDictionary()
_STEP_HOOKS: list[Any] = []
_NO_MODEL = object()  # what _check_open is given for calls that take no model


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for strategy in list(_OPEN.values()):
        strategy._before_optimizer_step(optimizer, args, kwargs)


def _after_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for strategy in list(_OPEN.values()):
        strategy._after_optimizer_step(optimizer)


@contextlib.contextmanager
def entered(strategy: Strategy) -> Iterator[None]:
    """Make ``strategy`` the active one inside the block (``scope()`` and ``run()``)."""
    _CURRENT.append(strategy)
    try:
        yield
    finally:
        _CURRENT.pop()


def current_strategy() -> Strategy | None:
    """The strategy whose ``scope()`` or ``run()`` is active, else the newest one created."""
    if _CURRENT:
        return _CURRENT[-1]
    return _LAST_CREATED[0]() if _LAST_CREATED else None


@dataclass(frozen=True)
class ValueContext:
    """Which replica a value is for (tf.distribute's ``ValueContext``): what
    ``distribute_values_from_function(fn)`` passes to ``fn``, once in each process."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class Strategy(ABC):
    """How a step function runs across replicas. A subclass opens its replica group (as
    ``self._replica_group``, before ``Strategy.__init__``) and implements its own ``_hooks``.
    ``check_finite=True``: :meth:`run` raises ``NonFiniteLossError`` on every replica when the
    result holds a NaN or infinity on any (:mod:`replicator.strategies.observers`).
    """

    name: ClassVar[str] = "strategy"
    #: The replicas this strategy keeps in step (:mod:`replicator.strategies.replicas`).
    _replica_group: ReplicaGroup
    #: The mixed-precision policy given to ``scope(precision=...)`` (``None``: full precision).
    precision: MixedPrecision | None = None
    #: The live-recovery engine when this process is one replica group of several
    #: (``replicator run --replica-groups N``), else ``None``.
    live: LiveEngine | None = None

    def __init__(self, *, check_finite: bool = False) -> None:
        self._check_finite = bool(check_finite)
        self._runs = 0
        self._warned_uneven = False
        self._scope_depth = 0
        #: unique for the process's lifetime (never reused, unlike ``id(self)``)
        self.serial = next(_SERIALS)
        # held weakly: a tensor freed later cannot make a new one with its id look distributed
        self._set_up_modules: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._distributed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._closed = False
        self._memory = MemoryTracker(self.is_distributed, self._activation_samples)
        self.live = self._start_live()
        _OPEN[self.serial] = self
        if not _STEP_HOOKS:
            _STEP_HOOKS.extend([register_optimizer_step_pre_hook(_before_any_step),
                                register_optimizer_step_post_hook(_after_any_step)])
        _LAST_CREATED[:] = [weakref.ref(self)]  # in SPMD code, the one the process runs under
        WATCH.add(self)

    # -- live recovery across replica groups -------------------------------------------------
    #: Whether the strategy can run as one replica group of a live-recovery job.
    _supports_live: ClassVar[bool] = False

    def _start_live(self) -> LiveEngine | None:
        settings = LiveSettings.from_env()
        replicas = getattr(self, "_replica_group", None)
        if settings is None or replicas is None:
            return None
        if not self._supports_live:
            raise ClusterConfigError(
                f"{type(self).__name__} cannot run in replica groups ({settings.who} of "
                f"{settings.groups}). HINT: use rp.MirroredStrategy(), "
                "rp.CentralStorageStrategy() or rp.FSDPStrategy(), or launch without "
                "--replica-groups")
        me = weakref.ref(self)

        def modules() -> list[torch.nn.Module]:
            strategy = me()
            return [] if strategy is None else list(strategy._set_up_modules.keys())

        def replicated() -> bool:
            strategy = me()
            return strategy is not None and not strategy.shards_model

        return LiveEngine(settings, replicas, modules, replicated)

    # -- identity ------------------------------------------------------------------------------
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
        """True on the one process that prints, logs and writes shared files (global rank 0
        where several ranks share replica 0)."""
        return self._replica_group.is_chief

    @property
    def device(self) -> torch.device:
        """The device this process's replica computes on."""
        return self._replica_group.device

    @property
    def collectives(self) -> Collectives:
        """The collectives over this strategy's replicas (single-rank with one replica)."""
        return self._replica_group.collectives

    @property
    def shards_model(self) -> bool:
        """True when no rank holds the whole model (pipeline stages, tensor or FSDP shards):
        its state is then saved by every rank. False for replicating strategies."""
        return False

    def prepare_optimizers(self, *optimizers: torch.optim.Optimizer) -> None:
        """Point ``optimizers`` at the parameters as the strategy set them up (sharded ones, say);
        runs before every step, and is called before loading or saving optimizer state."""
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"prepare_optimizers takes torch optimizers, got "
                                f"{type(optimizer).__name__}")
            self._prepare_optimizer(optimizer)
            self._memory.note(optimizer)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook: see :meth:`prepare_optimizers` (one optimizer)."""
        return None

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                               kwargs: Any) -> None:
        """Hook before every optimizer step while open: prepare, then the live engine's commit."""
        self.prepare_optimizers(optimizer)
        if self.live is not None:
            self.live.before_optimizer_step(optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook after every optimizer step while the strategy is open."""
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replicas={self.num_replicas_in_sync}, "
                f"replica_id={self.replica_id}, device={self.device})")

    # -- scope -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, precision: MixedPrecision | str | None = None) -> Iterator[Strategy]:
        """Modules created inside become distributed when the block ends (see the strategy);
        ``precision`` (a ``MixedPrecision`` or dtype name, e.g. ``"bf16"``) becomes the strategy's
        policy for every module set up from now on."""
        self._check_open("scope")
        if precision is not None:
            self._set_precision(precision)
        capture = RegistrationCapture() if self._scope_depth == 0 else None  # the outermost's
        self._scope_depth += 1
        device_ctx = torch.device(self.device) if self.device.type != "cpu" else \
            contextlib.nullcontext()
        ok = False
        try:
            with entered(self), device_ctx:
                yield self
            ok = True
        finally:
            self._scope_depth -= 1
            if capture is not None:
                modules = capture.stop()
                if ok:
                    self._distribute_modules(modules)

    def distribute_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make a model built outside ``scope()`` distributed; returns the same module."""
        self._check_open("distribute_model", model)
        if self.device.type != "cpu":
            model.to(self.device)
        self._distribute_modules([model])
        return model

    def _distribute_modules(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            if module not in self._set_up_modules:
                if self.precision is not None:
                    self.precision.apply(module)
                self._setup_module(module)
                self._set_up_modules[module] = True
                for _, t in [*module.named_parameters(), *module.named_buffers()]:
                    self._distributed[t] = True

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The whole ``model``'s state dict, to save as one file (a collective): where the model is
        split the chief gets full CPU tensors with the one-device keys and others ``{}``; otherwise
        every rank ``model.state_dict()`` with detached tensors (no copy)."""
        self._check_open("full_state_dict", model)
        return self._full_state_dict(model)

    def _full_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Hook: see :meth:`full_state_dict` (the default: ``model.state_dict()`` detached)."""
        return {k: v.detach() if isinstance(v, torch.Tensor) else v
                for k, v in model.state_dict().items()}

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` belongs to a module this strategy has set up."""
        return tensor in self._distributed

    def _setup_module(self, module: torch.nn.Module) -> None:
        """Hook: make one top-level ``module`` distributed (by default: nothing to do)."""
        return None

    def close(self) -> None:
        """Release what the strategy installed (gradient hooks, helper threads); idempotent.
        The strategy cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        _OPEN.pop(self.serial, None)
        self._close()
        if self.live is not None:
            self.live.close()
        replicas = getattr(self, "_replica_group", None)
        if replicas is not None:
            replicas.close()

    def _close(self) -> None:
        """Hook: release the strategy's own resources."""
        return None

    def _check_open(self, call: str, model: Any = _NO_MODEL) -> None:
        """Refuse ``call`` given a ``model`` that is no module, or on a closed strategy."""
        if model is not _NO_MODEL and not isinstance(model, torch.nn.Module):
            raise TypeError(f"{call} takes a torch.nn.Module, got {type(model).__name__}")
        if self._closed:
            raise RuntimeError(f"{call}() on a closed {type(self).__name__}. HINT: create a new "
                               "strategy; close() releases its hooks for good.")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; the next synced
        backward averages the accumulated sum."""
        with self._replica_group.no_sync():
            yield

    def accumulate(self, k: int) -> GradientAccumulator:
        """Gradient accumulation over ``k`` micro-batches on :meth:`no_sync`: ``k`` global
        batches of ``B`` give the gradient of one of ``k * B`` (``GradientAccumulator``)."""
        return GradientAccumulator(k, self.no_sync)

    # -- mixed precision ---------------------------------------------------------------------
    def _set_precision(self, precision: MixedPrecision | str) -> None:
        if isinstance(precision, str):
            precision = MixedPrecision(precision)
            if self.precision is not None and \
                    self.precision.compute_dtype == precision.compute_dtype:
                return
        if not isinstance(precision, MixedPrecision):
            raise TypeError(f"scope(precision=...) takes rp.MixedPrecision('bf16') or a dtype "
                            f"name, got {type(precision).__name__}")
        if self.precision is not None and self.precision is not precision:
            raise ValueError(f"{type(self).__name__} already has the policy {self.precision!r}; "
                             f"got {precision!r}. HINT: give precision= to the first scope() "
                             "only, or use one strategy per policy")
        precision.bind(self)
        self.precision = precision

    # -- memory ------------------------------------------------------------------------------
    #: How many runs measure their activations (``None``: every run).
    _activation_samples: ClassVar[int | None] = 3

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds: parameters, gradients and optimizer state of what this
        strategy set up, and the peak of activations saved for backward in ``run`` (measured
        in the first three runs; in every run where the model is split)."""
        rank = dist.get_rank() if dist.is_initialized() else self.collectives.global_rank
        return self._memory.report(rank, list(self._set_up_modules.keys()))

    def memory_reports(self) -> list[MemoryReport]:
        """Every rank's :meth:`memory_report`, in rank order (a collective: all call it)."""
        mine = torch.tensor([astuple(self.memory_report())], dtype=torch.int64)  # fields in order
        rows = self._report_collectives.all_gather_uneven(mine, 0, "memory report exchange")
        return [MemoryReport(*[int(v) for v in row]) for row in rows.tolist()]

    @property
    def _report_collectives(self) -> Collectives:
        """The ranks :meth:`memory_reports` gathers from (the replicas by default)."""
        return self.collectives

    # -- running a step ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple | list = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` on this process's replica and return its result (checked
        on every replica together with ``check_finite=True``)."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable step function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"run(fn, args=...) takes a tuple of arguments, got "
                            f"{type(args).__name__}. HINT: write args=(batch,)")
        self._check_open("run")
        args = observers.run_started(self, tuple(args))
        try:
            return self._run_step(fn, args, kwargs)
        finally:
            observers.run_finished(self)

    def _run_step(self, fn: Callable[..., Any], args: tuple,
                  kwargs: dict[str, Any] | None) -> Any:
        """The step of :meth:`run`, between the observers' start and finish."""
        if compile_in_use():
            keep_library_eager()
        self._runs += 1
        watching = WATCH.running() if self.num_replicas_in_sync > 1 and \
            self._guards_undistributed else contextlib.nullcontext()
        uneven = observers.begin_step()
        with entered(self), watching, self._memory.measuring(self._runs):
            def step(a: tuple) -> Any:
                return self._run(fn, a, dict(kwargs or {}))
            # with replica groups, a step not committed across the groups is redone
            result = step(args) if self.live is None else self.live.run_step(step, args)
        observers.check_step(uneven, self)
        if self._check_finite:
            observers.check_finite_result(result, self)
        return result

    #: Whether trainable parameters this strategy never distributed are refused (where the
    #: replicas would silently train N models: :mod:`replicator.strategies.scope_capture`).
    _guards_undistributed: ClassVar[bool] = False

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return fn(*args, **kwargs)

    # -- one training step's forward and backward -------------------------------------------
    def forward_backward(self, model: torch.nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """``loss = loss_fn(model(inputs), target); loss.backward()``, returning the loss
        (detached). The same call works under every strategy; a pipeline runs it as one
        schedule run with the loss on the last stage (no second forward pass)."""
        observers.called(self, "forward_backward")
        loss = loss_fn(model(inputs), target)
        loss.backward()
        return loss.detach()

    # -- cross-replica values ----------------------------------------------------------------
    def reduce(self, op: ReduceOp | str, value: Any, axis: Axis = None) -> Any:
        """Combine a per-replica value (a tensor, number, or nest of them, in one collective)
        across replicas, and along ``axis`` (int or tuple) if given: ``reduce("mean", x, axis=0)``
        is the mean over every replica's rows, so uneven batches give the true global mean
        (:mod:`replicator.strategies.nest`).
        """
        op = ReduceOp.parse(op)
        observers.called(self, "reduce")
        return reduce_value(op, value, axis, self._reduce, self._reduce_many)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate every replica's ``value`` along ``axis`` (sizes there may differ; a
        scalar counts as one row). A nest is gathered leaf by leaf in one exchange and
        returned with the same structure."""
        observers.called(self, "gather")
        return gather_value(value, axis, self._gather, self._gather_many)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas (one per process here)."""
        return (value,)

    experimental_local_results = local_results

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """This replica's value ``value_fn(ValueContext(replica_id, num_replicas))``, called once
        per process (the replica); a per-replica value as ``strategy.run`` takes and returns."""
        if not callable(value_fn):
            raise TypeError(f"distribute_values_from_function() needs a callable, got "
                            f"{type(value_fn).__name__}")
        return value_fn(ValueContext(self.replica_id, self.num_replicas_in_sync))

    experimental_distribute_values_from_function = distribute_values_from_function

    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(tensor, op, f"reduce({op.value})")

    def _reduce_many(self, op: ReduceOp, tensors: list[torch.Tensor],
                     structure: str = "") -> list[torch.Tensor]:
        return self.collectives.all_reduce_many(tensors, op, f"reduce({op.value})", structure)

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self.collectives.all_gather_uneven(tensor, axis, "gather")

    def _gather_many(self, tensors: list[torch.Tensor], axis: int,
                     structure: str = "") -> list[torch.Tensor]:
        return self.collectives.all_gather_many(tensors, axis, "gather", structure)

    def barrier(self) -> None:
        """Wait until every replica reaches this point."""
        self.collectives.barrier()

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
                           partial_batch: str = "mask", epochs: int | None = None) -> Any:
        """Split each *global* batch of ``dataset`` across replicas (docs/input_pipeline.md):
        a ``DataLoader`` with the global batch size (its ``shuffle`` and ``drop_last`` kept,
        shuffling re-seeded from ``seed`` and the epoch), a ``Dataset`` with ``batch_size=``, or
        files with ``reader=``; ``transform`` runs per sample in the workers. ``drop_remainder``
        (alias ``drop_last``) drops a short last batch, else a replica that gets nothing gets what
        ``partial_batch`` says (``"mask"``, ``"empty"``). ``epochs=E``: one loop runs ``E``
        epochs. With replica groups each step's batch is split over its quorum (map-style input).
        """
        if self.live is not None:
            if transform is not None or reader is not None:
                raise ValueError("transform= and reader= are not supported with replica "
                                 "groups; apply the transform in the dataset's __getitem__")
            drop = drop_remainder if drop_remainder is not None else drop_last
            data = map_input(dataset, batch_size=batch_size, shuffle=shuffle,
                             drop_remainder=drop)
            return LiveDataset(self.live, data, self.device, seed=seed, epochs=epochs)
        result = distribute_dataset(dataset, self.input_context, self.device,
                                    batch_size=batch_size, shuffle=shuffle, seed=seed,
                                    drop_last=drop_last, drop_remainder=drop_remainder,
                                    transform=transform, reader=reader, options=options,
                                    group=self._replica_group.group, partial_batch=partial_batch)
        return result if epochs is None else Epochs(result, epochs)

    experimental_distribute_dataset = distribute_dataset

    def distribute_datasets_from_function(
            self, input_fn: Callable[[InputContext], Iterable[Any]], *,
            drop_remainder: bool | None = None,
            options: InputOptions | None = None,
            partial_batch: str = "mask") -> DistributedDataset:
        """Call ``input_fn(ctx)`` to build this replica's own pipeline of per-replica batches.
        Replicas ending at different steps stop together (``drop_remainder=True``) or go on, one out
        of data yielding a masked copy (``partial_batch="mask"``) or 0 rows (``"empty"``).
        """
        return distribute_datasets_from_function(input_fn, self.input_context, self.device,
                                                 drop_remainder=drop_remainder, options=options,
                                                 group=self._replica_group.group,
                                                 partial_batch=partial_batch)
