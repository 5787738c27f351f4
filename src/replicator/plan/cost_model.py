"""The alpha-beta cost model: one step's time and memory per rank, per strategy.

Each strategy is one small cost function in :data:`COSTS`; :func:`predict` adds what every
setting pays. The formulas and their terms: docs/planning.md, "The cost model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from replicator.plan.devices import Device, Link
from replicator.plan.formulas import (
    OuterSync,
    allreduce_traffic_bytes,
    check_count,
    choose_outer_sync,
    fsdp_traffic_bytes,
    ps_queue_wait,
    ps_step_seconds,
    ring_allreduce_seconds,
)
from replicator.plan.profiles import MachineProfile, ModelProfile

__all__ = ["STRATEGIES", "Cluster", "Prediction", "predict", "slowdown", "straggler_wait_seconds"]

#: The strategies the planner predicts (the names ``rp.get_strategy`` knows).
STRATEGIES = ("one_device", "mirrored", "central_storage", "parameter_server", "fsdp",
              "pipeline", "diloco")

#: Memory a GPU process needs besides the model (CUDA context, allocator slack), nominal.
GPU_PROCESS_BYTES = 1.0e9
#: Microbatches of the pipeline the planner assumes (PipelineStrategy's default).
PIPELINE_MICROBATCHES = 4


# -- one setting ---------------------------------------------------------------------------
@dataclass
class Prediction:
    """The predicted step of one setting (``strategy`` on ``workers`` replicas)."""

    strategy: str
    workers: int
    processes: int
    hosts: int
    step_seconds: float
    samples_per_second: float
    breakdown: dict[str, float]
    memory_per_rank: float
    memory_capacity: float
    memory_detail: str
    feasible: bool = True
    why_not: str = ""
    notes: list[str] = field(default_factory=list)
    threads: int = 0  # threads per process the prediction assumes (0: the launcher's default)
    link_bytes: float | None = None  # bytes a host sends on the link per step, where counted
    spelling: str = ""  # the setting's constructor call where it takes settings (DiLoCo's H)

    @property
    def setting(self) -> str:
        return f"{self.strategy} x{self.workers}"

    @property
    def fits(self) -> bool:
        return self.feasible and self.memory_per_rank <= self.memory_capacity


@dataclass
class Cluster:
    """Where the workers run: a device type, the link between hosts, and this machine."""

    device: Device
    link: Link
    machine: MachineProfile
    ranks_per_host: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_host is not None:
            check_count(self.ranks_per_host, "ranks per host")

    def per_host(self) -> int:
        """Processes on one host: as given, else the device's count (cpu: one per core)."""
        return self.ranks_per_host or self.device.per_host or self.machine.cores

    def hosts(self, processes: int) -> int:
        return math.ceil(processes / self.per_host())

    def on_host(self, processes: int) -> int:
        return min(processes, self.per_host())


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def _compute(model: ModelProfile, c: Cluster, batch: float, busy_on_host: int) -> float:
    """Forward + backward of ``batch`` samples on one rank with ``busy_on_host`` busy ranks."""
    if not c.device.is_cpu:
        rate = c.device.flops_rate(model.compute_precision, model.tf32_fraction)
        return model.flops_per_sample * batch / (rate * c.device.mfu)
    if not model.measured or model.compute_fit == (0.0, 0.0):  # FLOPs at this host's rate
        one = model.flops_per_sample * batch / c.machine.flops_per_second
        if busy_on_host <= 1:  # every core on one process
            return one * c.machine.slowdown_for(c.machine.cores) / c.machine.cores
        return one * c.machine.slowdown_for(busy_on_host)
    if busy_on_host <= 1 and model.compute_seconds > 0:
        whole = model.compute_1thread(model.global_batch)  # all threads, scaled by the fit
        scale = model.compute_seconds / whole if whole > 0 else 1.0
        return model.compute_1thread(batch) * scale
    return model.compute_1thread(batch) * slowdown(model, c.machine, busy_on_host)


def slowdown(model: ModelProfile, machine: MachineProfile, busy: int) -> float:
    """One-thread ranks' contention, at most ``busy / S`` for a process ``S`` times faster."""
    slow = machine.slowdown_for(busy)
    speedup = model.thread_speedup()
    if busy > 1 and speedup > 1.0:
        slow = min(slow, max(1.0, busy / speedup))
    return slow


def _optimizer(model: ModelProfile, c: Cluster, share: float, busy_on_host: int) -> float:
    if not c.device.is_cpu:  # the step streams weights, gradients and state in and out
        return 2 * model.state_bytes * share / c.device.memory_bandwidth
    if not model.measured:
        return 2 * model.state_bytes * share / c.machine.memory_bandwidth
    return (model.optimizer_seconds * share if busy_on_host <= 1
            else model.optimizer_seconds_1thread * share * slowdown(model, c.machine, busy_on_host))


def _allreduce(c: Cluster, nbytes: float, n: int) -> float:
    """The all-reduce 'auto' would use: shared memory on one CPU host, hierarchical across."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k, h = c.on_host(n), c.hosts(n)
    if c.device.is_cpu:
        intra = c.machine.allreduce_seconds("shared_memory", nbytes, k) if k > 1 else 0.0
    else:
        intra = ring_allreduce_seconds(nbytes, k, c.device.intra_bandwidth, c.device.intra_alpha)
    return intra + ring_allreduce_seconds(nbytes, h, c.link.bandwidth, c.link.alpha)


def _fixed_collective(c: Cluster, n: int, measured: dict[int, float], nbytes: int) -> float:
    """A tiny collective: measured in a loop on CPU hosts (+ ``nbytes`` across), else all-reduce."""
    if n <= 1:
        return 0.0
    if c.device.is_cpu:
        return (c.machine.per_world(measured, c.on_host(n))
                + ring_allreduce_seconds(nbytes, c.hosts(n), c.link.bandwidth, c.link.alpha))
    return _allreduce(c, nbytes, n)


def straggler_wait_seconds(machine: MachineProfile, strategy: str, compute: float,
                           busy: int, units: int = 1) -> float:
    """A synchronous step's wait for its slowest rank on one CPU host (FSDP: per block)."""
    if strategy not in ("mirrored", "central_storage", "fsdp", "diloco") or busy <= 1:
        return 0.0
    stops = math.sqrt(3 * max(1, units)) if strategy == "fsdp" else 1.0
    return max(compute * (machine.straggle_for(busy) - 1.0) * stops,
               machine.sync_wait_for(busy) if strategy != "fsdp" else 0.0)


def pipeline_stages(workers: int, layers: int) -> int:
    """The largest divisor of ``workers`` at most ``layers`` (the rest: data-parallel)."""
    return max(d for d in range(1, min(workers, max(1, layers)) + 1) if workers % d == 0)


def _memory(model: ModelProfile, c: Cluster, strategy: str, n: int, batch: float,
            on_host: int) -> tuple[float, float, str]:
    """(bytes per rank, capacity per rank, the arithmetic as text)."""
    if c.device.is_cpu:
        base, capacity = c.machine.process_rss_bytes, c.machine.ram_bytes / max(1, on_host)
    else:
        base, capacity = GPU_PROCESS_BYTES, c.device.memory_bytes
    w, g, o = model.param_bytes, model.grad_bytes, model.optimizer_state_bytes
    act = model.activation_bytes_per_sample * batch
    state, how = w + g + o, f"{_gb(w)} weights + {_gb(g)} gradients + {_gb(o)} optimizer state"
    if strategy == "fsdp":
        state = state / n + 2 * model.largest_tensor_bytes
        how = f"({how}) / {n} + 2 x {_gb(model.largest_tensor_bytes)} gathered"
    elif strategy == "pipeline":
        stages = pipeline_stages(n, model.weight_tensors)
        state, act = state / stages, act / stages  # a stage keeps its layers' activations
        how = f"({how}) / {stages}"
    elif strategy == "diloco":
        state, how = state + 2 * w, f"{how} + {_gb(2 * w)} outer weights and momentum"
    elif strategy == "parameter_server":
        state = w + g
        how = f"{_gb(w)} weights + {_gb(g)} gradients (optimizer state on the servers)"
    total = state + act + base
    text = (f"{how} + {_gb(act)} activations + {_gb(base)} process = {_gb(total)} per rank, "
            f"of {_gb(capacity)}")
    return total, capacity, text


@dataclass
class _Step:
    """What every strategy's cost function reads."""

    strategy: str
    n: int
    m: ModelProfile
    c: Cluster
    num_ps: int
    microbatches: int

    @property
    def busy(self) -> int:
        return self.c.on_host(self.n)

    @property
    def cpu(self) -> bool:
        return self.c.device.is_cpu

    def compute(self, batch: float, busy: int | None = None) -> float:
        return _compute(self.m, self.c, batch, self.busy if busy is None else busy)


@dataclass
class _Costs:
    """One strategy's share of a step, and what the common part needs to know."""

    compute: float
    comm: float = 0.0
    overhead: float = 0.0
    opt_share: float = 1.0  # the share of the optimizer step a rank runs
    batch: float | None = None  # a rank's samples (default: the global batch over n)
    busy: int | None = None  # busy ranks on a host (default: the setting's)
    threads: int = 0
    ps_service: float = 0.0  # a parameter server's time per push (its queue)
    ps_claim: float = 0.0  # a parameter server's batch claim per step
    notes: list[str] = field(default_factory=list)
    link_bytes: float | None = None  # bytes a host sends on the link per step
    outer: OuterSync | None = None  # DiLoCo's outer synchronisation


def _one_device_costs(s: _Step) -> _Costs:
    """All threads of one process, or one thread where the profile measured that faster."""
    m = s.m
    compute = s.compute(m.global_batch, 1)
    if s.cpu and m.measured and m.threads > 1 and m.compute_fit != (0.0, 0.0):
        one = m.compute_1thread(m.global_batch) + m.optimizer_seconds_1thread \
            + m.input_seconds_1thread
        if one < 0.9 * (compute + m.optimizer_seconds + m.input_seconds):
            return _Costs(m.compute_1thread(m.global_batch), busy=1, threads=1, notes=[
                f"one thread (OMP_NUM_THREADS=1) measured faster than {m.threads}: the "
                "prediction uses it"])
    return _Costs(compute, busy=1)


def _allreduced(s: _Step, ranks: int) -> _Costs:
    """A replica's share of the batch, then its gradients all-reduced over ``ranks``."""
    compute = s.compute(s.m.global_batch / s.n)
    comm = _allreduce(s.c, s.m.grad_bytes, ranks)
    comm = max(0.0, comm - s.c.device.overlap * compute * 2 / 3)
    return _Costs(compute, comm, _fixed_collective(s.c, ranks, s.c.machine.sync_overhead, 16))


def _data_parallel_costs(s: _Step) -> _Costs:
    """Mirrored: every replica's gradients all-reduced every step."""
    costs = _allreduced(s, s.n)
    hosts = s.c.hosts(s.n)
    costs.link_bytes = allreduce_traffic_bytes(s.m.grad_bytes, hosts) if hosts > 1 else None
    return costs


def _diloco_costs(s: _Step) -> _Costs:
    """DiLoCo: Mirrored inside each host, an outer exchange across the hosts every H steps."""
    c, m = s.c, s.m
    costs = _allreduced(s, c.on_host(s.n))
    bandwidth = c.machine.memory_bandwidth if s.cpu else c.device.memory_bandwidth
    step = costs.compute + costs.comm + costs.overhead + _optimizer(m, c, 1.0, s.busy)
    costs.outer = outer = choose_outer_sync(step, m.param_bytes, c.hosts(s.n), c.link, bandwidth)
    costs.comm += outer.seconds_per_step
    costs.link_bytes = sent = outer.link_bytes_per_step
    costs.notes = [f"{outer.spelling()}: the hosts exchange every {outer.inner_steps} steps "
                   f"({_gb(sent) if sent >= 1e6 else f'{sent / 1e3:.3g} kB'} a host per step "
                   "on the link); not per-step synchronous training: compare its held-out "
                   "loss with Mirrored's (docs/strategies/diloco.md)"]
    return costs


def _central_storage_costs(s: _Step) -> _Costs:
    """Mirrored's reduce, then a broadcast of the parameters every rank waits for."""
    costs, c = _data_parallel_costs(s), s.c
    costs.comm += _fixed_collective(c, s.n, c.machine.small_collective, 8)
    if s.cpu and c.hosts(s.n) == 1:
        costs.comm += 2 * s.m.param_bytes / c.machine.memory_bandwidth \
            * c.machine.slowdown_for(s.busy)
        if s.busy <= c.machine.cores:
            costs.comm += _fixed_collective(c, s.n, c.machine.small_collective, 8)
    return costs


def fsdp_units(model: ModelProfile) -> int:
    """The blocks FSDP gathers one by one: as the probe saw them, else the weight tensors."""
    return max(1, model.fsdp_units or model.weight_tensors)


def _fsdp_costs(s: _Step) -> _Costs:
    """Blocks gathered for forward and backward, gradients reduce-scattered, state sharded."""
    c, n, m = s.c, s.n, s.m
    h = c.hosts(n)
    units = fsdp_units(m)
    state_ratio = m.optimizer_state_bytes / m.param_bytes if m.param_bytes else 0.0
    if s.cpu and h == 1:  # FSDP2 on gloo on one host: the measured cost per block and per byte
        fitted = c.machine.fsdp_block_seconds(n, state_ratio)
        if fitted is not None:
            comm = units * fitted[0] + fitted[1] * m.param_bytes
        else:  # or gloo's bytes
            alpha = c.machine.collective_alpha("native", n)
            bytes_part = c.machine.allreduce_seconds("native", m.param_bytes, n) - alpha
            per_unit = c.machine.per_world(c.machine.fsdp_unit, n) if c.machine.fsdp_unit \
                else 3 * alpha
            comm = units * per_unit + bytes_part * fsdp_traffic_bytes(1.0, n, gloo=True) \
                / allreduce_traffic_bytes(1.0, n)
    else:
        bandwidth = c.link.bandwidth if h > 1 else c.device.intra_bandwidth
        alpha = c.link.alpha if h > 1 else c.device.intra_alpha
        comm = fsdp_traffic_bytes(m.param_bytes, n, gloo=s.cpu) / bandwidth
        fitted = c.machine.fsdp_block_seconds(max(2, s.busy), state_ratio) if s.cpu else None
        if fitted is not None:
            # a block's own cost runs while its neighbours' bytes are on the wire
            comm = max(comm, units * fitted[0])
        comm += 3 * units * (n - 1) * alpha
    comm *= 1.0 - c.device.overlap * 0.5  # prefetching hides part of the all-gathers
    return _Costs(s.compute(m.global_batch / n), comm, opt_share=1.0 / n)


def _pipeline_costs(s: _Step) -> _Costs:
    """``microbatches + stages - 1`` slots of the busiest stage plus the sends between."""
    c, n, m = s.c, s.n, s.m
    stages = pipeline_stages(n, m.weight_tensors)
    data = max(1, n // stages)
    notes = [f"{stages} stages (the model has {m.weight_tensors} weight layers) x {data} "
             "data-parallel replicas"] if stages < n else []
    microbatches = max(s.microbatches, stages)
    per_mb = m.global_batch / data / microbatches
    boundary = (m.boundary_bytes_per_sample or m.activation_bytes_per_sample
                / max(2, m.weight_tensors)) * per_mb
    if s.cpu and c.hosts(n) == 1:  # the fixed part is in the measured slot
        send = c.machine.p2p.b * boundary
    else:
        send = boundary / (c.device.intra_bandwidth or c.link.bandwidth) + c.link.alpha
    slots = microbatches + stages - 1
    # one slot of the busiest stage: its FLOP share, its layers' fixed cost, the schedule's own
    fixed = s.compute(0.0)
    slot_fixed = fixed / stages
    if s.cpu and m.layer_calls:
        per_layer = m.layer_calls * c.machine.layer_call \
            + 3 * m.param_bytes / c.machine.memory_bandwidth
        slot_fixed = min(fixed, per_layer * c.machine.slowdown_for(s.busy)) / stages
    slot = slot_fixed + (s.compute(per_mb) - fixed) * m.stage_share(stages) \
        + (c.machine.pipeline_slot if s.cpu else 0.0)
    # a microbatch after the first adds its stage's gradients into .grad: two copies of the
    # stage's parameters (the largest tensor whole), a cost per byte, not per FLOP
    stage_bytes = max(m.param_bytes / stages, m.largest_tensor_bytes)
    bandwidth = c.machine.memory_bandwidth if s.cpu else c.device.memory_bandwidth
    compute = slots * slot + (microbatches - 1) * (2 * stage_bytes / bandwidth)
    if not m.pipeline_forward_backward:  # model(x) runs the stages' forward once more
        compute += s.compute(m.global_batch / data) * (m.forward_fraction or 1.0 / 3) \
            * m.stage_share(stages)
        notes.append("model(x) then loss.backward() runs one extra forward pass; "
                     "strategy.forward_backward avoids it")
    comm = 2 * slots * send + _allreduce(c, m.grad_bytes / stages, data)
    return _Costs(compute, comm, opt_share=1.0 / stages, batch=m.global_batch / data, notes=notes)


def _parameter_server_costs(s: _Step) -> _Costs:
    """Asynchronous workers' push and pull; servers (one thread each) run the optimizer."""
    c, n, m = s.c, s.n, s.m
    rt = c.machine.ps_round_trip
    server_update = (m.optimizer_seconds_1thread if s.cpu and m.measured
                     else _optimizer(m, c, 1.0, 1)) / s.num_ps
    if s.cpu and c.hosts(n) == 1:
        worker = rt.seconds(m.grad_bytes)
        # of the round trip's four copies per byte the server makes two
        slow = c.machine.slowdown_for(n) if n + s.num_ps > c.machine.cores else 1.0
        service = (rt.b * m.grad_bytes / 2 / s.num_ps + server_update) * slow
        claim = rt.a  # the next batch claimed from server 0 (exactly-once input)
    else:
        bw = c.link.bandwidth if c.hosts(n) > 1 else c.device.intra_bandwidth
        worker = ps_step_seconds(rt.a, m.grad_bytes, m.param_bytes, 1, 1, bw, c.link.alpha)
        slow = 1.0
        service = (m.grad_bytes + m.param_bytes) / (s.num_ps * bw) + server_update
        claim = 2 * (c.link.alpha if c.hosts(n) > 1 else c.device.intra_alpha)
    return _Costs(s.compute(m.global_batch / n), worker, server_update * slow, opt_share=0.0,
                  ps_service=service, ps_claim=claim, notes=[
                      "asynchronous: each worker steps on its own; the step is one worker's"])


#: One cost function per strategy the planner predicts.
COSTS = {"one_device": _one_device_costs, "mirrored": _data_parallel_costs,
         "central_storage": _central_storage_costs, "fsdp": _fsdp_costs,
         "pipeline": _pipeline_costs, "parameter_server": _parameter_server_costs,
         "diloco": _diloco_costs}


def _why_not(s: _Step) -> str:
    """Why the setting cannot run ("" when it can)."""
    m, n = s.m, s.n
    stages = pipeline_stages(n, m.weight_tensors)
    replicas = n if s.strategy != "pipeline" else n // stages
    if s.strategy == "one_device" and n != 1:
        return "one_device runs on one process"
    if s.strategy == "diloco" and s.c.hosts(n) == 1:
        return ("DiLoCo synchronises across hosts, and these processes fit on one host (plan "
                "several with --per-host)")
    if s.strategy == "diloco" and n % s.c.per_host():
        return (f"DiLoCo needs the same processes on every host: {n} do not fill hosts of "
                f"{s.c.per_host()}")
    if m.global_batch < replicas:
        return (f"the global batch of {m.global_batch} cannot be split across {replicas} "
                "replicas (each needs at least one sample)")
    if m.measured and m.global_batch % replicas:
        return (f"the global batch of {m.global_batch} does not split evenly over {replicas} "
                f"replicas, which the library requires (use a multiple of {replicas})")
    pieces = max(s.microbatches, stages)
    if s.strategy == "pipeline" and m.measured and (m.global_batch // replicas) % pieces:
        return (f"a replica's batch of {m.global_batch // replicas} does not split into "
                f"{pieces} microbatches")
    return ""


def _common_parts(s: _Step, k: _Costs) -> dict[str, float]:
    """The strategy's parts plus what every setting pays, and a parameter server's queue."""
    c, m, n = s.c, s.m, s.n
    busy = k.busy if k.busy is not None else s.busy
    batch = k.batch if k.batch is not None else m.global_batch / n
    comm = k.comm + (straggler_wait_seconds(c.machine, s.strategy, k.compute, busy,
                                            fsdp_units(m)) if s.cpu else 0.0)
    optimizer = m.optimizer_seconds_1thread if k.threads == 1 \
        else _optimizer(m, c, k.opt_share, busy)
    whole, slow = m.input_seconds, 1.0
    if s.cpu and m.measured and (busy > 1 or k.threads == 1):  # one thread per rank
        whole, slow = m.input_seconds_1thread or m.input_seconds, slowdown(m, c.machine, busy)
    # a replica's input: occasional gaps and the fixed cost, plus its share of the rest
    occasional = min(max(m.input_occasional_seconds, 0.0), whole)
    fixed = min(c.machine.input_fixed, whole - occasional)
    input_s = (occasional + fixed + (whole - occasional - fixed) * (batch / m.global_batch)) * slow
    # the user loop's own reduce/gather calls (a loss reduced every step)
    small = m.collectives_per_step * _fixed_collective(c, n, c.machine.small_collective, 8) \
        if n > 1 and m.collectives_per_step > 0 else 0.0
    parts = {"compute": k.compute, "communication": comm, "optimizer": optimizer,
             "input": input_s, "overhead": k.overhead + small}
    if s.strategy == "parameter_server":
        # the push and the batch claim queue at the server; its share of all traffic bounds it
        base = sum(parts.values()) + k.ps_claim
        wait = ps_queue_wait(base, n, k.ps_service)
        parts["input"] += k.ps_claim + wait
        parts["communication"] += wait + max(0.0, n * k.ps_service - base - 2 * wait)
    return parts


def predict(strategy: str, workers: int, model: ModelProfile, cluster: Cluster, *,
            num_ps: int = 1, microbatches: int = PIPELINE_MICROBATCHES) -> Prediction:
    """Predict ``strategy`` on ``workers`` replicas (a parameter server adds ``num_ps``)."""
    check_count(workers)
    if strategy not in COSTS:
        raise ValueError(f"unknown strategy {strategy!r} for the planner; known: "
                         f"{', '.join(STRATEGIES)}")
    s = _Step(strategy, workers, model, cluster, num_ps, microbatches)
    costs = COSTS[strategy](s)
    parts = _common_parts(s, costs)
    step = sum(parts.values())
    processes = workers + (num_ps if strategy == "parameter_server" else 0)
    hosts = cluster.hosts(workers)  # parameter servers run beside the workers
    on_host = cluster.on_host(workers) + (processes - workers if hosts == 1 else 0)
    batch = costs.batch if costs.batch is not None else model.global_batch / workers
    mem, cap, text = _memory(model, cluster, strategy, workers, batch, on_host if s.cpu else 1)
    why_not = _why_not(s)
    return Prediction(strategy, workers, processes, hosts, step,
                      model.global_batch / step if step > 0 else math.inf, parts, mem, cap,
                      text, feasible=not why_not, why_not=why_not, notes=costs.notes,
                      threads=costs.threads, link_bytes=costs.link_bytes,
                      spelling=costs.outer.spelling() if costs.outer else "")
