"""Parts of benchmarks/parameter_server.py for embedding tables and the coordinator.

- A DLRM-like model: two tables (1M x 32 and 100k x 16 floats), 26 lookups per sample (20 in
  the big table, 6 in the small one; ids uniform, the case where deduplication saves least),
  a 3-layer MLP (736 -> 64 -> 32 -> 1), batch 256.
- Ours: ``ParameterServerStrategy`` (asynchronous) + ``ClusterCoordinator``, 2 workers and 2
  servers (and the chief, which only schedules); variables split as TensorFlow's parameter
  server tutorial splits them, ``MinSizePartitioner(min_shard_bytes=256 << 10,
  max_shards=2)``: each table in two (its halves on different servers), the MLP's layers
  whole (each under 256 KB; splitting a 64-float bias over two servers only adds messages:
  ``FixedShardsPartitioner(2)`` ran 0-27% slower, median 13%, in five alternating pairs).
- The baseline: the parameter server of PyTorch's ``torch.distributed.rpc`` tutorial
  ("Implementing a Parameter Server Using Distributed RPC Framework"): one model on the
  servers that every trainer trains (each server builds its part once, whichever trainer asks
  first, as the tutorial's ``get_parameter_server()``): the tables (``nn.Embedding(sparse=
  True)``, rows split by range) and, on server 0, the MLP. The trainer's forward calls the
  servers over RPC for the rows a batch looks up (deduplicated, as ours) and for the MLP's
  parameters, distributed autograd sends their gradients back, and ``DistributedOptimizer``
  steps SGD on the servers. ``shared=False`` is the design measured before: each trainer
  its own tables and a local MLP, i.e. two models trained apart.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp

BIG, SMALL = (1_000_000, 32), (100_000, 16)
LOOKUPS = (20, 6)
BATCH = 256
LR = 0.05


class DLRM(nn.Module):
    """Two embedding tables and an MLP over their concatenated rows."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Embedding(*BIG, sparse=sparse)
        self.small = nn.Embedding(*SMALL, sparse=sparse)
        width = LOOKUPS[0] * BIG[1] + LOOKUPS[1] * SMALL[1]
        self.mlp = MLP(width)

    def forward(self, big_ids: torch.Tensor, small_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([self.big(big_ids).flatten(1), self.small(small_ids).flatten(1)], 1)
        return self.mlp(rows)


def MLP(width: int) -> nn.Module:  # noqa: N802 - a layer, named like one
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 1))


def click_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, BIG[0], (BATCH, LOOKUPS[0]), generator=g),
            torch.randint(0, SMALL[0], (BATCH, LOOKUPS[1]), generator=g),
            torch.randint(0, 2, (BATCH,), generator=g).float())


# -- ours -----------------------------------------------------------------------------------
def ours_embedding(steps: int, sparse: bool = True, warmup: int = 3,
                   partitioner: Any = None) -> dict[str, Any]:
    """Every process: chief + workers + 2 servers; the chief times ``steps`` scheduled steps
    and reports the workers' bytes per step."""
    strategy = rp.ParameterServerStrategy(
        num_ps=2, variable_partitioner=partitioner or rp.ps.MinSizePartitioner(256 << 10, 2),
        shared_memory=sparse)
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = DLRM(sparse=sparse)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(seed: int) -> dict[str, Any]:
        big, small, y = click_batch(seed)
        before = strategy.traffic()
        loss = F.binary_cross_entropy_with_logits(model(big, small).squeeze(1), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = strategy.traffic()
        return {"loss": loss.detach(), "bytes": sum(after.values()) - sum(before.values())}

    for i in range(warmup):
        coordinator.schedule(step, args=(i,))
    coordinator.join()
    t0 = time.perf_counter()
    values = [coordinator.schedule(step, args=(warmup + i,)) for i in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - t0
    moved = [v.fetch()["bytes"] for v in values]
    return {"steps_per_s": steps / seconds, "bytes_per_step": sum(moved) / len(moved)}


# -- the rpc tutorial's design ------------------------------------------------------------------
class _TableServer(nn.Module):
    """The rows ``[start, end)`` of each table, on one server; server 0 also holds the MLP
    (with ``dense``)."""

    def __init__(self, index: int, servers: int, dense: bool) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.starts = [rows * index // servers for rows, _ in (BIG, SMALL)]
        ends = [rows * (index + 1) // servers for rows, _ in (BIG, SMALL)]
        self.tables = nn.ModuleList(nn.Embedding(e - s, dim, sparse=True) for s, e, (_, dim)
                                    in zip(self.starts, ends, (BIG, SMALL)))
        if dense:
            torch.manual_seed(0)
            self.mlp = MLP(LOOKUPS[0] * BIG[1] + LOOKUPS[1] * SMALL[1])

    def lookup(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        return self.tables[table](ids - self.starts[table])


#: The tutorial's ``get_parameter_server()``: one model per server process, whichever trainer
#: asks first builds it, every trainer gets an RRef to the same one.
_SERVER: _TableServer | None = None
_SERVER_LOCK = threading.Lock()


def _get_server(index: int, servers: int, dense: bool) -> _TableServer:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = _TableServer(index, servers, dense)
        return _SERVER


def _lookup(rref: Any, table: int, ids: torch.Tensor) -> torch.Tensor:
    return rref.local_value().lookup(table, ids)


def _mlp_values(rref: Any) -> list[torch.Tensor]:
    """The MLP's parameters, returned inside the trainer's distributed autograd context as
    views (distributed autograd sends back the gradients of results computed from a
    parameter, as a lookup's rows; a parameter returned as itself gets none)."""
    return [p.view_as(p) for p in rref.local_value().mlp.parameters()]


def _param_rrefs(rref: Any) -> list[Any]:
    from torch.distributed.rpc import RRef

    return [RRef(p) for p in rref.local_value().parameters()]


def _rpc_rows(rrefs: list[Any], table: int, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The trainer's side of a lookup: distinct ids to each server, rows back in order."""
    import torch.distributed.rpc as rpc

    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    bounds = [rows * k // len(rrefs) for k in range(len(rrefs) + 1)]
    futures = []
    for k, rref in enumerate(rrefs):
        lo = int(torch.searchsorted(unique, bounds[k]))
        hi = int(torch.searchsorted(unique, bounds[k + 1]))
        futures.append(rpc.rpc_async(rref.owner(), _lookup, args=(rref, table, unique[lo:hi])))
    got = torch.cat([f.wait() for f in futures])
    return got[inverse].reshape(*ids.shape, -1)


def _rpc_process(rank: int, world: int, port: int, steps: int, warmup: int, shared: bool,
                 queue: Any) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
    from torch.func import functional_call

    from replicator.launch.malloc_tuning import tune_malloc

    tune_malloc()  # the allocator settings the library's own workers run with
    torch.set_num_threads(1)
    trainers = world // 2
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              rpc_timeout=300)
    name = f"trainer{rank}" if rank < trainers else f"ps{rank - trainers}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank < trainers:
        build = _get_server if shared else _TableServer
        servers = [rpc.remote(f"ps{k}", build, args=(k, world - trainers, shared and k == 0))
                   for k in range(world - trainers)]
        torch.manual_seed(0)
        mlp = MLP(LOOKUPS[0] * BIG[1] + LOOKUPS[1] * SMALL[1])
        names = [n for n, _ in mlp.named_parameters()]
        params = [] if shared else [rpc.RRef(p) for p in mlp.parameters()]
        for s in servers:
            params += rpc.rpc_sync(s.owner(), _param_rrefs, args=(s,))
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)

        def step(seed: int) -> None:
            big, small, y = click_batch(seed)
            with dist_autograd.context() as cid:
                dense = rpc.rpc_async(servers[0].owner(), _mlp_values, args=(servers[0],)) \
                    if shared else None
                rows = torch.cat([_rpc_rows(servers, 0, big, BIG[0]).flatten(1),
                                  _rpc_rows(servers, 1, small, SMALL[0]).flatten(1)], 1)
                out = mlp(rows) if dense is None else \
                    functional_call(mlp, dict(zip(names, dense.wait())), (rows,))
                loss = F.binary_cross_entropy_with_logits(out.squeeze(1), y)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)

        for i in range(warmup):
            step(rank * 100_000 + i)
        queue.put(("ready", rank))
        t0 = time.perf_counter()
        for i in range(steps):
            step(rank * 100_000 + warmup + i)
        queue.put(("done", time.perf_counter() - t0))
    rpc.shutdown()


def rpc_embedding(steps: int, trainers: int = 2, servers: int = 2, warmup: int = 3,
                  shared: bool = True) -> float:
    """Steps per second of ``trainers`` trainers (``steps`` in all) against ``servers``.
    ``shared``: the tutorial's design, one model on the servers that every trainer trains
    (the MLP on server 0, fetched by each step and its gradient sent back, as ours does);
    ``False``: each trainer its own tables and its own local MLP (nothing shared between the
    trainers, no dense traffic)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = trainers + servers
    per = steps // trainers
    procs = [ctx.Process(target=_rpc_process,
                         args=(r, world, port, per, warmup, shared, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    times = []
    while len(times) < trainers:
        kind, value = queue.get(timeout=600)
        if kind == "done":
            times.append(value)
    for p in procs:
        p.join(120)
    return per * trainers / max(times)


# -- coordinator overhead ---------------------------------------------------------------------
def schedule_round_trip(rounds: int) -> dict[str, Any]:
    """Chief + 1 worker + 1 server: a scheduled no-op's round trip (schedule, then fetch)."""
    strategy = rp.ParameterServerStrategy(num_ps=1)
    coordinator = rp.ClusterCoordinator(strategy)

    def noop() -> int:
        return 0

    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        coordinator.schedule(noop).fetch()
        out.append((time.perf_counter() - t0) * 1e6)
    out.sort()
    return {"median_us": out[len(out) // 2]}


def mnist1d_data() -> tuple[torch.Tensor, torch.Tensor]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = 4000, 42
    d = make_dataset(args)
    return (torch.tensor(d["x"], dtype=torch.float32), torch.tensor(d["y"], dtype=torch.long))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, 40)), nn.Conv1d(1, 32, 5, stride=2, padding=1),
                         nn.ReLU(), nn.Conv1d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv1d(32, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 5, 10))


def mnist1d_throughput(kind: str, steps: int, per_worker_batch: int = 32) -> float | None:
    """Steps per second of the dense MNIST-1D CNN over 2 workers and 1 server, asynchronous:
    ``coordinator`` (the chief schedules, ``steps`` functions) or ``loop`` (each worker's own
    loop over ``strategy.distribute_dataset``, ``steps`` in all)."""
    from torch.utils.data import DataLoader, TensorDataset

    strategy = rp.ParameterServerStrategy(num_ps=1)
    coordinator = rp.ClusterCoordinator(strategy) if kind == "coordinator" else None
    with strategy.scope():
        model = _cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = mnist1d_data()
    if coordinator is not None:
        def input_fn(ctx: rp.InputContext) -> Any:
            loader = DataLoader(TensorDataset(x, y), batch_size=per_worker_batch, shuffle=True,
                                drop_last=True)
            while True:
                yield from loader

        it = iter(coordinator.create_per_worker_dataset(input_fn))

        def step(it: Any) -> None:
            bx, by = next(it)
            F.cross_entropy(model(bx), by).backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(4):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        t0 = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        return steps / (time.perf_counter() - t0)
    workers = strategy.num_replicas_in_sync
    loader = DataLoader(TensorDataset(x, y), batch_size=per_worker_batch * workers,
                        shuffle=True, drop_last=True)
    data = strategy.distribute_dataset(loader, seed=0)
    mine = steps // workers
    strategy.collectives.barrier()
    t0 = time.perf_counter()
    done = 0
    while done < mine:
        for bx, by in data:
            F.cross_entropy(model(bx), by).backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == mine:
                break
    strategy.collectives.barrier()  # both workers have finished their share
    seconds = time.perf_counter() - t0
    return mine * workers / seconds if strategy.replica_id == 0 else None

