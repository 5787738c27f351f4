"""ParameterServerStrategy: stragglers, and the transport against torch.distributed.rpc.

- ``straggler``: time for the chief to reach a target loss, asynchronous ParameterServer
  (3 workers + 1 server) / a synchronous baseline (3 workers), one worker slowed 3x per step
  (it sleeps twice its compute time). Goal <= 0.6.
- ``no_straggler``: the same without the slow worker. Goal <= 1.3.
- ``vs_rpc``: push+pull round trips per second of a 10 MB model, ours (1 worker + 1 server)
  / a parameter server written with ``torch.distributed.rpc`` in the pattern of PyTorch's
  batch-updating parameter-server tutorial (``rpc_sync(update_and_fetch_model, grads)``).
  Goal >= 1.5. Worker and server share this host, so our payloads go through shared memory;
  the same figure with payloads on the TCP socket (``shared_memory=False``) is shown beside
  it for reference.

Embedding tables and the coordinator (``benchmarks/_ps_embedding.py`` has the models and
the baseline; a DLRM-like model: tables of 1M x 32 and 100k x 16 floats, batch 256, 26
lookups per sample, a 3-layer MLP; 2 workers and 2 servers, scheduled by the coordinator):

- ``bytes_sparse_vs_dense``: bytes a worker moves per step with sparse tables (rows looked up,
  deduplicated, and their gradients) / the same model with ``sparse=False`` (the tables
  travel whole both ways). Goal <= 0.01.
- ``embedding_vs_rpc``: steps/s, ours / the parameter server of PyTorch's
  ``torch.distributed.rpc`` tutorial training the same shared model (the servers own the
  tables and the MLP, built once per server as the tutorial's ``get_parameter_server()``
  does; the trainer's forward fetches the same deduplicated rows and the MLP's parameters
  over RPC, distributed autograd sends their gradients back, ``DistributedOptimizer``).
  Goal >= 2. Beside it, for reference, the design this row used before: each trainer its own
  tables and a local MLP (two models trained apart, no dense traffic).
- ``schedule_us``: a scheduled no-op's round trip, ``schedule(noop).fetch()``, in
  microseconds (reported).
- ``coordinator_vs_loop``: steps/s of the dense MNIST-1D CNN over 2 workers and 1 server,
  asynchronous, scheduled by the coordinator / each worker's own loop. Goal >= 0.9.

The synchronous baseline is ``MirroredStrategy`` (``--sync-baseline mirrored``, the default)
or torch's ``DistributedDataParallel`` (``--sync-baseline ddp``), which Mirrored matches
within a few percent (benchmarks/mirrored_overhead.py).

Every process of both sides allocates each step's gradients anew (10 MB for ``vs_rpc``).
glibc's adaptive threshold then serves such blocks either from the heap (reused) or from fresh
mmaps (about 2,500 page faults, some 2.5 ms per 10 MB), by chance per process, which made runs
bimodal. The benchmark fixes both thresholds for every process it starts
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``; ``--default-malloc`` leaves them).

Run: ``python benchmarks/parameter_server.py [--target 0.35] [--rounds 20]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks import _ps_embedding as E  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402

WORKERS = 3
PER_WORKER_BATCH = 32
MAX_STEPS = 1500


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _data() -> tuple[torch.utils.data.TensorDataset, torch.Tensor, torch.Tensor]:
    from replicator.demo.digits import load_digits_split

    train, test = load_digits_split()
    x, y = train.tensors
    return torch.utils.data.TensorDataset(x.flatten(1), y), test.tensors[0].flatten(1), \
        test.tensors[1]


def time_to_target(kind: str, target: float, slow: bool, stop_key: str = "bench/stop") -> dict:
    """One training run; the chief returns the seconds until its eval loss <= ``target``
    (asynchronous workers stop when ``stop_key``, unique to the run, appears in the store)."""
    from torch.utils.data import DataLoader

    from replicator.cluster.process_group import current_group, initialize

    if kind == "ps":
        strategy: rp.Strategy = rp.ParameterServerStrategy(num_ps=1)
    elif kind == "mirrored":
        strategy = rp.MirroredStrategy()
    else:
        strategy = rp.OneDeviceStrategy("cpu")  # DDP below; the strategy only splits the data
        initialize()
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train, ex, ey = _data()
    if kind == "ddp":
        from torch.utils.data.distributed import DistributedSampler

        batches = DataLoader(train, batch_size=PER_WORKER_BATCH, drop_last=True,
                             sampler=DistributedSampler(train, shuffle=True, seed=0))
    else:
        loader = DataLoader(train, batch_size=PER_WORKER_BATCH * WORKERS, shuffle=True,
                            drop_last=True)
        batches = strategy.distribute_dataset(loader, seed=0)
    store = current_group().store  # type: ignore[union-attr]
    sync = kind != "ps"
    # every worker starts the clock together: asynchronous workers that set up sooner must not
    # train the shared model before the chief's clock runs
    store.add(f"{stop_key}/ready", 1)
    deadline = time.monotonic() + 120
    while store.add(f"{stop_key}/ready", 0) < WORKERS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other workers did not get ready within 120 s")
        time.sleep(0.001)
    start = time.perf_counter()
    reached, steps, epoch = None, 0, 0
    while reached is None and steps < MAX_STEPS:
        if kind == "ddp":
            batches.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        epoch += 1
        for x, y in batches:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if slow and rank == WORKERS - 1:
                time.sleep(2 * (time.perf_counter() - t0))  # 3x slower per step
            done = 0.0
            if rank == 0 and steps % 5 == 0:
                with torch.no_grad():
                    if F.cross_entropy(model(ex), ey).item() <= target:
                        reached = time.perf_counter() - start
                        done = 1.0
            if sync:
                flag = torch.tensor([done])
                torch.distributed.all_reduce(flag, group=getattr(strategy, "_data_group", None))
                if flag.item() and reached is None:
                    reached = time.perf_counter() - start
            elif done:
                store.set(stop_key, "1")
            elif store.check([stop_key]):
                reached = time.perf_counter() - start
            if reached is not None:
                break
    return {"seconds": reached, "steps": steps}


def _straggler(target: float, baseline: str, slow: bool) -> tuple[float, float]:
    # a key of its own: a key left by an earlier run must not stop this one at its first step
    ours = rp.launch(time_to_target, num_replicas=WORKERS + 1, num_ps=1,
                     args=("ps", target, slow, f"bench/stop/{os.getpid()}/{time.time_ns()}"))[0]
    base = rp.launch(time_to_target, num_replicas=WORKERS,
                     args=(baseline, target, slow, f"bench/stop/{os.getpid()}/{time.time_ns()}"))[0]
    if ours["seconds"] is None or base["seconds"] is None:
        raise RuntimeError(f"the target loss {target} was not reached in {MAX_STEPS} steps "
                           f"(ours {ours}, baseline {base}); choose a higher --target")
    return ours["seconds"], base["seconds"]


# -- transport: ours vs the rpc tutorial's pattern ----------------------------------------------
MODEL_FLOATS = 10 * 2 ** 20 // 4  # 10 MB of float32


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, MODEL_FLOATS // 1024 - 1))  # ~10 MB with the bias


def round_trips_ours(rounds: int, shared_memory: bool = True) -> list[float]:
    """Worker side: each ``optimizer.step()`` pushes the gradients and pulls the values."""
    strategy = rp.ParameterServerStrategy(num_ps=1, shared_memory=shared_memory)
    with strategy.scope():
        model = _big_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # the first step also sends the optimizer's description
    if strategy.shared_memory != [shared_memory]:
        raise RuntimeError(f"asked for shared_memory={shared_memory}, got "
                           f"{strategy.shared_memory}")
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
        out.append(5 / (time.perf_counter() - t0))
    return out


class _TutorialServer:
    """The batch-updating parameter server of PyTorch's rpc tutorial (one worker here)."""

    def __init__(self) -> None:
        self.model = _big_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    def update_and_fetch_model(ps_rref, grads: list[torch.Tensor]) -> nn.Module:  # noqa: ANN001
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad()
        return self.model


def _rpc_process(rank: int, port: int, rounds: int, queue: mp.Queue) -> None:
    import torch.distributed.rpc as rpc

    from replicator.launch.malloc_tuning import tune_malloc

    tune_malloc()  # the allocator settings the library's own workers run with
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              rpc_timeout=120)
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        ps_rref = rpc.remote("p1", _TutorialServer)
        model = ps_rref.rpc_sync().get_model()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(5):
                grads = [torch.ones_like(p) for p in model.parameters()]
                model = rpc.rpc_sync("p1", _TutorialServer.update_and_fetch_model,
                                     args=(ps_rref, grads))
            out.append(5 / (time.perf_counter() - t0))
        queue.put(out)
    rpc.shutdown()


def round_trips_rpc(rounds: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rpc_process, args=(r, port, rounds, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=float, default=0.35, help="eval loss to reach")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sync-baseline", choices=("mirrored", "ddp"), default="mirrored")
    parser.add_argument("--only", choices=("straggler", "vs_rpc", "embedding", "coordinator"),
                        default=None)
    parser.add_argument("--embedding-steps", type=int, default=1000)
    parser.add_argument("--mnist-steps", type=int, default=300)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's adaptive malloc thresholds (see the module doc)")
    args = parser.parse_args()
    if not args.default_malloc:  # inherited by every process the runs start, on both sides
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
    rows = []
    if args.only in (None, "straggler"):
        s_ours, s_base = _straggler(args.target, args.sync_baseline, slow=True)
        n_ours, n_base = _straggler(args.target, args.sync_baseline, slow=False)
        rows += [["straggler (s to target)", s_ours, s_base, s_ours / s_base],
                 ["no straggler (s to target)", n_ours, n_base, n_ours / n_base]]
    if args.only in (None, "vs_rpc"):
        ours = median(rp.launch(round_trips_ours, num_replicas=2, num_ps=1,
                                args=(args.rounds,))[0])
        rpc = median(round_trips_rpc(args.rounds))
        tcp = median(rp.launch(round_trips_ours, num_replicas=2, num_ps=1,
                               args=(args.rounds, False))[0])
        rows.append(["10 MB push+pull per s", ours, rpc, ours / rpc])
        tcp_row = ["  the same, payloads on TCP", tcp, rpc, tcp / rpc]
    more: list[tuple[str, float, float, float, str]] = []
    if args.only in (None, "embedding"):
        sparse = rp.launch(E.ours_embedding, num_replicas=5, num_ps=2,
                           args=(args.embedding_steps,))[0]
        # one step moves 269 MB here: bytes are counted within the step, so one is enough
        dense = rp.launch(E.ours_embedding, num_replicas=4, num_ps=2, args=(1,),
                          kwargs={"sparse": False, "warmup": 0})[0]
        rpc_rate = E.rpc_embedding(args.embedding_steps)
        apart = E.rpc_embedding(args.embedding_steps, shared=False)
        more += [("bytes_sparse_vs_dense", sparse["bytes_per_step"], dense["bytes_per_step"],
                  sparse["bytes_per_step"] / dense["bytes_per_step"], "<= 0.01"),
                 ("embedding_vs_rpc", sparse["steps_per_s"], rpc_rate,
                  sparse["steps_per_s"] / rpc_rate, ">= 2")]
        apart_row = ["  rpc, each trainer its own model", sparse["steps_per_s"], apart,
                     sparse["steps_per_s"] / apart]
    if args.only in (None, "coordinator"):
        us = rp.launch(E.schedule_round_trip, num_replicas=3, num_ps=1, args=(200,))[0]
        coord = rp.launch(E.mnist1d_throughput, num_replicas=4, num_ps=1,
                          args=("coordinator", args.mnist_steps))[0]
        loop = rp.launch(E.mnist1d_throughput, num_replicas=3, num_ps=1,
                         args=("loop", args.mnist_steps))[0]
        more += [("schedule_us", us["median_us"], 0.0, us["median_us"], "report"),
                 ("coordinator_vs_loop", coord, loop, coord / loop, ">= 0.9")]
    print(f"\nParameterServerStrategy vs {args.sync_baseline} / torch.distributed.rpc")
    print_table(["figure", "ours", "baseline", "ratio"],
                rows + ([tcp_row] if args.only in (None, "vs_rpc") else [])
                + [[name, o, b, r] for name, o, b, r, _ in more]
                + ([apart_row] if args.only in (None, "embedding") else []))
    print()
    for name, o, b, r, goal in more:
        extra = {"baseline_each_its_own": round(apart, 4)} if name == "embedding_vs_rpc" else {}
        emit("parameter_server", name, r, goal, ours=round(o, 4), baseline=round(b, 4), **extra)
    for row in rows:
        name = {"straggler (s to target)": "straggler", "no straggler (s to target)":
                "no_straggler", "10 MB push+pull per s": "vs_rpc"}[row[0]]
        goal = {"straggler": "<= 0.6", "no_straggler": "<= 1.3", "vs_rpc": ">= 1.5"}[name]
        extra = {"ours_tcp": round(tcp, 4)} if name == "vs_rpc" else {}
        emit("parameter_server", name, row[3], goal, ours=round(row[1], 4),
             baseline=round(row[2], 4),
             baseline_kind="rpc" if name == "vs_rpc" else args.sync_baseline, **extra)


if __name__ == "__main__":
    main()
