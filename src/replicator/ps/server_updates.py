"""How a parameter server applies updates: as they arrive, under bounded staleness, in
synchronous rounds averaging every live worker, or a coordinator's at most once. An update is
checked whole before any shard changes. Sparse tables' rows are updated as one device with
``sparse=True`` would (torch's sparse gradients; lazy Adam as ``SparseAdam``; plain SGD as one
vectorised add), and dense shards whose optimizers agree share one ``step()``."""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator.ps import protocol as P
from replicator.ps.claims import ClaimLedger
from replicator.ps.messages import Message

_LAZY_ADAM = ("Adam", "AdamW", "SparseAdam")
_ROW_WISE = ("SGD", "Adagrad", *_LAZY_ADAM)


def build_shard_optimizer(spec: dict[str, Any], param: torch.nn.Parameter, group: int,
                          sparse: bool) -> torch.optim.Optimizer:
    """The optimizer of one shard: ``spec``'s class, or for a sparse table its row-wise form."""
    if not sparse:
        return P.build_optimizer(spec, param, group)
    name = str(spec["class"])
    hyper = dict(spec["groups"][group])
    if name not in _ROW_WISE:
        raise P.ParameterServerError(
            f"torch.optim.{name} cannot update the rows of a sparse embedding table. HINT: use "
            "SGD, Adagrad, Adam (applied lazily, as SparseAdam) or SparseAdam for tables built "
            "with sparse=True, or build the embedding with sparse=False (it then travels whole).")
    if float(hyper.get("weight_decay", 0) or 0) != 0.0:
        raise P.ParameterServerError(
            f"{name}(weight_decay={hyper['weight_decay']}) cannot update a sparse embedding "
            "table row-wise (torch refuses weight decay with sparse gradients). HINT: give "
            "the table its own optimizer without weight decay.")
    if name in _LAZY_ADAM:
        if hyper.get("amsgrad"):
            raise P.ParameterServerError("Adam(amsgrad=True) has no lazy, row-wise form for a "
                                         "sparse embedding table. HINT: use amsgrad=False.")
        betas = hyper.get("betas", (0.9, 0.999))
        return torch.optim.SparseAdam([param], lr=hyper.get("lr", 1e-3),
                                      betas=(float(betas[0]), float(betas[1])),
                                      eps=hyper.get("eps", 1e-8),
                                      maximize=bool(hyper.get("maximize", False)))
    return P.build_optimizer(spec, param, group)


def check_gradient_rows(rows: torch.Tensor, values: torch.Tensor, param: torch.Tensor) -> None:
    """Refuse a sparse gradient whose rows are not sorted, distinct shard rows matching
    ``values`` (a worker sends them coalesced)."""
    if rows.dim() != 1 or rows.numel() != values.shape[0] or \
            tuple(values.shape[1:]) != tuple(param.shape[1:]):
        raise P.ParameterServerError(f"sparse gradient of {rows.numel()} rows with values of "
                                     f"shape {tuple(values.shape)} does not fit a shard of "
                                     f"shape {tuple(param.shape)}")
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise P.ParameterServerError("sparse gradient rows are not sorted and distinct "
                                     "(a worker sends them coalesced)")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= param.shape[0]):
        raise P.ParameterServerError(f"sparse gradient rows outside a shard of "
                                     f"{param.shape[0]} rows")


def sparse_gradient(rows: torch.Tensor, values: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Torch's sparse gradient of ``param`` holding ``values`` at ``rows`` (shard-local)."""
    check_gradient_rows(rows, values, param)
    return torch.sparse_coo_tensor(rows.reshape(1, -1), values.to(param.dtype),
                                   tuple(param.shape), is_coalesced=True,
                                   check_invariants=False)  # checked above


def _one_group_no_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return len(optimizer.param_groups) == 1 and not optimizer._optimizer_step_pre_hooks \
        and not optimizer._optimizer_step_post_hooks


def plain_sgd_alpha(optimizer: torch.optim.Optimizer) -> float | None:
    """``-lr`` (``+lr`` with ``maximize``) for torch's plain ``SGD`` (no momentum, weight decay,
    hooks or fused kernel), whose sparse step is ``param.add_(grad, alpha=-lr)``; else None."""
    if type(optimizer) is not torch.optim.SGD or not _one_group_no_hooks(optimizer):
        return None
    group = optimizer.param_groups[0]
    if group.get("momentum") or group.get("weight_decay") or group.get("fused") or \
            group.get("differentiable"):
        return None
    lr = float(group["lr"])
    return lr if group.get("maximize") else -lr


def add_to_rows(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                alpha: float) -> None:
    """``param[rows] += alpha * values`` for sorted, distinct ``rows`` in one vectorised add
    (torch's sparse add gives the same numbers row by row, slower)."""
    with torch.no_grad():
        data = param.detach()
        updated = data.index_select(0, rows)
        updated.add_(values.to(data.dtype), alpha=alpha)
        data.index_copy_(0, rows, updated)


class TaskLedger:
    """The (task, push) pairs applied on one server, and how many repeats it turned away."""

    def __init__(self) -> None:
        self.applied: set[tuple[int, int]] = set()
        self.repeats = 0

    def seen(self, task: int, push: int) -> bool:
        """True when this update was applied already (nothing is recorded)."""
        return (task, push) in self.applied

    def first(self, task: int, push: int) -> bool:
        """True the first time (the update is to be applied), False for a repeat."""
        key = (task, push)
        if key in self.applied:
            self.repeats += 1
            return False
        self.applied.add(key)
        return True

    def summary(self) -> dict[str, int]:
        return {"applied": len(self.applied), "repeats": self.repeats}

    def state(self) -> list[list[int]]:
        return sorted([t, p] for t, p in self.applied)

    def load(self, state: list[list[int]]) -> None:
        self.applied = {(int(t), int(p)) for t, p in state}


#: ``torch.optim`` classes whose ``step()`` updates each parameter from its own gradient and
#: state alone (so stepping several parameters together equals stepping each alone).
PER_PARAMETER = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD",
                           "NAdam", "RAdam", "RMSprop", "Rprop"})


def _signature(optimizer: torch.optim.Optimizer) -> Hashable | None:
    """What must agree for two optimizers to share a step; ``None``: step it alone."""
    cls = type(optimizer)
    if cls.__name__ not in PER_PARAMETER or getattr(torch.optim, cls.__name__, None) is not cls \
            or not _one_group_no_hooks(optimizer):
        return None
    group = optimizer.param_groups[0]
    params = group["params"]
    if any(p.grad is None or p.grad.is_sparse for p in params):
        return None
    hyper = tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
    devices = tuple(sorted({(str(p.device), str(p.dtype)) for p in params}))
    return cls, hyper, devices


class SharedSteps:
    """Steps lists of per-shard optimizers, sharing one step among those that agree."""

    def __init__(self) -> None:
        self._steppers: dict[tuple[int, ...], torch.optim.Optimizer] = {}

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``step()`` every optimizer once (each appears at most once)."""
        groups: dict[Hashable, list[torch.optim.Optimizer]] = defaultdict(list)
        alone: list[torch.optim.Optimizer] = []
        for opt in optimizers:
            key = _signature(opt)
            (alone.append(opt) if key is None else groups[key].append(opt))
        for opts in groups.values():
            if len(opts) == 1:
                alone.extend(opts)
            else:
                self._stepper(opts).step()
        for opt in alone:
            opt.step()

    def _stepper(self, opts: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        key = tuple(id(o) for o in opts)
        stepper = self._steppers.get(key)
        owners = [(p, o) for o in opts for p in o.param_groups[0]["params"]]
        if stepper is None or any(stepper.state[p] is not o.state[p] for p, o in owners):
            if len(self._steppers) > 64:  # shards re-registered or optimizers rebuilt often
                self._steppers.clear()
            stepper = copy.copy(opts[0])
            state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            state.update((p, o.state[p]) for p, o in owners)  # each shard's own dict
            stepper.state = state
            stepper.param_groups = [dict(opts[0].param_groups[0], params=[p for p, _ in owners])]
            self._steppers[key] = stepper
        else:  # hyperparameters may have changed (a learning-rate schedule): all agree
            stepper.param_groups[0].update({k: v for k, v in opts[0].param_groups[0].items()
                                            if k != "params"})
        return stepper


#: A gradient as received: (version pulled, values, shard-local rows for a sparse one).
Grad = tuple[int, "torch.Tensor | None", "torch.Tensor | None"]


@dataclass
class ShardState:
    param: torch.nn.Parameter
    version: int = 0
    optimizer: torch.optim.Optimizer | None = None
    group: int = 0
    sparse: bool = False
    spec_text: str = ""


@dataclass
class WorkerState:
    connected: bool = False
    in_flight: bool = False
    pulled_clock: int = 0
    lost: bool = False
    connections: int = 0


@dataclass
class UpdateRound:
    grads: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    number: int = 0


class ServerUpdates:
    """The update side of :class:`~replicator.ps.server.ParameterServer` (its base): the
    shards, the workers, the clock and staleness counts, the claims and applied tasks."""

    def __init__(self, index: int, num_workers: int, staleness: int | None,
                 timeout_seconds: float) -> None:
        self.index, self.num_workers = index, num_workers
        self.staleness, self.timeout_seconds = staleness, timeout_seconds
        self.lock = threading.Condition()
        self.shards: dict[int, ShardState] = {}
        self.workers: dict[int, WorkerState] = {}
        self.round = UpdateRound()
        self.clock = 0
        self.histogram = [0] * P.HISTOGRAM_BINS
        self.stale_sum = self.stale_max = 0
        self.claims = ClaimLedger()
        self.tasks = TaskLedger()
        #: Coordinator updates prepared and not yet committed, by (task, push): the first
        #: attempt's, copied out of the connection's buffers.
        self.prepared: dict[tuple[int, int], dict[int, Grad]] = {}
        self.shared_steps = SharedSteps()

    def _apply(self, grads: dict[int, Grad]) -> None:
        """Apply one update: every shard's gradient is checked and set before any optimizer steps,
        so an update with a bad part changes nothing."""
        ready: list[tuple[ShardState, int]] = []  # each shard, and the version its worker pulled
        by_rows: list[tuple[ShardState, torch.Tensor, torch.Tensor, float]] = []
        to_step: list[torch.optim.Optimizer] = []  # the rest step their optimizers
        try:
            for sid, (pulled_version, grad, rows) in grads.items():
                if grad is None:
                    continue
                shard = self._shard_for_gradient(sid)
                alpha = plain_sgd_alpha(shard.optimizer) \
                    if rows is not None and shard.optimizer is not None else None
                if rows is not None and alpha is not None:
                    check_gradient_rows(rows, grad, shard.param)
                    by_rows.append((shard, rows, grad, alpha))  # plain SGD: stepped below
                else:
                    self._set_gradient(sid, shard, grad, rows)
                    if shard.optimizer is not None:
                        to_step.append(shard.optimizer)
                ready.append((shard, pulled_version))
            for shard, rows, grad, alpha in by_rows:
                add_to_rows(shard.param, rows, grad, alpha)
            self.shared_steps.step(to_step)
            for shard, pulled_version in ready:  # counted once applied
                stale = max(0, shard.version - pulled_version)
                self.histogram[min(stale, P.HISTOGRAM_BINS - 1)] += 1
                self.stale_sum += stale
                self.stale_max = max(self.stale_max, stale)
                shard.version += 1
            self.clock += 1
        finally:
            for shard, _ in ready:
                shard.param.grad = None

    def _shard_for_gradient(self, sid: int) -> ShardState:
        """The shard ``sid``, refused where it is unknown or has no optimizer yet."""
        shard = self.shards.get(sid)
        if shard is None:
            raise P.ParameterServerError(f"parameter server {self.index} holds no shard {sid}")
        if shard.optimizer is None:
            raise P.ParameterServerError(
                f"parameter server {self.index} got a gradient for shard {sid} before the "
                "optimizer's description. HINT: create the optimizer inside strategy.scope() "
                "and call optimizer.step() (it sends the description first).")
        return shard

    def _set_gradient(self, sid: int, shard: ShardState, grad: torch.Tensor,
                      rows: torch.Tensor | None) -> None:
        if rows is not None:
            shard.param.grad = sparse_gradient(rows, grad, shard.param)
        elif shard.sparse:
            raise P.ParameterServerError(f"shard {sid} is a sparse table's and got a dense "
                                         "gradient")
        else:
            shard.param.grad = grad.to(shard.param.dtype).reshape(shard.param.shape)

    def _push(self, worker: int, grads: dict[int, Grad], end: Message) -> bool:
        """Apply an update; True when it was a coordinator task's repeat (not applied)."""
        with self.lock:
            if end.kind == P.TASK_PUSH:
                # a coordinator's function: applied alone and at most once, in any mode
                return self._apply_task(worker, (end.var_id, end.version), grads)
            if self.staleness == 0:
                if any(rows is not None for _, _, rows in grads.values()):
                    raise P.ParameterServerError(
                        "staleness=0 averages dense gradients of every worker; sparse table rows "
                        "are applied one function at a time by rp.ClusterCoordinator. HINT: "
                        "schedule the steps with a ClusterCoordinator, or use staleness=None.")
                self._push_sync(worker, {sid: (v, g) for sid, (v, g, _) in grads.items()})
            else:
                self._apply(grads)
                if end.c:
                    self.claims.consume(worker, (end.var_id, end.version), end.c - 1)
            self._pushed(worker)
        return False

    def _prepare(self, key: tuple[int, int], grads: dict[int, Grad]) -> bool:
        """Hold a coordinator update until its commit; False (nothing kept) when an earlier
        attempt's is held or was applied: the first attempt's update is the one applied."""
        with self.lock:
            if key in self.prepared or self.tasks.seen(*key):
                return False
            self.prepared[key] = {sid: (v, None if g is None else g.clone(),
                                        None if r is None else r.clone())
                                  for sid, (v, g, r) in grads.items()}
            return True

    def _commit_task(self, worker: int, key: tuple[int, int]) -> bool:
        """Apply the update prepared for ``key`` once; True when it was a repeat."""
        with self.lock:
            grads = self.prepared.pop(key, None)
            if grads is None and not self.tasks.seen(*key):
                raise P.ParameterServerError(
                    f"parameter server {self.index}: task {key[0]} push {key[1]} was "
                    "committed without being prepared")
            return self._apply_task(worker, key, grads or {})

    def _apply_task(self, worker: int, key: tuple[int, int], grads: dict[int, Grad]) -> bool:
        """Apply a coordinator task's update unless it was applied before (then True)."""
        repeat = not self.tasks.first(*key)
        if not repeat:
            self._apply(grads)
        self._pushed(worker)
        return repeat

    def _pushed(self, worker: int) -> None:
        self.workers[worker].in_flight = False
        self.lock.notify_all()

    def _push_sync(self, worker: int, grads: dict[int, tuple[int, torch.Tensor | None]]) -> None:
        number = self.round.number
        self.round.grads[worker] = {sid: g for sid, (_, g) in grads.items() if g is not None}
        self._maybe_finish_round()
        def late() -> str:
            waiting = [w for w, s in self.workers.items()
                       if s.connected and w not in self.round.grads]
            return (f"parameter server {self.index} waited {self.timeout_seconds:.0f} s for "
                    f"the gradients of worker(s) {waiting} (staleness=0 waits for every live "
                    "worker). HINT: every worker must call optimizer.step() the same number "
                    "of times; use staleness=None for independent workers.")

        self._wait_until(lambda: self.round.number != number, late)

    def _wait_until(self, ready: Callable[[], bool], timed_out: Callable[[], str]) -> None:
        """Wait on the lock (held) until ``ready()``; after the server's timeout, raise
        ``ParameterServerError(timed_out())``."""
        deadline = time.monotonic() + self.timeout_seconds
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise P.ParameterServerError(timed_out())
            self.lock.wait(min(left, 0.5))

    def _maybe_finish_round(self) -> None:
        if not self.round.grads:
            return
        live = {w for w, s in self.workers.items() if s.connected}
        if len(self.workers) < self.num_workers or not live <= set(self.round.grads):
            return
        contributions = list(self.round.grads.values())
        means: dict[int, Grad] = {}
        for sid in sorted({s for g in contributions for s in g}):
            parts = [g[sid] for g in contributions if sid in g]
            mean = torch.stack([p.to(torch.float64) for p in parts]).mean(0) \
                if len(parts) > 1 else parts[0]
            version = self.shards[sid].version if sid in self.shards else 0
            means[sid] = (version, mean.to(parts[0].dtype), None)
        self._apply(means)
        self.round = UpdateRound(number=self.round.number + 1)
        self.lock.notify_all()

    def _may_pull(self, worker: int) -> bool:
        """Stale-synchronous gating: a new step of ``worker`` may not push any step in flight
        beyond ``staleness`` versions, counting every step in flight as one future update."""
        k = self.staleness
        if not k:
            return True
        flying = [w for w, s in self.workers.items() if s.connected and s.in_flight and w != worker]
        for a in flying:
            behind = self.clock - self.workers[a].pulled_clock
            # the other steps in flight (len - 1) and this new one (+ 1) may all land first
            if behind + len(flying) > k:
                return False
        return True
