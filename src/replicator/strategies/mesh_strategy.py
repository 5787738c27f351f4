"""MeshStrategy: data, fully sharded, pipeline and tensor parallelism composed on one mesh,
torchtitan's way (docs/strategies/mesh.md): at scope exit each axis of the ``Topology`` applies
its function to the model, innermost first. ``FSDPStrategy``, ``TensorParallelStrategy`` and
``PipelineStrategy`` are this class with one axis (plus ``data`` for processes left).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from replicator.checkpoint.serialization import placeholder
from replicator.cluster.devices import default_device_for
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.process_group import initialize
from replicator.cluster.timeouts import set_group_timeout
from replicator.cluster.topology import Topology
from replicator.comm.collectives import Collectives
from replicator.comm.gradient_sync import GradientSynchronizer
from replicator.comm.options import CommunicationOptions
from replicator.comm.selection import algorithm_for
from replicator.errors import ClusterConfigError
from replicator.parallel.fsdp import apply_fsdp, is_unsharded_view
from replicator.parallel.pipeline import PipelineRunner, check_pipeline_options, pipeline_degree
from replicator.parallel.tensor_parallel import apply_tensor_parallel, validate_plan
from replicator.strategies.base import Strategy
from replicator.strategies.live.settings import LiveSettings
from replicator.strategies.replicas import ReplicaGroup

#: Axis combinations tested to equal one device; others are refused with a clear error.
SUPPORTED = (
    frozenset({"data"}), frozenset({"fsdp"}), frozenset({"tensor"}), frozenset({"pipeline"}),
    frozenset({"data", "fsdp"}), frozenset({"data", "tensor"}), frozenset({"fsdp", "tensor"}),
    frozenset({"data", "pipeline"}),
)


class MeshStrategy(Strategy):
    """Compose parallelisms on a 2-D (or larger) mesh: ``MeshStrategy(data=2, tensor=2)``.
    Degrees ``data``, ``fsdp``, ``pipeline``, ``tensor`` multiply to the processes (``-1``
    infers one); ``tensor_plan``, ``pipeline`` (options dict), ``reshard_after_forward`` and
    ``check_finite`` as the presets' and ``Strategy``'s.
    """

    name = "mesh"
    _guards_undistributed = True

    def __init__(self, *, data: int = 1, fsdp: int = 1, pipeline: int = 1, tensor: int = 1,
                 tensor_plan: Mapping[str, Any] | None = None,
                 pipeline_options: Mapping[str, Any] | None = None,
                 reshard_after_forward: bool = True,
                 timeout_seconds: float | None = None, check_finite: bool = False) -> None:
        # mesh order, outermost first (torchtitan's): pipeline stages talk least, tensor shards
        # most, so tensor-parallel ranks are neighbours (the same host)
        degrees = {"pipeline": pipeline, "data": data, "fsdp": fsdp, "tensor": tensor}
        axes = {a: n for a, n in degrees.items() if n != 1} or {"data": 1}
        spec = resolve_cluster()
        device = default_device_for(spec.local_rank, spec.local_world_size)
        initialize(timeout_seconds=timeout_seconds, device=device)
        topo = self._topology = Topology(axes)
        used = frozenset(a for a, n in topo.axes.items() if n > 1) or frozenset({"data"})
        if used not in SUPPORTED:
            shape = " x ".join(f"{a}={n}" for a, n in topo.axes.items())
            raise ClusterConfigError(
                f"MeshStrategy({shape}) composes axes that are not supported yet. HINT: "
                "supported compositions: data x pipeline, data x tensor, fsdp x tensor, data x "
                "fsdp, and each axis alone.")
        self._tensor_plan = dict(tensor_plan) if tensor_plan is not None else None
        self._pipeline_options = dict(pipeline_options or {})
        self._reshard_after_forward = reshard_after_forward
        #: Sequence-parallel norms in the default tensor plan (TensorParallelStrategy's option).
        self._sequence_parallel = False
        # the replicas (the data axes together): identity, reduce, gather, gradient averaging;
        # several ranks share replica 0 when the model is split, so global rank 0 is the chief
        self._replica_group = ReplicaGroup(device, topo, timeout_seconds=timeout_seconds,
                                           chief=topo.is_chief)
        # the data axes' collectives through shared memory on one CPU host, as Mirrored's
        # (docs/collectives.md); FSDP's and tensor parallel's stay on gloo
        self._replica_group.use_algorithm(algorithm_for(
            CommunicationOptions(timeout_seconds=timeout_seconds), device,
            self._replica_group.group))
        # every worker: the initial broadcast, barrier and memory reports
        self._job = ReplicaGroup(device, timeout_seconds=timeout_seconds)
        # the pipeline's stages: their exchanges are guarded by a tracker of the stage ranks
        self._stages = ReplicaGroup(device, topo, "pipeline", timeout_seconds=timeout_seconds) \
            if topo.size("pipeline") > 1 else None
        for axis in topo.axes:  # tensor and fsdp groups wait no longer than the job either
            set_group_timeout(topo.group(axis), self.collectives.timeout_seconds)
        # parameters replaced by sharded ones (old -> new), for optimizers built in scope
        self._replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._pipelines: list[PipelineRunner] = []  # per set-up module
        self._no_sync_depth = 0
        super().__init__(check_finite=check_finite)

    # -- identity ------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        """The mesh this strategy works on (axes, groups, this rank's coordinates)."""
        return self._topology

    mesh = topology

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
        # every rank starts from global rank 0's values, so the pieces cut from each rank's
        # copy make up one model
        self._job.collectives.broadcast_(
            [t for t in [*module.parameters(), *module.buffers()] if t.numel()], src=0,
            what="broadcast of initial parameters from rank 0")
        runner = None
        if topo.size("pipeline") > 1:
            assert self._stages is not None  # opened with the pipeline axis
            runner = PipelineRunner(module, topo.mesh["pipeline"], self.device,
                                    guard=self._stages.collectives.guard,
                                    **self._pipeline_options)
            self._pipelines.append(runner)
            mark_stage_placeholders(module, runner)
            parts = runner.local_modules
        else:
            parts = [module]
        for part in parts:
            if topo.size("tensor") > 1:
                apply_tensor_parallel(part, topo.mesh["tensor"], self._tensor_plan,
                                      sequence_parallel=self._sequence_parallel)
            if topo.size("fsdp") > 1:
                dims = ("data", "fsdp") if topo.size("data") > 1 else ("fsdp",)
                apply_fsdp(part, topo.mesh[dims], self._reshard_after_forward)
        if topo.size("data") > 1 and topo.size("fsdp") == 1:  # FSDP averages its own
            if runner is None:
                _average_gradients(self._replica_group, module, parts, automatic=True)
            else:
                runner.after_backward = _after_schedule(self._replica_group, module, runner)

    def forward_backward(self, model: torch.nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of a pipelined ``model`` in one schedule run, the loss computed on
        the last stage per microbatch; returns the batch's loss on every pipeline rank. Use it in
        ``strategy.run`` instead of ``loss_fn(model(x), y).backward()`` to skip the extra forward
        pass (:mod:`replicator.parallel.pipeline`)."""
        for runner in self._pipelines:
            if runner.model is model:
                return runner.forward_backward(inputs, target, loss_fn)
        return super().forward_backward(model, inputs, target, loss_fn)  # not pipelined

    def _full_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Pipeline stages gathered on the chief's pipeline's first rank (the other pipelines
        skip the work), tensor and FSDP shards by ``full_tensor()`` on every rank."""
        if not self.shards_model:
            return super()._full_state_dict(model)
        for runner in self._pipelines:
            if runner.model is model:
                if self.replica_id != 0:
                    return {}
                state = runner.full_state_dict(dst=0)  # every rank of the pipeline calls it
                return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                        else v for k, v in state.items()} if self.is_chief else {}
        return gathered_state_dict(model, self.is_chief)

    def _distribute_modules(self, modules: list[torch.nn.Module]) -> None:
        """Set ``modules`` up, then map each original parameter to the sharded one that took its
        place (by name), so optimizers built inside ``scope()`` step the new ones."""
        named = [(m, list(m.named_parameters())) for m in modules
                 if m not in self._set_up_modules]
        super()._distribute_modules(modules)
        for module, before in named:
            after = dict(module.named_parameters())
            for name, old in before:
                new = after.get(name)
                if new is not None and new is not old:
                    self._replaced[old] = new

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at the sharded parameters that replaced its own, with their state."""
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
        return super().is_distributed(tensor) or tensor in self._replaced or (
            self._topology.size("fsdp") > 1  # FSDP2's gathered parameter while a block runs
            and any(is_unsharded_view(m, tensor) for m in self._set_up_modules.keys()))

    # -- memory ------------------------------------------------------------------------------------
    #: Pipeline schedules make steps differ: activations are measured in every run.
    _activation_samples = None

    @property
    def _report_collectives(self) -> Collectives:
        """Memory reports come from every worker, not only the replicas."""
        return self._job.collectives

    # -- synchronising ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (the data axis's and FSDP's sync off)."""
        # the roots FSDP2 sharded (the setting applies to every block)
        sharded = [m for m in self._set_up_modules.keys()
                   if callable(getattr(m, "set_requires_gradient_sync", None))] \
            if self._no_sync_depth == 0 and self._topology.size("fsdp") > 1 else []
        for m in sharded:
            m.set_requires_gradient_sync(False)  # type: ignore[operator]
        self._no_sync_depth += 1
        try:
            with super().no_sync():
                yield
        finally:
            self._no_sync_depth -= 1
            for m in sharded:
                m.set_requires_gradient_sync(True)  # type: ignore[operator]

    def barrier(self) -> None:
        """Wait until every worker (every rank of the mesh, not only the replicas) is here."""
        self._job.collectives.barrier()

    def _close(self) -> None:
        self._job.close()
        if self._stages is not None:
            self._stages.close()


def _average_gradients(replicas: ReplicaGroup, module: torch.nn.Module,
                       parts: list[torch.nn.Module], *, automatic: bool
                       ) -> GradientSynchronizer | None:
    """Average ``parts``' gradients (a DTensor's local shard) and buffers over ``replicas``."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    buffers = [b for part in parts for b in part.buffers()]
    return replicas.synchronize_gradients(module, params, buffers, automatic=automatic)


def _after_schedule(replicas: ReplicaGroup, module: torch.nn.Module,
                    runner: PipelineRunner) -> Callable[[], None]:
    """The pipeline's ``after_backward``: average this rank's stages' gradients over the
    replicas after the schedule's backward passes (built at the first call for stages
    balanced by time, cut at the first batch)."""
    made: list[GradientSynchronizer | None] = [
        _average_gradients(replicas, module, runner.local_modules, automatic=False)
    ] if runner.local_modules else []

    def average() -> None:
        if not made:
            made.append(_average_gradients(replicas, module, runner.local_modules,
                                           automatic=False))
        if made[0] is not None:
            made[0].synchronize()

    return average


# -- full state dicts of split models ------------------------------------------------------------
def gathered_state_dict(model: torch.nn.Module, keep: bool) -> dict[str, Any]:
    """Full tensors of a model whose parameters may be DTensors (tensor-parallel or FSDP
    shards): each DTensor's ``full_tensor()`` in turn (a collective over its mesh: every
    rank calls this), kept on the CPU where ``keep`` (the chief), dropped elsewhere."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if keep:
                out[key] = full.detach().to("cpu", copy=True)
            del full
        elif keep:
            out[key] = value
    return out


def mark_stage_placeholders(model: torch.nn.Module, runner: PipelineRunner) -> None:
    """Make this rank's ``model.state_dict()`` (also inside a parent's) hold a ``Placeholder``,
    which the library's save paths refuse, for every tensor of other ranks' stages;
    ``keep_vars=True`` keeps the tensors (for the gather)."""
    ref = weakref.ref(runner)

    def hook(module: torch.nn.Module, state: dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        pipeline = ref()
        if pipeline is None or not pipeline.stages:
            return  # cut at the first batch: nothing is freed yet
        held = {id(t) for m in pipeline.local_modules
                for t in [*m.parameters(), *m.buffers()]}
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            value = state.get(prefix + name)
            if (isinstance(value, torch.Tensor) and value is not t and id(t) not in held
                    and value.numel() == 0):
                state[prefix + name] = placeholder(value)

    model.register_state_dict_post_hook(hook)


class FSDPStrategy(MeshStrategy):
    """Fully sharded data parallelism on every process (FSDP2 ``fully_shard`` per block).
    ``reshard_after_forward=True`` (ZeRO-3, least memory) or ``False`` (ZeRO-2, one gather fewer),
    also as ``zero_stage=3|2``; ``tensor``: add a tensor-parallel axis (``tensor_plan``).
    """

    name = "fsdp"
    #: Sharded inside a replica group, replicated across groups (HSDP) when the job runs
    #: replica groups (without a tensor axis: every rank of a group is then a data replica).
    _supports_live = True

    def __init__(self, reshard_after_forward: bool | None = None, *,
                 zero_stage: int | None = None, tensor: int = 1,
                 tensor_plan: dict[str, Any] | None = None,
                 timeout_seconds: float | None = None, check_finite: bool = False) -> None:
        if zero_stage is not None:
            if zero_stage not in (2, 3):
                raise ValueError(
                    f"zero_stage must be 2 or 3, got {zero_stage!r}. HINT: FSDP always shards "
                    "gradients and optimizer state (stage 2); stage 3 also frees parameters "
                    "after forward. For stage 1 (sharded optimizer state only) use "
                    "rp.MirroredStrategy, whose memory is then dominated by parameters anyway.")
            if reshard_after_forward is not None and reshard_after_forward != (zero_stage == 3):
                raise ValueError(f"zero_stage={zero_stage} contradicts reshard_after_forward="
                                 f"{reshard_after_forward}. HINT: give only one of them.")
            reshard_after_forward = zero_stage == 3
        validate_plan(tensor_plan)
        if tensor != 1 and LiveSettings.from_env() is not None:
            raise ClusterConfigError(
                "FSDPStrategy(tensor=...) cannot run in replica groups yet: the ranks of a "
                "tensor axis share their samples. HINT: FSDPStrategy() without tensor=, or "
                "launch without --replica-groups")
        super().__init__(fsdp=-1, tensor=tensor, tensor_plan=tensor_plan,
                         reshard_after_forward=True if reshard_after_forward is None
                         else bool(reshard_after_forward),
                         timeout_seconds=timeout_seconds, check_finite=check_finite)


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism on every process (or ``tensor`` of them, the rest data parallel).
    ``plan``: module name or pattern -> ``"colwise"``, ``"rowwise"``, ``"embedding"`` or a
    ``ParallelStyle`` (``None``: ``default_plan``); ``sequence_parallel``: see
    :mod:`replicator.parallel.tensor_parallel`. ``num_replicas_in_sync`` counts data replicas.
    """

    name = "tensor_parallel"

    def __init__(self, plan: Mapping[str, Any] | None = None, *, tensor: int = -1,
                 sequence_parallel: bool = False,
                 timeout_seconds: float | None = None, check_finite: bool = False) -> None:
        validate_plan(plan, sequence_parallel)
        data = 1 if tensor == -1 else -1
        super().__init__(data=data, tensor=tensor, tensor_plan=plan,
                         timeout_seconds=timeout_seconds, check_finite=check_finite)
        self._sequence_parallel = bool(sequence_parallel)


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism: ``num_stages`` stages fed ``num_microbatches`` microbatches;
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` or ``"zbv"``
    (two stages per rank for the interleaved). An ``nn.Sequential`` is cut by parameters, by
    measured time (``balance="time"``) or at ``split_points``; processes left are data replicas.
    """

    name = "pipeline"

    def __init__(self, num_stages: int = 2, num_microbatches: int = 4,
                 schedule: str = "1f1b", *, split_points: Sequence[str] | None = None,
                 balance: str = "params", timeout_seconds: float | None = None,
                 check_finite: bool = False) -> None:
        schedule = check_pipeline_options(num_stages, num_microbatches, schedule, balance)
        super().__init__(pipeline=pipeline_degree(num_stages, schedule), data=-1,
                         pipeline_options={
                             "num_stages": num_stages, "num_microbatches": num_microbatches,
                             "schedule": schedule, "split_points": split_points,
                             "balance": balance},
                         timeout_seconds=timeout_seconds, check_finite=check_finite)

    def describe_stages(self) -> str:
        """Which blocks each stage holds, and on which pipeline rank."""
        return " | ".join(r.describe() for r in self._pipelines)
