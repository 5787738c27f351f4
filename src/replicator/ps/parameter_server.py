"""ParameterServerStrategy: variables and the optimizer live on parameter servers. The last
``num_ps`` processes serve (their constructor serves, then ends with ``SystemExit(0)``); the
workers' ``optimizer.step()`` sends gradients of placed parameters to the servers, which run the
optimizer and send back new values."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler
from torch.utils.weak import WeakIdKeyDictionary

from replicator.cluster.cpu_scheduling import use_batch_scheduling
from replicator.cluster.env_names import NUM_PS_ENV, REJOIN_ENV
from replicator.cluster.environment import resolve_cluster
from replicator.cluster.ports import LOOPBACK, listen
from replicator.cluster.process_group import initialize, on_shutdown
from replicator.cluster.timeouts import env_number, resolve_timeout
from replicator.cluster.topology import Topology
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.shm_segment import align
from replicator.errors import ClusterConfigError
from replicator.ps import protocol as P
from replicator.ps.claims import ClaimedBatches
from replicator.ps.client import Push, ServerClient
from replicator.ps.partitioners import Partitioner, Shard, place
from replicator.ps.server import ParameterServer
from replicator.ps.sparse_tables import TableLookups
from replicator.strategies.base import Strategy
from replicator.strategies.replicas import ReplicaGroup


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as rows along dimension 0 (a scalar as one row)."""
    return t.view(1) if t.dim() == 0 else t


class ParameterServerStrategy(Strategy):
    """Data-parallel workers, variables and optimizer on parameter servers (see module doc).

    ``num_ps``: servers (default: the launcher's ``--num-ps``, else 1); it must match the
    launcher's. ``variable_partitioner``: ``rp.partitioners.MinSizePartitioner(...)`` or
    ``FixedShardsPartitioner(n)`` to split variables along dimension 0 (``None``: whole).
    ``staleness``: ``None``, ``0`` or a positive bound. ``address``: where servers listen
    (default loopback). ``checkpoint_dir``: servers restore from it at start, and
    :meth:`save_checkpoint` writes there. ``shared_memory``: payloads between a worker and a
    server on one host go through shared memory (default on, unless
    ``REPLICATOR_PS_SHARED_MEMORY=0``); ``False`` keeps them on the TCP connection.
    ``check_finite``: see :class:`~replicator.strategies.base.Strategy` (asynchronous workers,
    not in step, each check their own value).
    """

    name = "parameter_server"
    _guards_undistributed = True

    def __init__(self, num_ps: int | None = None, variable_partitioner: Partitioner | None = None,
                 staleness: int | None = None, *, address: str | None = None,
                 timeout_seconds: float | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 shared_memory: bool | None = None, check_finite: bool = False) -> None:
        launched = int(env_number(os.environ, NUM_PS_ENV, 0, "servers")) or None
        if num_ps is None:
            num_ps = launched if launched is not None else 1
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
            raise ClusterConfigError(f"num_ps must be a positive integer, got {num_ps!r}")
        if launched is not None and launched != num_ps:
            raise ClusterConfigError(
                f"ParameterServerStrategy(num_ps={num_ps}) but the job was launched with "
                f"--num-ps {launched}. HINT: give the same number to both, or leave num_ps out.")
        if variable_partitioner is not None and not isinstance(variable_partitioner, Partitioner):
            raise TypeError("variable_partitioner must be rp.partitioners.MinSizePartitioner"
                            "(...) or FixedShardsPartitioner(n), got "
                            f"{type(variable_partitioner).__name__}")
        if staleness is not None and (isinstance(staleness, bool)
                                      or not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness must be None (asynchronous), 0 (synchronous) or a "
                             f"positive bound, got {staleness!r}")
        self.staleness = staleness
        self._partitioner = variable_partitioner
        self._checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir else None
        env = os.environ.get(P.SHARED_MEMORY_ENV, "1").strip().lower()
        self._shared_memory = env not in ("0", "false", "no", "off") if shared_memory is None \
            else bool(shared_memory)
        self.num_ps = num_ps
        self._device = torch.device("cpu")
        self.rejoined = os.environ.get(REJOIN_ENV) == "1"  # restarted alone, rejoining
        self._timeout = resolve_timeout(timeout_seconds)
        store, attempt = self._join_alone() if self.rejoined else self._join_job(address)
        self._shards: list[Shard] = []
        self._params: dict[int, torch.Tensor] = {}        # shard id -> parameter
        # keyed by the objects, never by id(), which a later object may reuse
        self._shards_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> shards
        self._pulled: dict[int, int] = {}                  # shard id -> version pulled
        self._loads = [0] * num_ps
        self._sent_specs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> its text
        self._sent_keys: WeakIdKeyDictionary = WeakIdKeyDictionary()   # optimizer -> its key
        self._landings: dict[int, tuple[Any, torch.Tensor]] = {}  # shard id -> its rows
        self._task: list[int] | None = None                # [task id, pushes] in a function
        self._store = store
        self._stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._claim: tuple[int, int, int] | None = None
        self._repeats = self._steps = self._streams = 0  # task repeats seen, steps, datasets
        addresses = []
        for k in range(num_ps):
            key = P.SERVER_ADDRESS_KEY.format(index=k)
            try:
                store.wait([key], timedelta(seconds=self._timeout))
            except RuntimeError as exc:
                raise P.ParameterServerLostError(
                    f"parameter server {k} (rank {self._num_workers + k}) did not publish its "
                    f"address within {self._timeout:.0f} s ({exc}). HINT: check that rank's "
                    "output: it may have failed while starting.") from exc
            host, port = store.get(key).decode().rsplit(":", 1)
            addresses.append((host, int(port)))
        servers = list(range(self._num_workers, self._num_workers + num_ps))
        self._client = ServerClient(addresses, servers, self._rank, attempt, self._timeout,
                                    self._held_by, into=self._landing)
        #: sparse tables: their modules' calls pull the rows they look up
        self._lookups = TableLookups(self._client.pull_rows, self._pulled, lambda: self._closed)
        on_shutdown(self._client.close)
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        super().__init__(check_finite=check_finite)

    def _join_job(self, address: str | None) -> tuple[dist.Store, int]:
        """Start with the whole job: the process group, the topology, the workers' group."""
        info = initialize(timeout_seconds=self._timeout)
        # chief, workers and servers wake each other every step: on too few cores, batch
        # scheduling keeps the servers of one request working at once (see the module)
        use_batch_scheduling(info.spec.local_world_size, announce=info.spec.rank == 0)
        topology = Topology(num_ps=self.num_ps)
        self.topology: Topology | None = topology  # None on a worker that rejoined alone
        self._num_workers = topology.num_workers
        store = info.store if info.store is not None else dist.distributed_c10d._get_default_store()
        if topology.is_ps:
            self._serve(store, address or LOOPBACK, topology.global_rank - self._num_workers)
        self._rank = topology.replica_id
        # the workers' replica group (servers are on no axis): synchronous reduce, checkpoints
        self._replica_group = ReplicaGroup(self._device, topology, timeout_seconds=self._timeout)
        return store, info.spec.restart_count

    def _join_alone(self) -> tuple[dist.Store, int]:
        """A worker restarted alone: no process group (the running job's cannot take a new
        member); it finds the servers through the rendezvous store and talks only to them."""
        if self.staleness == 0:
            raise ClusterConfigError(
                "a worker restarted alone cannot rejoin a synchronous job (staleness=0): the "
                "other workers' collectives have moved on without it. HINT: use staleness=None "
                "or a bound k for jobs that survive lost workers.")
        spec = resolve_cluster()
        use_batch_scheduling(spec.local_world_size)
        try:
            raw = dist.TCPStore(spec.master_addr, spec.master_port or 0, spec.world_size, False,
                                timeout=timedelta(seconds=self._timeout))
        except (RuntimeError, OSError) as exc:
            raise ClusterConfigError(f"worker rank {spec.rank} could not reach the rendezvous "
                                     f"store to rejoin: {exc}") from exc
        store = dist.PrefixStore(f"replicator/attempt_{spec.restart_count}", raw)
        self.topology = None
        self._num_workers = spec.world_size - self.num_ps
        self._rank = spec.rank
        self._replica_group = ReplicaGroup.single(self._device, self._timeout,  # alone
                                                  chief=self._rank == 0)
        return store, spec.restart_count

    # -- the server side ---------------------------------------------------------------------
    def _serve(self, store: dist.Store, address: str, index: int) -> None:
        sock = listen(address, 0)
        host, port = sock.getsockname()[:2]
        store.set(P.SERVER_ADDRESS_KEY.format(index=index), f"{host}:{port}")
        server = ParameterServer(index, self._num_workers, self.staleness, sock,
                                 self._timeout, self._checkpoint_dir, store=store,
                                 shared_memory=self._shared_memory)
        server.serve()
        sys.stdout.flush()
        raise SystemExit(0)

    # -- identity ------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Every worker of the job (also on a worker that rejoined alone)."""
        return self._num_workers

    @property
    def replica_id(self) -> int:
        return self._rank

    @property
    def restored_step(self) -> int | None:
        """The step of the checkpoint the servers restored at start (``None``: fresh start);
        a restarted script skips that many steps of its input."""
        info = self._client.restored[0]
        return None if info is None else int(info["step"])

    @property
    def restored_data_position(self) -> dict[str, Any] | None:
        """The ``data_position`` saved with that checkpoint (``None``: fresh start)."""
        info = self._client.restored[0]
        return None if info is None else dict(info.get("data") or {})

    @property
    def shared_memory(self) -> list[bool]:
        """Per server: whether payloads to and from it go through shared memory."""
        return self._client.shared

    @property
    def server_pids(self) -> list[int]:
        """The process id of each parameter server (for monitoring and fault tests)."""
        return list(self._client.pids)

    # -- placement -----------------------------------------------------------------------------
    def _held_by(self, k: int) -> list[str]:
        return [s.name if s.parts == 1 else f"{s.name} (shard {s.part + 1} of {s.parts})"
                for s in self._shards if s.server == k]

    def placement(self) -> list[dict[str, Any]]:
        """Where each variable (or shard) lives: name, shard, rows and server index."""
        return [{"name": s.name, "shard": s.part, "shards": s.parts, "rows": (s.start, s.end),
                 "server": s.server, "bytes": s.nbytes} for s in self._shards]

    def _setup_module(self, module: torch.nn.Module) -> None:
        params = [(n, p) for n, p in module.named_parameters() if p not in self._distributed]
        if not params:
            return
        first = len(self._shards)
        shards = place([(n, p.detach()) for n, p in params], self.num_ps, self._partitioner,
                       first_shard_id=first, loads=self._loads)
        for s in shards:
            p = params[s.var_index][1]
            self._shards.append(s)
            self._params[s.shard_id] = p
            self._shards_of.setdefault(p, []).append(s)
        self._lookups.find(module, self._shards_of)
        if self._rank == 0:
            initial: dict[int, list[tuple[int, torch.Tensor]]] = {}
            for s in shards:
                initial.setdefault(s.server, []).append(
                    (s.shard_id, self._shard_rows(s.shard_id).cpu().clone()))
            self._client.register(initial, self._lookups.sparse_ids)
        self._client.pull(self._expected(), self._receive)
        if self._shared_memory:
            self._client.share_memory(self._lane_sizes(), self._rank)

    #: Bytes kept in a lane, each way, for a sparse table's rows (more goes on the socket).
    _SPARSE_LANE_BYTES = 8 << 20

    def _lane_sizes(self) -> dict[int, tuple[int, int]]:
        """Per server: bytes of a push and of its answer, each every shard's values (a sparse
        table's rows up to a budget: the rows a step pulls and their gradients)."""
        size = {k: 0 for k in range(self.num_ps)}
        for s in self._shards:
            sparse = s.shard_id in self._lookups.sparse_ids
            size[s.server] += align(min(s.nbytes, self._SPARSE_LANE_BYTES) if sparse else s.nbytes)
        return {k: (n, n) for k, n in size.items() if n}

    def _landing(self, kind: int, sid: int, dtype: torch.dtype, shape: tuple[int, ...]
                 ) -> torch.Tensor | None:
        """Pulled values land straight in the parameter's rows when they match."""
        if kind != P.VALUE or not 0 <= sid < len(self._shards):
            return None
        rows = self._shard_rows(sid)
        ok = rows.is_contiguous() and rows.dtype == dtype and tuple(rows.shape) == shape
        return rows if ok and rows.device.type == "cpu" else None

    def _shard_rows(self, sid: int) -> torch.Tensor:
        """The parameter's rows that shard ``sid`` holds (a view, kept while the parameter's
        memory, shape and strides stay the same: making it costs more than the check)."""
        p = self._params[sid]
        layout = (p.data_ptr(), p.shape, p.stride(), p.dtype)
        cached = self._landings.get(sid)
        if cached is not None and cached[0] == layout:
            return cached[1]
        s = self._shards[sid]
        rows = _rows(p.detach())[s.start:s.end]
        self._landings[sid] = (layout, rows)
        return rows

    def _receive(self, sid: int, version: int, values: torch.Tensor) -> None:
        if not 0 <= sid < len(self._shards):
            return  # a variable another process has set up and this one not yet
        rows = self._shard_rows(sid)
        if rows.data_ptr() != values.data_ptr():  # not received in place
            with torch.no_grad():
                rows.copy_(values.reshape(rows.shape))
        self._pulled[sid] = version

    # -- the optimizer step --------------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Send the gradients of placed parameters to the servers and take back the new
        values; their gradients are hidden from the local step (no local optimizer state)."""
        if self._closed:
            return
        group_of: dict[int, int] = {}
        grads: dict[int, list[Push]] = {}
        mine: list[torch.Tensor] = []
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                shards = self._shards_of.get(p)
                if not shards:
                    continue
                mine.append(p)
                group_of.update((s.shard_id, gi) for s in shards)
                if p.grad is None:
                    continue
                table = self._lookups.tables.get(p)
                if table is not None:
                    for k, items in table.gradient_rows(p.grad.detach().cpu(),
                                                        self._pulled).items():
                        grads.setdefault(k, []).extend(items)
                    continue
                for s in shards:
                    g = _rows(p.grad.detach())[s.start:s.end].cpu().contiguous()
                    grads.setdefault(s.server, []).append(
                        (s.shard_id, self._pulled.get(s.shard_id, 0), g, None))
        if not mine:
            return
        key = P.optimizer_key(optimizer, group_of)
        if key is None or key != self._sent_keys.get(optimizer):
            spec = P.describe_optimizer(optimizer, group_of)
            if spec != self._sent_specs.get(optimizer):
                self._client.send_optimizer(spec)
                self._sent_specs[optimizer] = spec
            if key is not None:
                self._sent_keys[optimizer] = key
        task = None if self._task is None else (self._task[0], self._task[1])
        if self._task is not None:
            self._task[1] += 1
        # staleness=0 promises serializable functions: a function's whole update from one
        # attempt; asynchronous ones need only each server's part applied once
        clocks = self._client.push(grads, self._receive, pull=True, claim=self._claim,
                                   task=task, atomic=self.staleness == 0)
        self._repeats += sum(c < 0 for c in clocks)
        self._claim = None
        self._steps += 1
        self._stash = [(p, p.grad) for p in mine]
        for p in mine:
            p.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, g in self._stash:
            p.grad = g
        self._stash = []

    def _run(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.staleness and self._shards:
            # bounded staleness: the step starts from values pulled under the bound
            self._client.pull(self._expected(), self._receive, begin=True)
        return fn(*args, **kwargs)

    def _expected(self, everything: bool = False) -> dict[int, int]:
        return {k: sum(s.server == k and (everything or s.shard_id not in self._lookups.sparse_ids)
                       for s in self._shards) for k in range(self.num_ps)}

    @property
    def steps_pushed(self) -> int:
        """How many optimizer steps this worker has pushed to the servers."""
        return self._steps

    def pull(self) -> None:
        """Fetch the servers' current values (sparse tables whole too) into the parameters now."""
        self._client.pull(self._expected(everything=True), self._receive, everything=True)

    # -- coordinator functions -------------------------------------------------------------------
    def _begin_task(self, task_id: int | None) -> None:
        """A coordinator's function starts here: its pushes carry ``task_id`` (the servers
        apply each once); with ``staleness=0`` it first reads every committed update. ``None``:
        the function ended."""
        self._task = None if task_id is None else [task_id, 0]
        if task_id is not None and self.staleness is not None and self._shards:
            self._client.pull(self._expected(), self._receive, begin=bool(self.staleness))

    def traffic(self) -> dict[str, int]:
        """Bytes this worker has sent to and received from the servers (socket or lane)."""
        return self._client.traffic()

    def task_stats(self) -> dict[str, int]:
        """Over all servers: coordinator task pushes ``applied`` and ``repeats`` turned away (pushes
        of a function run again after its worker was lost), and the repeats this worker saw."""
        per = [s["tasks"] for s in self._client.stats()]
        return {"applied": sum(p["applied"] for p in per),
                "repeats": sum(p["repeats"] for p in per), "repeats_seen": self._repeats}

    def _full_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The servers' current values (pulled first), as the model's plain state dict."""
        if self._shards:
            self.pull()
        return super()._full_state_dict(model)

    # -- statistics ----------------------------------------------------------------------------
    def staleness_stats(self) -> dict[str, Any]:
        """Staleness of every update applied so far, over all servers and shards: ``count``,
        ``mean``, ``max`` and ``histogram`` ({staleness: updates}; the last bin, 63, counts
        63 and more). Staleness = the shard's version when the update was applied minus the
        version the worker had pulled."""
        per = [s["staleness"] for s in self._client.stats()]
        count, summed = sum(p[0] for p in per), sum(p[1] for p in per)
        hist = {i: n for i, n in enumerate(map(sum, zip(*(p[3:] for p in per)))) if n}
        return {"count": count, "mean": summed / count if count else 0.0,
                "max": max(p[2] for p in per), "histogram": hist}

    def shard_versions(self) -> list[dict[str, Any]]:
        """Each shard's version (the number of updates its server applied to it)."""
        versions = {int(sid): v for s in self._client.stats() for sid, v in s["versions"].items()}
        return [{"name": s.name, "shard": s.part, "server": s.server,
                 "version": versions.get(s.shard_id, 0)} for s in self._shards]

    # -- input -----------------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Any, *, batch_size: int | None = None,
                           shuffle: bool | None = None, seed: int = 0,
                           drop_last: bool | None = None, drop_remainder: bool | None = None,
                           **kwargs: Any) -> Any:
        """As for every strategy with ``staleness=0``. Asynchronous workers (``staleness``
        ``None`` or ``k``) given a ``DataLoader`` or map-style ``Dataset`` instead take
        per-replica batches (global batch / workers) one at a time from server 0: each batch
        of an epoch is consumed by exactly one applied update, fast workers take more, and a
        lost worker's unfinished batches go to the others (:mod:`replicator.ps.claims`)."""
        plain = isinstance(dataset, (DataLoader, Dataset)) and not isinstance(
            dataset, IterableDataset) and not kwargs
        if self.staleness == 0 or not plain or \
                (isinstance(dataset, DataLoader) and isinstance(dataset.dataset, IterableDataset)):
            return super().distribute_dataset(dataset, batch_size=batch_size, shuffle=shuffle,
                                              seed=seed, drop_last=drop_last,
                                              drop_remainder=drop_remainder, **kwargs)
        collate = None
        if isinstance(dataset, DataLoader):
            loader, dataset = dataset, dataset.dataset
            batch_size = batch_size or loader.batch_size
            shuffle = isinstance(loader.sampler, RandomSampler) if shuffle is None else shuffle
            drop_last = loader.drop_last if drop_last is None else drop_last
            collate = loader.collate_fn
        if not batch_size:
            raise ValueError("distribute_dataset(Dataset) needs batch_size= (the global batch)")
        workers = self._num_workers
        if batch_size % workers:
            raise ValueError(f"the global batch {batch_size} does not split evenly over "
                             f"{workers} workers. HINT: use a multiple of {workers}.")
        drop = drop_remainder if drop_remainder is not None else bool(drop_last)
        stream = self._streams
        self._streams += 1
        return ClaimedBatches(self._client.claim, self._set_claim, stream, dataset,
                              batch_size // workers, shuffle=bool(shuffle), seed=seed,
                              drop_last=drop, collate_fn=collate)

    def _set_claim(self, claim: tuple[int, int, int] | None) -> None:
        self._claim = claim

    def data_accounting(self, stream: int = 0) -> dict[int, dict[str, Any]]:
        """Per epoch of input ``stream`` (the strategy's distributed datasets in creation
        order; 0 is the first), from server 0's ledger of claimed batches: ``batches``,
        ``consumed`` (distinct batches whose update was applied), ``repeated`` (should be 0),
        ``by_worker`` and ``in_flight``."""
        raw = self._client.stats([0], stream)[0]["data"]
        return {int(e): {**v, "by_worker": {int(w): n for w, n in v["by_worker"].items()}}
                for e, v in raw.items()}

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, step: int, data_position: dict[str, Any] | None = None) -> list[str]:
        """Ask every server to save its variables, optimizer state, versions and
        ``data_position`` (JSON) as checkpoint ``step`` in ``checkpoint_dir`` (the chief only;
        other workers return ``[]``)."""
        if self._rank != 0:
            return []
        if not self._checkpoint_dir:
            raise ValueError("save_checkpoint() needs ParameterServerStrategy(checkpoint_dir="
                             "...). HINT: give a directory every process can reach.")
        return self._client.save(step, json.dumps({"directory": self._checkpoint_dir,
                                                   "worker_data": data_position or {}}))

    # -- cross-replica values -------------------------------------------------------------------
    # the workers' replica group serves ``staleness=0``; asynchronous workers are not in step,
    # so each returns its own value and never waits for the others
    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if self.staleness != 0 else super()._reduce(op, tensor)

    def _reduce_many(self, op: ReduceOp, tensors: list[torch.Tensor],
                     structure: str = "") -> list[torch.Tensor]:
        if self.staleness != 0:
            return [t.clone() for t in tensors]
        return super()._reduce_many(op, tensors, structure)

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return tensor.clone() if self.staleness != 0 else super()._gather(tensor, axis)

    def _gather_many(self, tensors: list[torch.Tensor], axis: int,
                     structure: str = "") -> list[torch.Tensor]:
        if self.staleness != 0:
            return [t.clone() if t.dim() else t.reshape(1) for t in tensors]
        return super()._gather_many(tensors, axis, structure)

    def barrier(self) -> None:
        if self.staleness == 0:
            super().barrier()

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._client.close()

