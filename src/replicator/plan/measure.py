"""What the planner measures on this machine, once (cached in ``bench/machine.json``), in
processes of ``rp.launch``: contention, collectives, the engines' costs beyond the compute, the
input's fixed cost, memory and cores (docs/planning.md, "What is measured, what is assumed")."""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replicator.plan.profiles import MACHINE_VERSION, AlphaBeta, MachineProfile

__all__ = ["measure_machine", "ram_bytes"]

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
#: Rows per rank of the reference training loop the wait for a descheduled rank is taken on.
REFERENCE_ROWS = 32
#: Width of the wide blocks FSDP's per-byte cost is measured on (1 MB of weights each).
WIDE = 512
#: Gradient sizes a parameter server's round trip is measured at (1 kB to 8 MB).
PS_SIZES = (256, 1 << 18, 1 << 20, 1 << 21)
#: The figures measured per world size, as :class:`MachineProfile` names them.
PER_WORLD = ("sync_overhead", "sync_wait", "small_collective", "fsdp_unit", "fsdp_unit_adam",
             "fsdp_wide_sgd", "fsdp_wide_adam")


def ram_bytes() -> float:
    """Total memory of this machine (``/proc/meminfo``), or 0 when unreadable."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    return 0.0


def median_time(fn: Callable[[], Any], rounds: int, per_round: int = 1, warm: int = 0
                ) -> float:
    """Median over ``rounds`` of ``per_round`` calls' time per call, after ``warm`` calls."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append((time.perf_counter() - t0) / per_round)
    return statistics.median(times)


def _fastest_alternately(a: Callable[[], Any], b: Callable[[], Any], rounds: int,
                         per_round: int) -> tuple[float, float]:
    """The fastest of ``rounds`` rounds of ``per_round`` calls, per call, of ``a`` and of ``b``
    measured in turns: both meet the same neighbours, and their difference is the least
    disturbed one (medians measured one after the other made a busy machine's difference 0)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((a, b), times):
            out.append(median_time(fn, 1, per_round))
    return min(times[0]), min(times[1])


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one thread inside the block (then the count as it was)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _busy_work(seconds_alone: float | None = None, iterations: int = 0) -> tuple[float, int]:
    """A fixed amount of one-thread compute (matmuls, as a model's layers do)."""
    x = torch.randn(192, 192)
    w = torch.randn(192, 192)
    if not iterations:
        iterations, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < (seconds_alone or 0.3):
            x = torch.tanh(x @ w * 0.01)
            iterations += 1
    t0 = time.perf_counter()
    for _ in range(iterations):
        x = torch.tanh(x @ w * 0.01)
    return time.perf_counter() - t0, iterations


def _input_fixed_seconds() -> float:
    """The input pipeline's cost per batch of samples that cost nothing (one thread)."""
    from torch.utils.data import DataLoader, TensorDataset

    from replicator.strategies import OneDeviceStrategy

    with _one_thread():
        data = TensorDataset(torch.randn(400, 4), torch.zeros(400, dtype=torch.int64))
        dist = OneDeviceStrategy("cpu").distribute_dataset(DataLoader(data, batch_size=2))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            n = sum(1 for _ in dist)
            times.append((time.perf_counter() - t0) / max(1, n))
    return statistics.median(times)


def _contention(rank: int, world: int, rounds: int = 3, steps: int = 8
                ) -> tuple[dict[int, float], dict[int, float]]:
    """Per 1..world busy ranks: a rank's slowdown, and a synchronous loop's wait for the slowest."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # rank 0's iterations for 0.25 s and 0.025 s of work, the same work on every rank
    flag = torch.tensor([_busy_work(0.25)[1], _busy_work(0.025)[1]] if rank == 0 else [0, 0],
                        dtype=torch.int64)
    dist.broadcast(flag, 0)
    long_iters, short_iters = int(flag[0]), int(flag[1])
    token = torch.zeros(1)

    def mean_of_active(value: float, n: int) -> float:
        parts = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(parts, torch.tensor([value]))
        return statistics.mean(float(p[0]) for p in parts[:n])

    slowdown: dict[int, float] = {}
    straggle: dict[int, float] = {}
    alone = None
    for n in range(1, world + 1):
        means = []
        for _ in range(rounds):
            dist.barrier()
            elapsed = _busy_work(iterations=long_iters)[0] if rank < n else 0.0
            means.append(mean_of_active(elapsed, n))
        mean = statistics.median(means)
        alone = mean if alone is None else alone
        slowdown[n] = mean / alone
        dist.barrier()
        worked, t0 = 0.0, time.perf_counter()
        for _ in range(steps):  # a synchronous step: work, then wait for every rank
            if rank < n:
                worked += _busy_work(iterations=short_iters)[0]
            dist.all_reduce(token)
        loop = (time.perf_counter() - t0) / steps
        straggle[n] = max(1.0, loop / max(mean_of_active(worked / steps, n), 1e-9))
    return slowdown, straggle


def _allreduce_curves(world: int) -> dict[str, list[list[float]]]:
    """Median seconds per all-reduce for each algorithm and size."""
    import replicator as rp

    algos: dict[str, Any] = {"shared_memory": rp.comm.SharedMemoryAllReduce(),
                             "native": rp.comm.NativeAllReduce(), "ring": rp.comm.RingAllReduce()}
    curves: dict[str, list[list[float]]] = {}
    for name, algo in algos.items():
        points = []
        for size in SIZES:
            t = (algo.make_buffers([(size // 4, torch.float32, torch.device("cpu"))])[0]
                 if name == "shared_memory" else torch.empty(size // 4))
            t.fill_(1.0)
            per_round = max(1, min(20, (4 << 20) // size))

            def call(a: Any = algo, x: torch.Tensor = t) -> None:
                a.all_reduce_sum(x)

            # the first call warms up segments and connections
            points.append([float(size), median_time(call, 5, per_round, warm=1)])
        curves[name] = points
    return curves


# -- the engines' costs beyond the compute, on a chain of small blocks ----------------------
def tiny_chain(blocks: int = 4, width: int = 8) -> torch.nn.Sequential:
    """The calibration model: ``blocks`` Linear(width, width) layers in a chain."""
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD, or Adam (its state is what a sharded optimizer step touches per parameter)."""
    return (torch.optim.Adam if kind == "adam" else torch.optim.SGD)(model.parameters(), lr=0.0)


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             y: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """A loop's step on ``x`` (cross-entropy against ``y``, else the output's sum)."""

    def step() -> torch.Tensor:
        loss = model(x).sum() if y is None else torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _forward_backward_seconds(model: torch.nn.Module, x: torch.Tensor, rounds: int = 5
                              ) -> float:
    """Forward and backward of ``model`` on ``x``, before any strategy owns a module."""
    return median_time(lambda: model(x).sum().backward(), rounds, 10, warm=1)


def _local_backward_seconds() -> float:
    """Forward and backward of a plain ``Linear(8, 8)`` on 8 rows."""
    return _forward_backward_seconds(torch.nn.Linear(8, 8), torch.randn(8, 8), rounds=7)


def local_step_seconds(batch: int = 8, width: int = 8, optimizer: str = "sgd") -> float:
    """The 4-block model's step without any strategy (measured before one exists)."""
    model = tiny_chain(width=width)
    opt = make_optimizer(optimizer, model)
    return median_time(sgd_step(model, opt, torch.randn(batch, width)), 5, 10, warm=1)


def strategy_step_overhead(name: str, t_local: float, batch: int = 8, width: int = 8,
                           optimizer: str = "sgd", rounds: int = 5, per_round: int = 4,
                           reduce_seconds: float | None = None) -> float:
    """What ``rp.get_strategy(name)`` adds to the chain's step (``t_local`` without it)."""
    import replicator as rp

    strategy = rp.get_strategy(name)
    with strategy.scope():
        torch.manual_seed(0)
        model = tiny_chain(width=width)
        opt = make_optimizer(optimizer, model)
    step = sgd_step(model, opt, torch.randn(batch, width))

    def one() -> None:
        out = strategy.run(step)
        if reduce_seconds is not None:
            strategy.reduce("mean", out)

    seconds = median_time(one, rounds, per_round, warm=3)
    strategy.close()
    return max(0.0, seconds - t_local - (reduce_seconds or 0.0))


def pipeline_slot_seconds(t_chain: float, t_chain_fb: float, layer_call: float,
                          stages: int = 2, microbatches: int = 4) -> float:
    """The schedule's own cost per slot, beyond what the cost model counts apart."""
    slots = microbatches + stages - 1
    # point-to-point waits vary from step to step: 11 x 10 steps (about half a second)
    t_pipe = strategy_step_overhead("pipeline", t_chain, rounds=11, per_round=10) + t_chain
    counted = (slots * layer_call * 4 / stages + t_chain_fb / stages / 3
               + max(0.0, t_chain - t_chain_fb) / stages)
    return max(0.0, t_pipe - counted) / slots


# -- the reference training loop and the engine's overheads ---------------------------------
def _reference_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 10k-parameter MLP with Adam: a short step that is mostly fixed costs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 100), torch.nn.ReLU(),
                                torch.nn.Linear(100, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _reference_batch(rows: int = REFERENCE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, 20, generator=generator),
            torch.randint(0, 10, (rows,), generator=generator))


def _reference_step_seconds() -> float:
    """The reference loop's step in one thread with nothing else running (no strategy)."""
    with _one_thread():
        return median_time(sgd_step(*_reference_model(), *_reference_batch()), 7, 20, warm=20)


def _engine_overheads(t_local: float, reference_alone: float = 0.0, slowdown: float = 1.0
                      ) -> tuple[float, float, float]:
    """(sync per backward pass, a scalar reduce, a synchronous loop's wait for its last rank)."""
    import replicator as rp

    strategy = rp.MirroredStrategy()
    x = torch.randn(8, 8)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        reference, reference_opt = _reference_model()
    loop_step = sgd_step(reference, reference_opt, *_reference_batch())
    t_sync = median_time(lambda: model(x).sum().backward(), 7, 10, warm=5)
    value = torch.tensor(1.0)
    t_reduce = median_time(lambda: strategy.reduce("mean", value), 7, 10, warm=1)
    sync = max(0.0, t_sync - t_local)
    wait = 0.0
    if reference_alone > 0:

        def loop() -> None:
            strategy.reduce("mean", strategy.run(loop_step))

        for _ in range(20):
            loop()
        strategy.barrier()
        t_loop = median_time(loop, 7, 30)
        wait = max(0.0, t_loop - reference_alone * slowdown - sync - t_reduce)
    return sync, t_reduce, wait


def _p2p(rank: int) -> list[list[float]]:
    import torch.distributed as dist

    points = []
    for size in (4 << 10, 1 << 20, 8 << 20):
        t = torch.zeros(size // 4)

        def exchange(x: torch.Tensor = t) -> None:  # rank 0 sends first, rank 1 answers
            for op in (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send):
                op(x, 1 - rank)

        points.append([float(size), median_time(exchange, 5, 3, warm=1) / 2])
    return points


def _worker_two(world: int, reference_alone: float = 0.0) -> dict[str, Any]:
    """The measurements made with ``world`` local processes (rank 0's result is used)."""
    import replicator as rp

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.set_num_threads(1)
    t_local = _local_backward_seconds()
    t_chain = local_step_seconds()
    if world == 2:  # for the pipeline's slot, measured with 2 processes only
        t_chain_fb = _forward_backward_seconds(tiny_chain(4), torch.randn(8, 8))
        # one small layer's call beyond the engine's fixed cost (a stage's per layer and slot)
        layer_call = max(0.0, (_forward_backward_seconds(tiny_chain(4), torch.randn(2, 8))
                               - _forward_backward_seconds(tiny_chain(2), torch.randn(2, 8))) / 2)
    t_chain_adam = local_step_seconds(optimizer="adam")
    t_wide = {kind: local_step_seconds(width=WIDE, optimizer=kind) for kind in ("sgd", "adam")}
    strategy = rp.MirroredStrategy()  # starts the process group
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, Any] = {"rss": float(rss)}
    out["contention"], out["straggle"] = _contention(rank, world)
    torch.set_num_threads(1)
    out["allreduce"] = _allreduce_curves(world)
    out["sync_overhead"], out["small_collective"], out["sync_wait"] = _engine_overheads(
        t_local, reference_alone, slowdown=float(out["contention"].get(world, 1.0)))
    if world == 2:
        out["p2p"] = _p2p(rank)
    strategy.barrier()
    strategy.close()  # a strategy refuses gradients of models it does not own: one at a time
    # FSDP's cost per block in a training loop's steps (the reduced loss waits for the last)
    reduce = float(out["small_collective"])
    out["fsdp_unit"] = strategy_step_overhead("fsdp", t_chain, reduce_seconds=reduce) / 4
    # with Adam: the sharded step on DTensors, a cost per block; 11 x 10 steps (5 x 4 varied)
    out["fsdp_unit_adam"] = strategy_step_overhead(
        "fsdp", t_chain_adam, optimizer="adam", rounds=11, per_round=10, reduce_seconds=reduce) / 4
    for kind in ("sgd", "adam"):  # the same blocks 64x wider: the cost per byte of a block
        out[f"fsdp_wide_{kind}"] = strategy_step_overhead(
            "fsdp", t_wide[kind], width=WIDE, optimizer=kind, reduce_seconds=reduce) / 4
    if world == 2:  # PipelineStrategy(): 2 stages, 4 microbatches, 5 slots per step
        out["pipeline_slot"] = pipeline_slot_seconds(t_chain, t_chain_fb, layer_call)
        out["layer_call"] = layer_call
    return out


# -- a parameter server's round trip -----------------------------------------------------
class _Weights(torch.nn.Module):
    """A model that is only its weights, so that the round trip is not lost in a layer's compute."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _weights_backward_seconds(size: int) -> float:
    """Forward + backward of :class:`_Weights`, measured before any strategy exists."""
    plain, x = _Weights(size), torch.tensor(2.0)

    def local() -> None:
        plain(x).backward()
        plain.w.grad = None

    return median_time(local, 7, 10, warm=1)


def _ps_worker() -> dict[str, Any] | None:
    """A parameter server's round trip, 1 kB to 8 MB, between 1 ms pieces of workers' compute."""
    import replicator as rp

    local = {n: _weights_backward_seconds(n) for n in PS_SIZES}
    iterations = _busy_work(1e-3)[1]

    def work() -> None:
        _busy_work(iterations=iterations)

    strategy = rp.ParameterServerStrategy(num_ps=1)  # a server serves here and never returns
    points = []
    x = torch.tensor(2.0)
    for size in PS_SIZES:
        with strategy.scope():
            model = _Weights(size)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)

        def step(m: torch.nn.Module = model, o: torch.optim.Optimizer = opt) -> None:
            work()
            m(x).backward()
            o.step()
            o.zero_grad()

        step()
        t_work, t_all = _fastest_alternately(work, step, 7, 5)  # the other worker is busy too
        points.append([float(size * 4), max(0.0, t_all - t_work - local[size])])
    return {"ps": points}


def measure_machine(log: Callable[[str], None] = print, worlds: tuple[int, ...] = (2, 3, 4)
                    ) -> MachineProfile:
    """Measure this machine (see the module doc); ``log`` gets one line per part."""
    from replicator.launch import launch

    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1  # not Linux
    profile = MachineProfile(cores=cores, ram_bytes=ram_bytes() or 8e9, slowdown={1: 1.0},
                             source="measured", version=MACHINE_VERSION)
    with _one_thread():  # one thread's matmul FLOP/s and copy bytes/s (models known by size)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        profile.flops_per_second = 2 * 256 ** 3 / median_time(lambda: a @ b, 5, 20)
        src = torch.randn(16 << 20)
        dst = torch.empty_like(src)
        profile.memory_bandwidth = src.numel() * 4 / median_time(lambda: dst.copy_(src), 5, 2)
    profile.input_fixed = _input_fixed_seconds()
    reference_alone = _reference_step_seconds()
    for world in worlds:
        log(f"measuring with {world} local processes (contention, all-reduce, engine) ...")
        result = launch(_worker_two, num_replicas=world, args=(world, reference_alone))[0]
        profile.slowdown.update({int(k): float(v) for k, v in result["contention"].items()})
        profile.straggle.update({int(k): float(v) for k, v in result["straggle"].items()})
        for name, points in result["allreduce"].items():
            profile.allreduce.setdefault(name, {})[world] = AlphaBeta.fit(*zip(*points))
        for key in PER_WORLD:
            getattr(profile, key)[world] = result[key]
        if "pipeline_slot" in result:
            profile.pipeline_slot = result["pipeline_slot"]
            profile.layer_call = result["layer_call"]
        if "p2p" in result:
            profile.p2p = AlphaBeta.fit(*zip(*result["p2p"]))
        if world == worlds[0]:
            profile.process_rss_bytes = result["rss"]
    log("measuring a parameter-server round trip ...")
    ps = launch(_ps_worker, num_replicas=3, num_ps=1)[0]  # two workers, one server
    if ps:
        profile.ps_round_trip = AlphaBeta.fit(*zip(*ps["ps"]))
    profile.measured_at = datetime.datetime.now().isoformat(timespec="seconds")
    profile.load_average = max(load, os.getloadavg()[0])
    return profile
