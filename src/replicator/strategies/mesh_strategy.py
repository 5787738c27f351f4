"""MeshStrategy: data, fully sharded, pipeline and tensor parallelism composed on one mesh.

torchtitan's way: a :class:`~replicator.cluster.Topology` names the axes, and at scope exit
each axis applies its plain function to the model, innermost first: the model is cut into
pipeline stages (``pipeline``), each stage's layers are sharded across ranks
(``tensor``, DTensor ``parallelize_module``), its blocks are fully sharded (``fsdp``, FSDP2
``fully_shard``), and its gradients are averaged across replicas (``data``). The input is split
across the data axes only (``data`` and ``fsdp``): the ranks of one replica (its pipeline
stages and tensor shards) all see the same batch.

:class:`~replicator.FSDPStrategy`, :class:`~replicator.TensorParallelStrategy` and
:class:`~replicator.PipelineStrategy` are this class with one axis (plus ``data`` for
whatever ranks are left).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from replicator.cluster.devices import default_device_for
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.process_group import initialize, on_shutdown, open_store_client
from replicator.cluster.topology import Topology
from replicator.comm.collectives import Collectives
from replicator.comm.progress import CollectiveTracker
from replicator.comm.reduce_op import ReduceOp
from replicator.errors import ClusterConfigError
from replicator.strategies.base import Strategy
from replicator.strategies.data_parallel_gradients import DataParallelGradients

#: Mesh order, outermost first (torchtitan's): pipeline stages talk least, tensor shards most,
#: so tensor-parallel ranks are neighbours (the same host).
AXIS_ORDER = ("pipeline", "data", "fsdp", "tensor")

#: Axis combinations tested to equal one device; others are refused with a clear error.
SUPPORTED = (
    frozenset({"data"}), frozenset({"fsdp"}), frozenset({"tensor"}), frozenset({"pipeline"}),
    frozenset({"data", "fsdp"}), frozenset({"data", "tensor"}), frozenset({"fsdp", "tensor"}),
    frozenset({"data", "pipeline"}),
)


def _axes_from_degrees(degrees: Mapping[str, int]) -> dict[str, int]:
    unknown = [a for a in degrees if a not in AXIS_ORDER]
    if unknown:
        raise ClusterConfigError(f"MeshStrategy got unknown axis {unknown[0]!r}; axes are "
                                 f"{', '.join(AXIS_ORDER)} (e.g. MeshStrategy(data=2, "
                                 "tensor=2))")
    axes = {a: degrees[a] for a in AXIS_ORDER if a in degrees and degrees[a] != 1}
    return axes or {"data": 1}


class MeshStrategy(Strategy):
    """Compose parallelisms on a 2-D (or larger) mesh: ``MeshStrategy(data=2, tensor=2)``.

    Degrees: ``data`` (replicas, gradients averaged), ``fsdp`` (replicas with parameters,
    gradients and optimizer state sharded), ``pipeline`` (stages), ``tensor`` (layer shards).
    Their product must equal the number of processes; ``-1`` infers one. ``tensor_plan``: see
    :class:`~replicator.TensorParallelStrategy`; ``pipeline``: the options of
    :class:`~replicator.PipelineStrategy` as a dict; ``reshard_after_forward``: FSDP's option.
    """

    name = "mesh"
    _guards_undistributed = True

    def __init__(self, *, data: int = 1, fsdp: int = 1, pipeline: int = 1, tensor: int = 1,
                 tensor_plan: Mapping[str, Any] | None = None,
                 pipeline_options: Mapping[str, Any] | None = None,
                 reshard_after_forward: bool = True,
                 timeout_seconds: float | None = None) -> None:
        axes = _axes_from_degrees({"data": data, "fsdp": fsdp, "pipeline": pipeline,
                                   "tensor": tensor})
        spec = resolve_cluster()
        self._device = default_device_for(spec.local_rank)
        info = initialize(timeout_seconds=timeout_seconds, device=self._device)
        self._topology = Topology(axes)
        used = frozenset(a for a, n in self._topology.axes.items() if n > 1) or \
            frozenset({"data"})
        if used not in SUPPORTED:
            shape = " x ".join(f"{a}={n}" for a, n in self._topology.axes.items())
            raise ClusterConfigError(
                f"MeshStrategy({shape}) composes axes that are not supported yet. HINT: "
                "supported compositions: data x pipeline, data x tensor, fsdp x tensor, data x "
                "fsdp, and each axis alone.")
        self._tensor_plan = dict(tensor_plan) if tensor_plan is not None else None
        self._pipeline_options = dict(pipeline_options or {})
        self._reshard_after_forward = reshard_after_forward
        #: Sequence-parallel norms in the default tensor plan (TensorParallelStrategy's option).
        self._sequence_parallel = False
        self._data_group = self._topology.data_group()
        self._replicas = self._topology.num_replicas
        self._replica_id = self._topology.replica_id
        rank_in_data = dist.get_rank(self._data_group)
        self._tracker = CollectiveTracker(rank_in_data, self._replicas, open_store_client(info))
        on_shutdown(self._tracker.close)
        self._collectives = Collectives(rank_in_data, self._replicas, self._device,
                                        info.timeout_seconds, self._tracker,
                                        group=self._data_group)
        # parameters replaced by sharded ones (old -> new), for optimizers built in scope
        self._replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = \
            weakref.WeakKeyDictionary()
        self._grad_averagers: list[DataParallelGradients] = []
        self._pipelines: list[Any] = []  # PipelineRunner per set-up module
        self._activation_peak = 0
        me = weakref.ref(self)

        def remap(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            strategy = me()
            if strategy is not None:
                strategy._remap_optimizer(optimizer)

        self._optimizer_hook = register_optimizer_step_pre_hook(remap)
        super().__init__()

    # -- identity ------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel replicas (the product of the data and fsdp degrees)."""
        return self._replicas

    @property
    def replica_id(self) -> int:
        return self._replica_id

    @property
    def is_chief(self) -> bool:
        """Global rank 0 only (several ranks share replica 0 when the model is split)."""
        return self._topology.is_chief

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def topology(self) -> Topology:
        """The mesh this strategy works on (axes, groups, this rank's coordinates)."""
        return self._topology

    @property
    def mesh(self) -> Topology:
        return self._topology

    @property
    def shards_model(self) -> bool:
        """True when no rank holds the whole model (pipeline stages, tensor or FSDP shards):
        its state is then saved by every rank (``torch.distributed.checkpoint``)."""
        return any(self._topology.size(a) > 1 for a in ("pipeline", "tensor", "fsdp"))

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={n}" for a, n in self._topology.axes.items())
        return f"{type(self).__name__}({shape}; rank {self._topology.global_rank})"

    # -- setting up a module --------------------------------------------------------------------
    def _setup_module(self, module: torch.nn.Module) -> None:
        topo = self._topology
        self._broadcast_initial_state(module)
        runner = None
        if topo.size("pipeline") > 1:
            from replicator.strategies.pipeline import PipelineRunner

            runner = PipelineRunner(module, topo, self._device, **self._pipeline_options)
            self._pipelines.append(runner)
            parts = runner.local_modules
        else:
            parts = [module]
        for part in parts:
            if topo.size("tensor") > 1:
                from replicator.strategies.tensor_parallel import apply_tensor_parallel

                apply_tensor_parallel(part, topo.mesh["tensor"], self._tensor_plan,
                                      sequence_parallel=self._sequence_parallel)
            if topo.size("fsdp") > 1:
                from replicator.strategies.fsdp import apply_fsdp

                dims = ("data", "fsdp") if topo.size("data") > 1 else ("fsdp",)
                apply_fsdp(part, topo.mesh[dims], self._reshard_after_forward)
        if topo.size("data") > 1 and topo.size("fsdp") == 1:
            params = [p for part in parts for p in part.parameters() if p.requires_grad]
            averager = DataParallelGradients(params, self._collectives,
                                             automatic=runner is None)
            self._grad_averagers.append(averager)
            if runner is not None:
                runner.after_backward = averager.average
        self._record_replacements(module)

    def forward_backward(self, model: torch.nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of a pipelined ``model`` in one run of the schedule, the
        loss ``loss_fn(output, target)`` computed on the last stage per microbatch; returns
        the batch's loss (the mean over microbatches) on every rank of the pipeline.

        Use it inside ``strategy.run`` instead of ``loss = loss_fn(model(x), y);
        loss.backward()`` to skip the extra forward pass that the one-device shape costs
        (see :mod:`replicator.strategies.pipeline`); then step the optimizer as usual."""
        for runner in self._pipelines:
            if runner.model is model:
                return runner.forward_backward(inputs, target, loss_fn)
        return super().forward_backward(model, inputs, target, loss_fn)  # not pipelined

    def _broadcast_initial_state(self, module: torch.nn.Module) -> None:
        """Every rank starts from global rank 0's values (as Mirrored does), so the pieces cut
        from each rank's copy make up one model."""
        if self._topology.num_workers == 1:
            return
        tensors = [t for t in [*module.parameters(), *module.buffers()] if t.numel()]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                with self._collectives.guard("broadcast of initial parameters from rank 0"):
                    dist.broadcast(flat, src=0)  # every process is a worker here
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _record_replacements(self, module: torch.nn.Module) -> None:
        """Map each original parameter to the sharded one that took its place, so optimizers
        built inside ``scope()`` (before the sharding) step the new ones."""
        # FSDP2 and parallelize_module keep registration names: match by name
        after = dict(module.named_parameters())
        names = getattr(module, "_replicator_param_names", None)
        if names is None:
            return
        for name, old in names:
            new = after.get(name)
            if new is not None and new is not old:
                self._replaced[old] = new

    def _distribute_modules(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            if module not in self._set_up_modules:
                object.__setattr__(module, "_replicator_param_names",
                                   list(module.named_parameters()))
        super()._distribute_modules(modules)
        for module in modules:
            if hasattr(module, "_replicator_param_names"):
                object.__delattr__(module, "_replicator_param_names")

    def _remap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._checked:  # is it one of ours? (for memory_report)
            ours = any(p in self._replaced or Strategy.is_distributed(self, p)
                       for g in optimizer.param_groups for p in g["params"])
            self._checked[optimizer] = ours
            if ours:
                self._optimizers.add(optimizer)
        if not len(self._replaced):
            return
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                new = self._replaced.get(p)
                if new is not None:
                    params[i] = new
                    if p in optimizer.state:
                        optimizer.state[new] = optimizer.state.pop(p)

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        if super().is_distributed(tensor) or tensor in self._replaced:
            return True
        if self._topology.size("fsdp") > 1:  # FSDP2's gathered parameter while a block runs
            from replicator.strategies.fsdp import is_unsharded_view

            return any(is_unsharded_view(m, tensor) for m in self._set_up_modules.keys())
        return False

    # -- memory ------------------------------------------------------------------------------------
    def memory_report(self) -> Any:
        """Bytes this rank holds: parameters, gradients, optimizer state, peak activations."""
        from replicator.strategies.memory import build_memory_report

        modules = [m for m in self._set_up_modules.keys()]
        return build_memory_report(self, modules, list(self._optimizers),
                                   self._activation_peak)

    def memory_reports(self) -> list[Any]:
        """Every worker's :meth:`memory_report`, in rank order (a collective: all call it)."""
        from replicator.strategies.memory import MemoryReport

        mine = self.memory_report()
        values = torch.tensor([mine.rank, mine.parameter_bytes, mine.gradient_bytes,
                               mine.optimizer_state_bytes, mine.peak_activation_bytes],
                              dtype=torch.int64)
        out = torch.zeros(self._topology.num_workers * 5, dtype=torch.int64)
        with self._collectives.guard("memory report exchange"):
            dist.all_gather_into_tensor(out, values)  # every process is a worker here
        return [MemoryReport(*[int(v) for v in row]) for row in out.view(-1, 5).tolist()]

    def _run(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        from replicator.strategies.memory import ActivationMeter

        with ActivationMeter() as meter:
            out = fn(*args, **kwargs)
        self._activation_peak = max(self._activation_peak, meter.peak_bytes)
        return out

    # -- cross-replica values -------------------------------------------------------------------
    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        return self._collectives.all_reduce(tensor, op, f"reduce({op.value})")

    def _reduce_many(self, op: ReduceOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._collectives.all_reduce_many(tensors, op, f"reduce({op.value})")

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self._collectives.all_gather_uneven(tensor, axis, "gather")

    def barrier(self) -> None:
        with self._collectives.guard("barrier"):
            dist.barrier()

    def _close(self) -> None:
        self._optimizer_hook.remove()
        for averager in self._grad_averagers:
            averager.remove()
        self._grad_averagers = []
        self._tracker.close()
