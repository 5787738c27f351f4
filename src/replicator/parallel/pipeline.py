"""Pipeline parallelism: a model cut into stages on the ranks of a 1-D ``DeviceMesh``, run by a
``torch.distributed.pipelining`` schedule under the one-device step (docs/model_parallel.md):
``model(x)`` runs the stages forward without autograd, its backward runs the schedule with the
loss ``sum(output_i * dL/d(output_i))``. Each pass is one guarded operation on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from replicator.cluster.timeouts import resolve_timeout
from replicator.errors import ReplicatorError
from replicator.parallel.pipeline_split import (
    PipelineSplitError,
    Stage,
    TiedWeights,
    balanced_starts,
    build_stages,
    check_stage_count,
    flatten_chain,
    known_chain,
    known_loss,
    named_starts,
    parameter_costs,
)

#: Schedule name -> (torch class name, stages per rank by default, stage placement).
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}
BALANCE = ("params", "time")

#: ``guard(what)``: a context that counts ``what`` as one collective and turns a backend
#: timeout inside it into a ``ReplicaTimeoutError`` naming the rank (``Collectives.guard``).
Guard = Callable[[str], AbstractContextManager[Any]]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_HEADER = 10  # ints: ndim, dtype code, up to 8 sizes
_RUNNER_ATTR = "_replicator_pipeline_runner"


def _meta(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """An empty tensor like ``t`` that, like the schedule's own activations, requires grad
    when ``grad`` and ``t`` is floating point (the first stage's input does not)."""
    return torch.empty_like(t).requires_grad_(grad and t.is_floating_point())


def _header(t: torch.Tensor | None) -> torch.Tensor:
    """The shape and dtype of ``t`` as ``_HEADER`` ints (zeros to receive into: ``None``)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if t is not None:
        header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
        header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def _empty_for(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor of the shape and dtype ``header`` describes."""
    ndim, code = int(header[0]), int(header[1])
    return torch.empty(header[2:2 + ndim].tolist(), dtype=_DTYPES[code], device=device)


def check_pipeline_options(num_stages: int, num_microbatches: int, schedule: str,
                           balance: str = "params") -> str:
    """Validate the options of a pipeline before any model exists; returns the schedule's
    normalised name (``"1F1B"`` -> ``"1f1b"``, ``"zero-bubble"`` -> ``"zero_bubble"``)."""
    schedule = str(schedule).lower().replace("-", "_")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of "
                         f"{', '.join(SCHEDULES)}")
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {', '.join(BALANCE)}, got {balance!r}")
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    per_rank = SCHEDULES[schedule][1]
    if num_stages % per_rank:
        raise PipelineSplitError(
            f"schedule {schedule!r} places {per_rank} stages on each rank, so num_stages "
            f"must be a multiple of {per_rank}, got {num_stages}")
    if schedule != "gpipe" and num_microbatches < num_stages // per_rank:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many microbatches as pipeline ranks "
            f"({num_stages // per_rank}), got num_microbatches={num_microbatches}. HINT: use more "
            "microbatches (a bubble of (p-1)/(m+p-1) wants m well above p), or schedule='gpipe'.")
    return schedule


def check_rows(target: Any, x: torch.Tensor, what: str) -> None:
    """``target`` must be a tensor with one row per row of the batch ``x``."""
    if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != x.shape[0]:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{what} must be a tensor with one row per input row ({x.shape[0]}), "
                         f"got {got}. HINT: pass the labels of the same batch")


def pipeline_degree(num_stages: int, schedule: str) -> int:
    """How many ranks ``num_stages`` stages take under ``schedule`` (interleaved: 2 each)."""
    return num_stages // SCHEDULES[schedule][1]


class PipelineRunner:
    """Cuts one model into stages over the 1-D ``mesh``, keeps this rank's, and runs it (see the
    module doc); ``model``'s forward becomes :meth:`forward`. ``guard``: wraps every exchange
    (:data:`Guard`). ``after_backward``: called once this rank's gradients are in (tied ones
    summed); a data axis averages them there. ``timeout_seconds``: the tied weights' group's.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, device: torch.device, *,
                 guard: Guard, num_stages: int | None = None, num_microbatches: int = 4,
                 schedule: str = "1f1b", split_points: Sequence[str] | None = None,
                 balance: str = "params", timeout_seconds: float | None = None) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"PipelineRunner takes the 1-D mesh of the pipeline axis, got a "
                             f"{mesh.ndim}-D one. HINT: pass mesh['pipeline']")
        name = str(schedule).lower().replace("-", "_")
        num_stages = num_stages or mesh.size() * (SCHEDULES[name][1] if name in SCHEDULES else 1)
        schedule = check_pipeline_options(num_stages, num_microbatches, name, balance)
        self.model = model
        self.device = device
        self.group = mesh.get_group()
        self.me = mesh.get_local_rank()
        self.global_ranks = list(dist.get_process_group_ranks(self.group))
        self._guard = guard
        self._timeout_seconds = timeout_seconds
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        # the pipeline rank of each stage: round robin, or down and back ("v" placement)
        ranks, v = mesh.size(), SCHEDULES[schedule][2] == "v"
        self.owners = [(s if s < ranks else 2 * ranks - 1 - s) if v else s % ranks
                       for s in range(num_stages)]
        self.local_ids = [s for s, r in enumerate(self.owners) if r == self.me]
        self.after_backward: Callable[[], None] | None = None
        self.tied = TiedWeights([], [], self.global_ranks, self.me, {})
        known = None if isinstance(model, torch.nn.Sequential) else known_chain(model)
        # names for split points and messages: the chain's; parameters stay model's
        chain_module, wrap = known or (model, None)
        self._wrap_output: Any = wrap
        #: the model's own loss of (logits, labels), for ``model(input_ids=x, labels=y)``
        self._own_loss = known_loss(model) if known is not None else None
        self.chain = flatten_chain(chain_module)
        check_stage_count(self.chain, self.num_stages)
        self.stages: list[Stage] = []
        self._schedules: dict[tuple, Any] = {}
        # each local stage's microbatch input and output (shapes for the schedule's stages)
        self._metas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._metas_key: tuple | None = None
        if split_points:
            self._cut(named_starts(self.chain, list(split_points), self.num_stages))
        elif balance == "params":
            self._cut(balanced_starts(parameter_costs(self.chain), self.num_stages))
        object.__setattr__(model, "forward", self.forward)
        object.__setattr__(model, _RUNNER_ATTR, self)

    @staticmethod
    def of(model: torch.nn.Module) -> PipelineRunner | None:
        """The runner that cut ``model`` (``None`` for a model no pipeline cut)."""
        runner = getattr(model, _RUNNER_ATTR, None)
        return runner if isinstance(runner, PipelineRunner) else None

    def _cut(self, starts: Sequence[int]) -> None:
        self.stages = build_stages(self.chain, starts)
        mine = {id(t) for s in self.local_ids
                for t in [*self.stages[s].parameters(), *self.stages[s].buffers()]}
        with torch.no_grad():  # free what other ranks hold: the point of a pipeline
            for t in [*self.model.parameters(), *self.model.buffers()]:
                if id(t) not in mine:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        # tied weights: their groups made and copies made equal, in one guarded pass
        names: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self.tied = TiedWeights(self.stages, self.owners, self.global_ranks, self.me,
                                {k: " = ".join(v) for k, v in names.items()})
        if self.tied:
            timeout = resolve_timeout(self._timeout_seconds, group=self.group)
            with self._guard(self.tied.what("first broadcast")):
                self.tied.connect(timeout)

    def _measure_and_cut(self, x: torch.Tensor) -> None:
        """Balance by forward time on ``x``'s first microbatch (rank 0's: all ranks cut alike)."""
        times = []
        with torch.no_grad():
            act = torch.tensor_split(x, self.num_microbatches)[0]
            for _, block in self.chain:
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    out = block(act)
                    best = min(best, time.perf_counter() - start)
                times.append(best)
                act = out
        costs = torch.tensor(times, dtype=torch.float64)
        with self._guard("pipeline broadcast of block timings from rank 0"):
            dist.broadcast(costs, src=0)  # every worker: all pipelines cut alike
        self._cut(balanced_starts([max(c, 1e-9) for c in costs.tolist()], self.num_stages))

    @property
    def local_modules(self) -> list[torch.nn.Module]:
        """This rank's stages (before the first call when balancing by time: none yet)."""
        return [self.stages[s] for s in self.local_ids] if self.stages else []

    def describe(self) -> str:
        stages = "; ".join(f"stage {s} (rank {self.owners[s]}): {', '.join(st.block_names)}"
                           for s, st in enumerate(self.stages))
        return f"{stages}; tied: {self.tied.describe()}" if self.tied else stages

    def _what(self, doing: str) -> str:
        """A pass's name for errors: what this rank was doing, its stages and neighbours."""
        me = self.global_ranks[self.me]
        stages = ", ".join(str(s) for s in self.local_ids)
        peers = sorted({self.global_ranks[r] for r in self.owners} - {me})
        return (f"pipeline {doing} (stage {stages} of {self.num_stages} on rank {me}; "
                f"exchanging with rank {', '.join(str(p) for p in peers)})")

    # -- point to point (always inside a guarded pass) --------------------------------------------
    def _send(self, t: torch.Tensor, to: int) -> None:
        dist.send(_header(t), group=self.group, group_dst=to)
        dist.send(t.contiguous(), group=self.group, group_dst=to)

    def _recv(self, frm: int) -> torch.Tensor:
        header = _header(None)
        dist.recv(header, group=self.group, group_src=frm)
        t = _empty_for(header, self.device)
        dist.recv(t, group=self.group, group_src=frm)
        return t

    def _broadcast(self, t: torch.Tensor | None, src: int) -> torch.Tensor:
        header = _header(t if self.me == src else None)
        dist.broadcast(header, group=self.group, group_src=src)
        if self.me != src:
            t = _empty_for(header, self.device)
        assert t is not None
        dist.broadcast(t, group=self.group, group_src=src)
        return t

    def _prepare(self, x: Any) -> torch.Tensor:
        """``x`` checked, and the model cut (at the first batch when balancing by time)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"a pipelined model takes one tensor (the batch), got "
                            f"{type(x).__name__}. HINT: pack several inputs into the first "
                            "stage's own module")
        if x.dim() == 0 or x.shape[0] % self.num_microbatches:
            n = x.shape[0] if x.dim() else 0
            raise ValueError(
                f"the per-replica batch of {n} rows does not divide into "
                f"{self.num_microbatches} microbatches. HINT: use a per-replica batch that is a "
                f"multiple of {self.num_microbatches} (drop_remainder=True drops a short last "
                "batch), or change num_microbatches.")
        if not self.stages:
            self._measure_and_cut(x)
        return x

    def _value_pass(self, x: torch.Tensor, everywhere: bool = True) -> torch.Tensor | None:
        """Forward without autograd, microbatch by microbatch; every rank gets the output
        (``everywhere=False``: the last stage's rank only, ``None`` on the others)."""
        last = self.owners[-1]
        outs = []
        what = self._what(f"forward pass of {self.num_microbatches} microbatches")
        with self._guard(what), torch.no_grad():
            for mb in torch.tensor_split(x, self.num_microbatches):
                act: torch.Tensor | None = mb
                for s in range(self.num_stages):
                    if self.owners[s] != self.me:
                        continue
                    if s > 0 and self.owners[s - 1] != self.me:
                        act = self._recv(self.owners[s - 1])
                    assert act is not None
                    stage_input = act
                    act = self.stages[s](act)
                    self._metas[s] = (_meta(stage_input, grad=s > 0), _meta(act, grad=True))
                    self._metas_key = (tuple(x.shape), x.dtype)
                    if s < self.num_stages - 1 and self.owners[s + 1] != self.me:
                        self._send(act, self.owners[s + 1])
                if self.me == last:
                    assert act is not None
                    outs.append(act)
            out = torch.cat(outs) if self.me == last else None
            return self._broadcast(out, last) if everywhere else out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward under the pipeline: one tensor, positionally or as ``input_ids``; a
        known layout with its own loss also takes ``labels=`` (:meth:`_forward_labelled`)."""
        labels = kwargs.pop("labels", None) if self._own_loss is not None else None
        if len(args) + len(kwargs) != 1 or (kwargs and "input_ids" not in kwargs):
            given = ", ".join([*(type(a).__name__ for a in args), *kwargs])
            also = "" if self._own_loss is None else " and labels="
            raise TypeError(f"a pipelined model takes one tensor (the batch){also}, got "
                            f"({given}). HINT: pack other inputs into the first stage's "
                            "module, or leave out options the chain does not need (attention "
                            "masks, caches).")
        x = args[0] if args else kwargs["input_ids"]
        if labels is not None:
            loss, logits = self._forward_labelled(x, labels)
            assert self._wrap_output is not None  # a model with its own loss is a known one
            return self._wrap_output(logits, loss=loss)
        out = self._forward(x)
        return self._wrap_output(out) if self._wrap_output is not None else out

    def _forward(self, x: Any) -> torch.Tensor:
        x = self._prepare(x)
        rng = torch.get_rng_state()
        out = self._value_pass(x)
        assert out is not None
        if not torch.is_grad_enabled():
            return out
        out = out.detach().requires_grad_(True)
        self._schedule_on_backward(out, x, rng, lambda grad: grad)
        return out

    def _schedule_on_backward(self, leaf: torch.Tensor, x: torch.Tensor, rng: torch.Tensor,
                              target: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Run the schedule when ``leaf``'s gradient arrives, the last stage's target being
        ``target(grad)``, with the random state ``rng`` of the value pass (same dropout)."""
        after = torch.get_rng_state()

        def backward(grad: torch.Tensor) -> None:
            torch.set_rng_state(rng)
            try:
                self._run_schedule(x, target(grad))
            finally:
                torch.set_rng_state(after)
            if self.after_backward is not None:
                self.after_backward()

        leaf.register_hook(backward)

    def _forward_labelled(self, x: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model(input_ids=x, labels=labels)``: the last stage computes the model's own loss and
        ``dL/d(logits)``; only the loss is broadcast, requiring grad, and its backward runs the
        schedule with ``dL/d(logits)`` times the incoming gradient as the target (logits: on the
        last stage only)."""
        x = self._prepare(x)
        check_rows(labels, x, "labels")
        rng = torch.get_rng_state()
        logits = self._value_pass(x, everywhere=False)
        grad_enabled = torch.is_grad_enabled()
        loss = d_logits = None
        if logits is not None:
            assert self._own_loss is not None
            with torch.enable_grad():
                leaf = logits.detach().requires_grad_(grad_enabled)
                loss = self._own_loss(leaf, labels.to(self.device))
                if grad_enabled:
                    (d_logits,) = torch.autograd.grad(loss, leaf)
            loss = loss.detach()
        with self._guard(self._what("broadcast of the loss from the last stage")):
            loss = self._broadcast(loss, self.owners[-1])
        if grad_enabled:
            loss = loss.requires_grad_(True)
            self._schedule_on_backward(loss, x, rng, lambda grad: None if d_logits is None
                                       else d_logits * grad)
        return loss, logits

    def forward_backward(self, x: Any, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
        """One schedule run, each microbatch's loss ``loss_fn(output, target)`` on the last stage;
        gradients of their mean, which is returned (detached) on every pipeline rank."""
        x = self._prepare(x)
        check_rows(target, x, "forward_backward: the target")
        key = (tuple(x.shape), x.dtype)
        if self._metas_key != key:
            # the schedule's stages need each stage's shapes: one pass without autograd
            # measures them, with the random-number state put back (no dropout mask consumed)
            rng = torch.get_rng_state()
            self._value_pass(x)
            torch.set_rng_state(rng)
        m = self.num_microbatches
        sched = self._schedule_for(x, lambda output, tgt: loss_fn(output, tgt) / m,
                                   key=(*key, "loss", id(loss_fn)))
        losses: list[torch.Tensor] = []
        self._step(sched, x, {"target": target.to(self.device), "losses": losses},
                   "forward and backward")
        if self.after_backward is not None:
            self.after_backward()
        mine = torch.stack([loss.detach() for loss in losses]).sum() if losses else None
        with self._guard(self._what("broadcast of the loss from the last stage")):
            return self._broadcast(mine, self.owners[-1])

    def _schedule_for(self, x: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      key: tuple | None = None) -> Any:
        key = key or (tuple(x.shape), x.dtype)
        if key not in self._schedules:
            # imported here: it imports torch._dynamo, about a second every process would pay
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining import schedules as torch_schedules

            cls = getattr(torch_schedules, SCHEDULES[self.schedule_name][0], None)
            if cls is None:
                raise ReplicatorError(f"this torch has no {SCHEDULES[self.schedule_name][0]} "
                                      f"(schedule {self.schedule_name!r}). HINT: use 'gpipe' "
                                      "or '1f1b'.")
            # shapes from the value pass: no shape-inference forward (docs/model_parallel.md)
            stages = [PipelineStage(self.stages[s], s, self.num_stages, self.device,
                                    input_args=self._metas[s][0], output_args=self._metas[s][1],
                                    group=self.group) for s in self.local_ids]
            loss_fn = loss_fn or (lambda output, grad: (output * grad).sum())
            one_per_rank = SCHEDULES[self.schedule_name][1] == 1  # these take one stage
            sched = cls(stages[0] if one_per_rank else stages, self.num_microbatches,
                        loss_fn=loss_fn, scale_grads=False)
            self._schedules = {key: sched}  # one shape at a time: a new one replaces it
        return self._schedules[key]

    def _run_schedule(self, x: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The backward pass: ``grad`` is ``dL/d(output)``, needed by the last stage only."""
        assert grad is not None or self.num_stages - 1 not in self.local_ids
        self._step(self._schedule_for(x), x,
                   {"target": grad.detach()} if grad is not None else {}, "backward")

    def _step(self, sched: Any, x: torch.Tensor, last_stage: dict[str, Any], doing: str) -> None:
        """One run of the schedule (``x`` for the first stage, ``last_stage``'s arguments for the
        last); torch's sends and receives inside make the whole step one guarded operation."""
        args = (x,) if 0 in self.local_ids else ()
        kwargs = last_stage if self.num_stages - 1 in self.local_ids else {}
        what = self._what(f"{self.schedule_name} schedule step ({doing} of "
                          f"{self.num_microbatches} microbatches)")
        kept = self.tied.set_aside()  # tied weights: this run's gradients alone, then summed
        try:
            with self._guard(what), torch.enable_grad():
                sched.step(*args, **kwargs)
        except BaseException:
            self.tied.put_back(kept)
            raise
        if self.tied:
            with self._guard(self.tied.what("sum of the gradients")):
                self.tied.sum_gradients(kept)

    def full_state_dict(self, dst: int = 0) -> dict[str, Any]:
        """The model's state dict with full tensors on pipeline rank ``dst`` (``{}`` elsewhere; all
        pipeline ranks call it), a tied weight under each name: loads into the one-device model."""
        if not self.stages:
            raise ReplicatorError("full_state_dict: the pipeline is cut at its first batch "
                                  "(balance='time'); call it after a step")
        holder: dict[int, int] = {}
        for s, stage in enumerate(self.stages):
            for t in [*stage.parameters(), *stage.buffers()]:
                holder[id(t)] = min(holder.get(id(t), self.owners[s]), self.owners[s])
        out: dict[str, Any] = {}
        done: dict[int, torch.Tensor] = {}  # by id: a tied weight's second name is skipped
        with self._guard(self._what(f"gather of the full state dict on rank "
                                    f"{self.global_ranks[dst]}")):
            for name, t in self.model.state_dict(keep_vars=True).items():
                src = holder.get(id(t)) if isinstance(t, torch.Tensor) else None
                if src is None:  # not a tensor, or one no stage uses: as the model holds it
                    if self.me == dst:
                        out[name] = t.detach() if isinstance(t, torch.Tensor) else t
                    continue
                if id(t) not in done and self.me == src:
                    done[id(t)] = t.detach()
                    if src != dst:
                        self._send(done[id(t)], dst)
                elif id(t) not in done and self.me == dst:
                    done[id(t)] = self._recv(src)
                if self.me == dst:
                    out[name] = done[id(t)]
        return out
