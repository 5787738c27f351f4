"""What the planner knows: a model's profile (measured, or estimated from its size) and this
machine's (measured once, or nominal), both saved as JSON. Seconds and bytes."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["AlphaBeta", "MachineProfile", "ModelProfile", "kept_steps", "machine_profile_cached",
           "median_json"]

#: Bytes of one block FSDP's costs are measured on: ``Linear(8, 8)`` and ``Linear(512, 512)``
#: (weight and bias, float32), see :mod:`replicator.plan.measure`.
FSDP_NARROW_BYTES = 8 * 9 * 4
FSDP_WIDE_BYTES = 512 * 513 * 4


@dataclass(frozen=True)
class AlphaBeta:
    """A collective's measured cost at one world size: ``seconds = a + b * nbytes``."""

    a: float
    b: float

    def seconds(self, nbytes: float) -> float:
        return self.a + self.b * nbytes

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
        """The line through the points with the least relative error and non-negative terms.
        Times <= 0 (noise cancelled a difference) are left out; a size timed slower than a
        larger one counts at the larger one's time (more bytes never cost less)."""
        if len(sizes) != len(seconds) or len(sizes) < 2:
            raise ValueError("AlphaBeta.fit needs at least two (size, seconds) points")
        kept = _lower_envelope([(x, y) for x, y in zip(sizes, seconds) if y > 0])
        if len(kept) < 2:
            return cls(max((y for _, y in kept), default=0.0), 0.0)
        sizes, seconds = [x for x, _ in kept], [y for _, y in kept]
        w = [1.0 / y ** 2 for y in seconds]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
        my = sum(wi * y for wi, y in zip(w, seconds)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
        sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds))
        b = sxy / sxx if sxx else 0.0
        if b < 0:  # no cost per byte: the weighted mean
            return cls(max(my, 0.0), 0.0)
        if my - b * mx < 0:  # no fixed cost: the slope through the origin
            sxx0 = sum(wi * x * x for wi, x in zip(w, sizes))
            b0 = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sxx0 if sxx0 else 0.0
            return cls(0.0, max(b0, 0.0))
        return cls(my - b * mx, b)


def _lower_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points by size, each time capped by every larger size's: non-decreasing."""
    capped: list[tuple[float, float]] = []
    for x, y in sorted(points, reverse=True):
        capped.append((x, min(y, capped[-1][1]) if capped else y))
    return capped[::-1]


@dataclass
class ModelProfile:
    """One model's step, measured in one process (or estimated from its size)."""

    name: str
    params: int
    global_batch: int
    param_bytes: float
    grad_bytes: float
    optimizer_state_bytes: float = 0.0
    activation_bytes_per_sample: float = 0.0
    flops_per_sample: float = 0.0
    largest_tensor_bytes: float = 0.0
    weight_tensors: int = 1
    fsdp_units: int = 0  # the blocks FSDP shards one by one (0: unmeasured, weight_tensors)
    boundary_bytes_per_sample: float = 0.0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    input_seconds: float = 0.0
    compute_fit: tuple[float, float] = (0.0, 0.0)
    optimizer_seconds_1thread: float = 0.0
    input_seconds_1thread: float = 0.0
    #: of the input's mean per step, what comes in occasional long gaps (a loader's new
    #: epoch), which every replica pays whatever its share of the batch
    input_occasional_seconds: float = 0.0
    collectives_per_step: float = 0.0
    threads: int = 1
    rss_bytes: float = 0.0
    measured: bool = True
    pipeline_forward_backward: bool = False
    #: what the FLOPs compute in, for a GPU's nominal rate: ``"half"`` (bf16/fp16) or
    #: ``"fp32"``, of which ``tf32_fraction`` may use TF32
    compute_precision: str = "half"
    tf32_fraction: float = 0.0
    #: per number of pipeline stages ("2".."8"): the largest share of the FLOPs one stage
    #: holds as the pipeline cuts the model by default (absent: an even split)
    pipeline_stage_shares: dict[str, float] = field(default_factory=dict)
    forward_fraction: float = 0.0  # forward's share of forward + backward (0: a third assumed)
    layer_calls: int = 0  # leaf modules called in one forward (0: not measured)

    def __post_init__(self) -> None:
        if isinstance(self.params, bool) or not isinstance(self.params, int) or self.params < 1:
            raise ValueError(f"a model needs at least one parameter, got params={self.params!r}")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) \
                or self.global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {self.global_batch!r}")
        self.compute_fit = (float(self.compute_fit[0]), float(self.compute_fit[1]))

    @property
    def state_bytes(self) -> float:
        """Weights, gradients and optimizer state: what sharding divides."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes

    def stage_share(self, stages: int) -> float:
        """The share of the compute the busiest of ``stages`` pipeline stages does."""
        share = self.pipeline_stage_shares.get(str(stages))
        return max(1.0 / stages, float(share)) if share else 1.0 / stages

    def compute_1thread(self, batch: float) -> float:
        """Forward + backward of ``batch`` samples on one thread (the fitted line)."""
        return self.compute_fit[0] + self.compute_fit[1] * batch

    def thread_speedup(self) -> float:
        """How much faster the process's threads ran the whole batch than one (1: unknown)."""
        one = self.compute_1thread(self.global_batch)
        if not self.measured or self.threads <= 1 or self.compute_seconds <= 0 or one <= 0:
            return 1.0
        return min(float(self.threads), one / self.compute_seconds)

    @classmethod
    def from_parameter_count(cls, params: float, *, global_batch: int = 1024,
                             seq_len: int = 1, optimizer: str = "adam",
                             bytes_per_value: int = 4) -> ModelProfile:
        """A dense transformer known only by its size (``6 P`` FLOPs per token)."""
        if isinstance(params, bool) or not isinstance(params, (int, float)) or \
                not math.isfinite(params) or params < 1:
            raise ValueError(f"--model-params must be a number >= 1, got {params!r}. HINT: "
                             "write the parameter count, e.g. 7e9")
        state = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}
        if optimizer not in state:
            raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(state)}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        p = int(params)
        # a transformer's shape from its size: P ~ 12 L h^2 with L ~ h / 128 layers
        hidden = max(1.0, (p * 128 / 12) ** (1 / 3))
        layers = max(1, round(hidden / 128))
        return cls(name=f"{params:.3g}-parameter model", params=p, global_batch=global_batch,
                   param_bytes=p * bytes_per_value, grad_bytes=p * bytes_per_value,
                   optimizer_state_bytes=p * 4 * state[optimizer],
                   flops_per_sample=6.0 * p * seq_len,
                   # per token and layer ~34 h bytes of activations (Korthikanti et al. 2022)
                   activation_bytes_per_sample=34.0 * hidden * layers * seq_len,
                   boundary_bytes_per_sample=hidden * bytes_per_value * seq_len,
                   largest_tensor_bytes=min(p, 4 * hidden * hidden) * bytes_per_value,
                   weight_tensors=layers, measured=False)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelProfile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def median_of(cls, profiles: list[ModelProfile]) -> ModelProfile:
        """Each measured time the median of ``profiles``; the rest the first's."""
        return _median_of(cls, profiles, [f.name for f in fields(cls) if f.name.endswith(
            ("_seconds", "_1thread")) or f.name in ("collectives_per_step", "compute_fit")])


#: Bumped when the calibration measures a figure differently (a cached one is measured again).
MACHINE_VERSION = 2


@dataclass
class MachineProfile:
    """This machine as measured: contention, collectives, engine costs, rates."""

    cores: int
    ram_bytes: float
    slowdown: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    straggle: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    allreduce: dict[str, dict[int, AlphaBeta]] = field(default_factory=dict)
    sync_overhead: dict[int, float] = field(default_factory=dict)
    #: per step, what a small training loop waited for its last rank beyond its work
    sync_wait: dict[int, float] = field(default_factory=dict)
    small_collective: dict[int, float] = field(default_factory=dict)
    fsdp_unit: dict[int, float] = field(default_factory=dict)
    fsdp_unit_adam: dict[int, float] = field(default_factory=dict)
    fsdp_wide_sgd: dict[int, float] = field(default_factory=dict)
    fsdp_wide_adam: dict[int, float] = field(default_factory=dict)
    fsdp_wide_bytes: float = FSDP_WIDE_BYTES
    pipeline_slot: float = 3e-4
    layer_call: float = 1.5e-5  # one small layer's forward + backward (a stage's, per slot)
    flops_per_second: float = 3e10
    memory_bandwidth: float = 5e9
    input_fixed: float = 1e-4
    p2p: AlphaBeta = AlphaBeta(1e-4, 1 / 1.2e9)
    ps_round_trip: AlphaBeta = AlphaBeta(1e-3, 2 / 1.0e9)
    process_rss_bytes: float = 350e6
    measured_at: str = ""
    load_average: float = 0.0
    source: str = "nominal"
    version: int = 1  # the calibration that measured it (MACHINE_VERSION; 1: unversioned)

    def slowdown_for(self, processes: int) -> float:
        """Each of ``processes`` busy one-thread processes' slowdown here."""
        if processes <= 1:
            return 1.0
        if processes in self.slowdown:
            return self.slowdown[processes]
        top = max(self.slowdown)
        if processes < top:  # between measured points: the next measured one above
            return self.slowdown[min(k for k in self.slowdown if k > processes)]
        return self.slowdown[top] * processes / top  # each extra process takes its share

    def straggle_for(self, processes: int) -> float:
        """How much longer the slowest of ``processes`` busy ranks takes than the mean."""
        return (1.0 if processes <= 1 or not self.straggle
                else self.straggle.get(processes, self.straggle[max(self.straggle)]))

    def sync_wait_for(self, processes: int) -> float:
        """A synchronous step's wait for its last rank (the nearest measured count)."""
        return (0.0 if processes <= 1 or not self.sync_wait
                else self.sync_wait[min(self.sync_wait, key=lambda k: (abs(k - processes), -k))])

    def allreduce_seconds(self, algorithm: str, nbytes: float, world: int) -> float:
        """All-reduce of ``nbytes`` over ``world`` ranks here (else rescaled from the nearest)."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        table = self.allreduce.get(algorithm) or self.allreduce.get("native")
        if not table:
            raise ValueError(f"no all-reduce figures for {algorithm!r} in the machine profile. "
                             "HINT: measure this machine again (replicator plan --remeasure)")
        if world in table:
            return table[world].seconds(nbytes)
        ab = table[near := min(table, key=lambda k: abs(k - world))]
        alpha = ab.a / (2 * (near - 1))
        per_byte = ab.b / (2 * (near - 1) / near)
        return 2 * (world - 1) * alpha + 2 * (world - 1) / world * nbytes * per_byte

    def collective_alpha(self, algorithm: str, world: int) -> float:
        """The fixed cost of one collective of ``algorithm`` over ``world`` ranks here."""
        table = self.allreduce.get(algorithm) or self.allreduce.get("native") or {}
        return self.per_world({k: ab.a for k, ab in table.items()}, world)

    def fsdp_block_seconds(self, world: int, state_ratio: float
                           ) -> tuple[float, float] | None:
        """FSDP's ``(per block, per byte)`` cost here, SGD's to Adam's by ``state_ratio``."""
        if not (self.fsdp_unit and self.fsdp_wide_sgd):
            return None
        towards_adam = min(max(state_ratio, 0.0), 2.0) / 2
        narrow = self.per_world(self.fsdp_unit, world)
        if self.fsdp_unit_adam:  # a sharded optimizer's fixed cost per block (DTensor steps)
            narrow += (self.per_world(self.fsdp_unit_adam, world) - narrow) * towards_adam
        sgd = self.per_world(self.fsdp_wide_sgd, world)
        adam = self.per_world(self.fsdp_wide_adam, world) if self.fsdp_wide_adam else sgd
        wide = sgd + (adam - sgd) * towards_adam
        per_byte = max(0.0, (wide - narrow) / max(self.fsdp_wide_bytes - FSDP_NARROW_BYTES, 1.0))
        return narrow, per_byte

    def per_world(self, table: dict[int, float], world: int) -> float:
        """A per-world-size figure; beyond the measured ones it grows like ``n - 1``."""
        if world <= 1 or not table:
            return 0.0
        if world in table:
            return table[world]
        near = min(table, key=lambda k: abs(k - world))
        return table[near] * (world - 1) / max(1, near - 1)

    @classmethod
    def nominal(cls) -> MachineProfile:
        """Typical figures of a quiet 2-core host with gloo (docs/collectives.md)."""
        return cls(
            cores=2, ram_bytes=16e9, slowdown={1: 1.0, 2: 1.04, 3: 1.56, 4: 2.08},
            straggle={1: 1.0, 2: 1.03, 3: 1.15, 4: 1.2},
            allreduce={
                "shared_memory": {2: AlphaBeta(5e-5, 1 / 3e9)},
                "native": {2: AlphaBeta(3e-4, 1 / 0.9e9)},
                "ring": {2: AlphaBeta(6e-4, 1 / 0.9e9)},
            },
            sync_overhead={2: 4e-4}, small_collective={2: 6e-5}, fsdp_unit={2: 2e-3},
            pipeline_slot=1e-3, source="nominal")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineProfile:
        """The profile saved by :meth:`to_json` (missing fields: defaults; version 1)."""
        values: dict[str, Any] = {"source": "measured", "version": 1}
        for name in [f.name for f in fields(cls) if f.name in data]:
            v = data[name]
            if name == "allreduce":
                v = {algo: {int(k): AlphaBeta(*ab) for k, ab in table.items()}
                     for algo, table in v.items()}
            elif isinstance(getattr(_DEFAULT_MACHINE, name), AlphaBeta):
                v = AlphaBeta(*v)
            elif isinstance(getattr(_DEFAULT_MACHINE, name), dict):
                v = {int(k): float(x) for k, x in v.items()}
            elif name not in ("measured_at", "source"):
                v = int(v) if name in ("cores", "version") else float(v)
            values[name] = v
        return cls(**values)

    @classmethod
    def median_of(cls, profiles: list[MachineProfile]) -> MachineProfile:
        """Each figure the median of theirs; text fields the first's."""
        return _median_of(cls, profiles)

    def to_json(self) -> dict[str, Any]:
        out = {k: [v.a, v.b] if isinstance(v, AlphaBeta) else v
               for k, v in ((f.name, getattr(self, f.name)) for f in fields(self))}
        out["allreduce"] = {name: {k: [ab.a, ab.b] for k, ab in table.items()}
                            for name, table in self.allreduce.items()}
        return out


_DEFAULT_MACHINE = MachineProfile(cores=1, ram_bytes=0.0)


def _median_of(cls: Any, profiles: Sequence[Any], keys: list[str] | None = None) -> Any:
    """One profile from several taken at different times: ``keys`` (default: all) the median
    of theirs, the rest the first's."""
    if not profiles:
        raise ValueError("median_of needs at least one profile")
    if len(profiles) == 1:
        return profiles[0]
    data = [json.loads(json.dumps(p.to_json())) for p in profiles]
    medians = {k: median_json([d[k] for d in data]) for k in keys or data[0]}
    return cls.from_json({**data[0], **medians})


def median_json(values: list[Any]) -> Any:
    """The median of JSON values of one shape, number by number (else the first's)."""
    first = values[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return statistics.median(numbers) if len(numbers) == len(values) else first
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first)
                                       for v in values):
        return [median_json([v[i] for v in values]) for i in range(len(first))]
    if isinstance(first, dict) and all(isinstance(v, dict) for v in values):
        return {k: median_json([v[k] for v in values if k in v]) for k in first}
    return first


def save_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, target)


def kept_steps(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """All steps but the fastest and slowest tenth (bench and profile alike)."""
    ordered = sorted(records, key=lambda r: r["step"])
    cut = len(ordered) // 10
    return ordered[cut:len(ordered) - cut] if cut else ordered


def machine_profile_cached(directory: str | Path) -> MachineProfile | None:
    """``machine.json`` in ``directory`` when a plan measured this machine before."""
    path = Path(directory) / "machine.json"
    try:
        return MachineProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):  # absent, or not a profile
        return None
