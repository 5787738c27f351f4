"""DiLoCo and LocalSGD: train inside each host every step, across hosts every H steps.

Across a slow link per-step gradient averaging waits for the link at every step. Here each host
trains as one synchronous group (any synchronous strategy over the ``local`` axis of a
``Topology``, ``MirroredStrategy`` by default), and every ``inner_steps`` optimizer steps the
hosts average their pseudo-gradient (outer minus inner weights) over the ``hosts`` axis; an outer
Nesterov SGD moves the outer weights, which become every host's inner weights (Douillard et al.
2023; streaming fragments and int8/int4 compression, 2025). Written here rather than taken from
torchft's ``DiLoCo``, which keeps a fixed sampler per replica group (samples skipped when a group
rejoins), compresses only on CUDA and has no per-host inner group. The input is split over every
process (each global batch once), so ``inner_steps=1, outer_lr=1, outer_momentum=0`` equals
synchronous training. Under ``--replica-groups`` each group is one host and the outer exchange
goes through the live engine's rounds (``strategies/live/engine.py``), compressed or not; with
``fragments=F`` a round is ``inner_steps / F`` steps and ends with one fragment's exchange,
started ``sync_delay`` steps before the round's end (so it never outlives the round, the unit a
group commits or trains again).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from replicator.cluster.devices import default_device_for
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.hosts import HostsSpec
from replicator.cluster.topology import Topology
from replicator.comm.block_quantize import DEFAULT_BLOCK_SIZE, BlockQuantizer
from replicator.comm.comm_thread import DONE
from replicator.comm.options import CommunicationOptions
from replicator.errors import ClusterConfigError
from replicator.strategies.base import Strategy
from replicator.strategies.live.settings import LiveSettings, building_part
from replicator.strategies.nest import clone_tree
from replicator.strategies.registry import find_strategy_class
from replicator.strategies.replicas import ReplicaGroup
from replicator.strategies.scope_capture import named_state
from replicator.strategies.two_level.exchange import OuterExchange, PendingExchange
from replicator.strategies.two_level.fragments import Schedule, split_fragments
from replicator.strategies.two_level.hosts import (
    HOSTS_AXIS,
    LOCAL_AXIS,
    check_mesh,
    two_level_topology,
)
from replicator.strategies.two_level.outer_optimizer import OuterFragment

COMPRESSIONS = {None: None, "int8": 8, "int4": 4}


def _positive_int(name: str, value: Any, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. HINT: {hint}")
    return value


def _check_settings(inner_steps: int, outer_lr: float, outer_momentum: float, fragments: int,
                    sync_delay: int, compression: str | None) -> None:
    _positive_int("inner_steps", inner_steps, "inner_steps is the number of optimizer steps "
                  "each host takes between two outer synchronisations; 1 synchronises every "
                  "step, DiLoCo uses 50 to 500")
    _positive_int("fragments", fragments, "fragments=1 synchronises the whole model at once")
    if fragments > inner_steps:
        raise ValueError(f"fragments={fragments} > inner_steps={inner_steps}: each fragment is "
                         "synchronised once per round, at its own step. HINT: use fragments <= "
                         "inner_steps")
    if isinstance(sync_delay, bool) or not isinstance(sync_delay, int) or sync_delay < 0 \
            or sync_delay >= max(1, inner_steps // fragments):
        raise ValueError(f"sync_delay must be an integer in [0, {inner_steps // fragments}) (the "
                         f"inner steps between two fragments' updates), got {sync_delay!r}. "
                         "HINT: sync_delay=0 applies each exchange at once; a delay of d "
                         "overlaps it with the next d inner steps")
    if not isinstance(outer_lr, (int, float)) or isinstance(outer_lr, bool) or outer_lr <= 0:
        raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}. HINT: DiLoCo "
                         "uses 0.7; 1.0 without momentum is plain averaging (LocalSGD)")
    if not isinstance(outer_momentum, (int, float)) or isinstance(outer_momentum, bool) \
            or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}. HINT: "
                         "DiLoCo uses Nesterov momentum 0.9")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None, 'int8' or 'int4', got {compression!r}")


class DiLoCoStrategy(Strategy):
    """Two-level data parallelism for hosts joined by a slow link (see the module doc).

    ``inner_steps`` (H): optimizer steps between outer synchronisations. ``outer_lr``,
    ``outer_momentum``: the outer Nesterov SGD (the paper's 0.7 and 0.9). ``fragments``,
    ``sync_delay``: streaming (see ``fragments.py``). ``compression``: ``None``, ``"int8"`` or
    ``"int4"`` per ``block_size`` values, with ``error_feedback``. ``inner``: the registered
    name of the synchronous strategy inside a host (built with ``mesh=`` and ``axis=``), with
    ``inner_options``. ``mesh``: an :class:`~replicator.cluster.Topology` whose hosts are the
    outer groups (``None``: the environment's hosts; ``rp.Topology(hosts=2)`` declares them);
    ``hosts=`` is short for ``mesh=rp.Topology(hosts=...)``. ``communication_options``:
    timeouts, for both levels.
    """

    name = "diloco"
    _supports_live = True

    def __init__(self, inner_steps: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, fragments: int = 1, sync_delay: int = 0,
                 compression: str | None = None, inner: str = "mirrored", *,
                 error_feedback: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                 mesh: Topology | None = None, hosts: HostsSpec = None,
                 inner_options: dict[str, Any] | None = None,
                 communication_options: CommunicationOptions | None = None,
                 check_finite: bool = False) -> None:
        _check_settings(inner_steps, outer_lr, outer_momentum, fragments, sync_delay,
                        compression)
        check_mesh(mesh, hosts)
        live = LiveSettings.from_env()
        if live is not None:
            _check_live(live, inner_steps, fragments, hosts, mesh,
                        delayed_compression=compression if sync_delay else None)
        bits = COMPRESSIONS[compression]
        self.inner_steps, self.fragments, self.sync_delay = inner_steps, fragments, sync_delay
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.compression = compression
        quantizer = None if bits is None else BlockQuantizer(bits, block_size,
                                                             error_feedback=error_feedback)
        options = communication_options or CommunicationOptions()
        spec = resolve_cluster()
        device = default_device_for(spec.local_rank, spec.local_world_size)
        self._replica_group = ReplicaGroup(device, timeout_seconds=options.timeout_seconds)
        self.topology = two_level_topology(  # a replica group is one host
            mesh, hosts, None if live is None else self._replica_group.world_size)
        self.num_hosts = self.topology.size(HOSTS_AXIS)
        self.processes_per_host = self.topology.size(LOCAL_AXIS)
        with building_part():  # the inner group is no replica group of its own
            self.inner = self._build_inner(inner, inner_options, communication_options)
        self._exchange = OuterExchange(self.topology.group(HOSTS_AXIS), self.num_hosts,
                                       self.inner.collectives, quantizer)
        self._schedule = Schedule(inner_steps, fragments, sync_delay)
        self._params: list[torch.nn.Parameter] = []
        self._outer: list[OuterFragment] = []
        self._pending: list[PendingExchange] = []
        self._step = 0
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = \
            weakref.WeakKeyDictionary()
        self._optimizer_states: dict[str, Any] = {}
        # under replica groups a round ends with one fragment's exchange (see _check_live)
        self.round_steps = inner_steps // fragments if live is not None else inner_steps
        super().__init__(check_finite=check_finite)
        if self.live is not None:
            self.live.use_rounds(self)

    def _build_inner(self, inner: str, options: dict[str, Any] | None,
                     communication: CommunicationOptions | None) -> Strategy:
        cls = find_strategy_class(inner) if isinstance(inner, str) else None
        if cls is None or cls is type(self) or issubclass(cls, DiLoCoStrategy):
            raise ValueError(f"inner={inner!r} is not a synchronous strategy's name. HINT: use "
                             "inner='mirrored' (the default) or another registered synchronous "
                             "strategy that takes mesh= and axis=")
        kwargs = dict(options or {})
        if communication is not None:
            kwargs.setdefault("communication_options", communication)
        try:
            return cls(mesh=self.topology, axis=LOCAL_AXIS, **kwargs)  # type: ignore[call-arg]
        except TypeError as exc:
            raise ValueError(f"inner={inner!r} cannot run over a host's processes ({exc}). "
                             "HINT: use inner='mirrored'") from exc

    # -- identity ------------------------------------------------------------------------------
    @property
    def local_replica_id(self) -> int:
        """This process's position inside its host."""
        return self.inner.replica_id

    @property
    def host_index(self) -> int:
        """Which host this process is on (0-based)."""
        return self.topology.index(HOSTS_AXIS)

    @property
    def step_in_round(self) -> int:
        """Inner steps taken since the last full round boundary (0 .. inner_steps - 1)."""
        return self._step % self.inner_steps

    @property
    def wire_stats(self) -> dict[str, int]:
        """Bytes this rank handed to the cross-host exchanges, and how many it started."""
        return asdict(self._exchange.stats)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(hosts={self.num_hosts} x {self.processes_per_host}, "
                f"inner_steps={self.inner_steps}, fragments={self.fragments}, "
                f"compression={self.compression}, rank={self.replica_id})")

    # -- set-up --------------------------------------------------------------------------------
    def _setup_module(self, module: torch.nn.Module) -> None:
        params, buffers = named_state(module)
        new = [p for _, p in params if p not in self._distributed]
        self.collectives.broadcast_(
            [*new, *(b for _, b in buffers if b not in self._distributed)], src=0,
            what="broadcast of initial parameters from rank 0 to every host")
        self.inner.distribute_model(module)
        self._params.extend(p for p in new if p.requires_grad)
        groups = split_fragments(self._params, self.fragments)
        self._outer = [OuterFragment([self._params[i] for i in g], self.outer_lr,
                                     self.outer_momentum) for g in groups]
        for fragment in self._outer:  # stepped by the outer optimizer, the same on every rank
            for outer in fragment.outer:
                self._distributed[outer] = True

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        known = self._optimizers.get(optimizer)
        if known is None:
            mine = {id(p) for p in self._params}
            known = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            self._optimizers[optimizer] = known
        return known

    def _optimizer_key(self, optimizer: torch.optim.Optimizer) -> str:
        index = {id(p): i for i, p in enumerate(self._params)}
        first = min(index[id(p)] for g in optimizer.param_groups for p in g["params"]
                    if id(p) in index)
        return f"params_from_{first}"

    # -- the round -----------------------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                               kwargs: Any) -> None:
        super()._before_optimizer_step(optimizer, args, kwargs)
        self._load_optimizer_state(optimizer)

    def _load_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` the inner state a :meth:`load_state_dict` holds for it."""
        if self._optimizer_states and self._owns(optimizer):
            state = self._optimizer_states.pop(self._optimizer_key(optimizer), None)
            if state is not None:
                optimizer.load_state_dict(state)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._owns(optimizer):
            return
        self._step += 1
        live = self.live  # under replica groups, a round ends with its fragment's update
        for fragment in self._schedule.starting(self._step):
            flat = self._outer[fragment].pseudo_gradient()
            self._pending.append(self._exchange.start(fragment, flat) if live is None
                                 else self._exchange.start_in_round(live, fragment, flat))
        for fragment in self._schedule.applied(self._step):
            pending = next(p for p in self._pending if p.fragment == fragment)
            self._pending.remove(pending)
            self._outer[fragment].step(self._exchange.finish(pending))

    # -- input ---------------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Any, **kwargs: Any) -> TwoLevelDataset:
        """:meth:`Strategy.distribute_dataset` over every process of the job (each global
        batch split across all hosts' processes); its ``state_dict`` also holds this rank's
        round (see :class:`TwoLevelDataset`)."""
        data = super().distribute_dataset(dataset, **kwargs)
        if self.live is not None:  # the round heals with the live engine's state instead
            return data
        return TwoLevelDataset(data, self)

    experimental_distribute_dataset = distribute_dataset

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's round: the step, outer weights and optimizer, its host's inner weights
        and inner optimizer state, quantisation errors and exchanges in flight (finished
        first, so the saved and the continuing run apply the same update)."""
        for pending in self._pending:
            pending.chunk()
        optimizers = {self._optimizer_key(o): clone_tree(o.state_dict())
                      for o, mine in list(self._optimizers.items()) if mine}
        optimizers.update(clone_tree(self._optimizer_states))
        return {"step": self._step,
                "settings": [self.inner_steps, self.fragments, self.sync_delay,
                             self.num_hosts, self.processes_per_host],
                "outer": [f.state_dict() for f in self._outer],
                "inner": [clone_tree(m.state_dict()) for m in self._set_up_modules.keys()],
                "inner_optimizers": optimizers,
                "exchange": self._exchange.state_dict(),
                "pending": [{"fragment": p.fragment, "numel": p.numel,
                             "chunk": p.chunk().clone()} for p in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank (a fresh process resumes there)."""
        mine = [self.inner_steps, self.fragments, self.sync_delay, self.num_hosts,
                self.processes_per_host]
        if list(state["settings"]) != mine:
            raise ValueError(
                f"the saved round was made with (inner_steps, fragments, sync_delay, hosts, "
                f"processes per host) = {list(state['settings'])}, this strategy has {mine}. "
                "HINT: resume with the settings and layout of the run that wrote it")
        modules = list(self._set_up_modules.keys())
        if len(modules) != len(state["inner"]) or len(self._outer) != len(state["outer"]):
            raise ValueError("the saved round holds another model. HINT: build the model in "
                             "scope() before restoring")
        for fragment, saved in zip(self._outer, state["outer"]):
            fragment.load_state_dict(saved)
        for module, saved in zip(modules, state["inner"]):
            module.load_state_dict(saved)
        self._optimizer_states = dict(state["inner_optimizers"])
        for optimizer, owned in list(self._optimizers.items()):
            if owned:
                self._load_optimizer_state(optimizer)
        self._exchange.load_state_dict(state["exchange"])
        self._pending = []
        for saved in state["pending"]:
            pending = PendingExchange(int(saved["fragment"]), int(saved["numel"]),
                                      handle=DONE)
            pending.box["chunk"] = saved["chunk"].clone()
            self._pending.append(pending)
        self._step = int(state["step"])

    # -- live recovery (strategies/live/engine.py's RoundOwner) --------------------------------
    def round_state(self) -> dict[str, Any]:
        """What a healing group takes beside modules and optimizers: the outer weights, the
        outer optimizer and the step (at a round's start); with error feedback also this
        rank's quantisation errors, tagged with its group and rank (see
        :meth:`load_round_state`)."""
        state: dict[str, Any] = {"step": self._step,
                                 "outer": [f.state_dict() for f in self._outer]}
        quantizer = self._exchange.quantizer
        if quantizer is not None and quantizer.error_feedback:
            state["feedback"] = {"owner": self._live_owner(), "errors": quantizer.state_dict()}
        return state

    def load_round_state(self, state: dict[str, Any]) -> None:
        """Load a :meth:`round_state`. The quantisation errors are each rank's own (what the
        payloads of its chunk lost), so they come back only from this group and rank's own
        round start (a round not committed and trained again, a backup it wrote): the round
        does not add them twice. A group healing from a peer's state starts from zero errors:
        taking the peer's would send the peer's lost part twice, once from each group."""
        for fragment, saved in zip(self._outer, state["outer"], strict=True):
            fragment.load_state_dict(saved)
        self._step = int(state["step"])
        self._pending = []  # a round starts with no exchange in flight (see _check_live)
        quantizer = self._exchange.quantizer
        if quantizer is not None:
            feedback = state.get("feedback") or {}
            own = list(feedback.get("owner", [])) == self._live_owner()
            quantizer.load_state_dict(dict(feedback.get("errors", {})) if own else {})

    def _live_owner(self) -> list[int]:
        """This rank's replica group and rank in it (empty outside replica groups)."""
        live = self.live
        return [] if live is None else [live.settings.group, live.settings.rank]

    def _close(self) -> None:
        self.inner.close()


def _check_live(live: LiveSettings, inner_steps: int, fragments: int,
                hosts: HostsSpec, mesh: Topology | None,
                delayed_compression: str | None = None) -> None:
    """Refuse the settings that replica groups do not support."""
    for name, value, plain, why in (("hosts", hosts, None, "each group is one host"),
                                    ("mesh", mesh, None, "each group is one host"),
                                    ("compression", delayed_compression, None,
                                     "with sync_delay > 0 there only float32 exchanges are "
                                     "overlapped and tested (sync_delay=0 takes compression)"
                                     )):
        if value != plain:
            raise ClusterConfigError(
                f"{name}={value!r} is not supported in replica groups ({live.who} of "
                f"{live.groups}): {why}. HINT: leave {name} at {plain!r} under "
                "--replica-groups, or launch without it")
    if inner_steps % fragments:
        raise ClusterConfigError(
            f"fragments={fragments} does not divide inner_steps={inner_steps} ({live.who} of "
            f"{live.groups}): in replica groups each fragment's exchange ends a round of "
            "inner_steps / fragments steps, the unit a group commits, trains again or heals "
            f"at. HINT: use inner_steps={inner_steps - inner_steps % fragments} or "
            f"fragments={_largest_divisor(inner_steps, fragments)}")


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` not above ``at_most``."""
    return max(d for d in range(1, at_most + 1) if n % d == 0)


class LocalSGDStrategy(DiLoCoStrategy):
    """Local SGD: each host trains alone for ``inner_steps`` steps, then the hosts' weights are
    averaged (DiLoCo with an outer SGD of lr 1 and no momentum)."""

    name = "local_sgd"

    def __init__(self, inner_steps: int = 50, fragments: int = 1, sync_delay: int = 0,
                 compression: str | None = None, inner: str = "mirrored",
                 **kwargs: Any) -> None:
        super().__init__(inner_steps, outer_lr=1.0, outer_momentum=0.0, fragments=fragments,
                         sync_delay=sync_delay, compression=compression, inner=inner, **kwargs)


class TwoLevelDataset:
    """A distributed dataset whose ``state_dict`` also holds the strategy's round on this rank.
    Mid-round the hosts hold different inner weights (and optimizer state, quantisation errors),
    and a backup keeps exactly one state per rank, the input's, so ``rp.BackupAndRestore`` (or a
    loop that saves the input state) resumes a run mid-round bit for bit."""

    def __init__(self, dataset: Any, owner: DiLoCoStrategy) -> None:
        self.dataset = dataset
        self._owner = owner

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "_owner"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        """The input position and the two-level round of this rank."""
        saver = getattr(self.dataset, "state_dict", None)
        if not callable(saver):
            raise TypeError(f"{type(self.dataset).__name__} has no state_dict(), so a backup "
                            "could not resume the round. HINT: give distribute_dataset a "
                            "map-style Dataset or a DataLoader")
        return {"data": saver(), "round": self._owner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["data"])
        self._owner.load_state_dict(state["round"])

    def __repr__(self) -> str:
        return f"TwoLevelDataset({self.dataset!r})"
