"""The measuring side of ``bench`` and ``plan``: timers inside the user's process.

A step observer, torch's optimizer step hooks and the comm room's timers split each step into
parts that sum to it; nothing is replaced. ``profile`` mode (for ``plan``) adds one-thread,
half- and quarter-batch phases and one step under the FLOP and saved-tensor counters.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as optim

from replicator.comm import timing
from replicator.parallel.fsdp import shard_units
from replicator.plan.profiles import save_json
from replicator.strategies.nest import flatten
from replicator.strategies.observers import StepObserver, add_step_observer

__all__ = ["BenchComplete", "Probe", "STRATEGY_ENV"]

#: What ``bench`` tells the script: the strategy to build (``rp.get_strategy(name)``).
STRATEGY_ENV = "REPLICATOR_STRATEGY"
OUT_ENV = "REPLICATOR_BENCH_OUT"
STEPS_ENV = "REPLICATOR_BENCH_STEPS"
WARMUP_ENV = "REPLICATOR_BENCH_WARMUP"
MODE_ENV = "REPLICATOR_BENCH_MODE"

#: Profile phases after warmup: (name, steps, threads (0: default), batch fraction).
PROFILE_PHASES = (("all_threads", 4, 0, 1.0), ("one_thread", 5, 1, 1.0),
                  ("one_thread_half", 5, 1, 0.5), ("one_thread_quarter", 5, 1, 0.25))
#: A short step's phases run up to this many times the steps above, so that the shortest
#: phase lasts about PROFILE_PHASE_SECONDS (three 1 ms steps are noise, not a median).
PROFILE_MAX_SCALE = 250
PROFILE_PHASE_SECONDS = 0.5
#: Seconds between two writes of the progress file (the bench's bar polls it every 0.2 s).
PROGRESS_INTERVAL = 0.2


class BenchComplete(BaseException):
    """Raised from ``strategy.run`` once the bench has its steps (caught by the entry)."""


def slice_batch(obj: Any, keep: int, size: int) -> Any:
    """``obj`` with every tensor whose leading dimension is ``size`` cut to ``keep`` rows."""
    leaves, rebuild = flatten(obj)
    return rebuild([t[:keep] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size
                    else t for t in leaves])


class _SavedBytes:
    """Bytes of tensors autograd saves for backward (activations), parameters excluded."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.total = 0
        self.floating: dict[torch.dtype, int] = {}  # saved floating bytes by dtype

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a tensor without storage
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.exclude and key not in self.seen:
                self.seen.add(key)
                self.total += storage.nbytes()
                if t.is_floating_point():
                    self.floating[t.dtype] = self.floating.get(t.dtype, 0) + storage.nbytes()
        return t


def _precision(saved: dict[torch.dtype, int], counter: Any) -> dict[str, Any]:
    """What the FLOPs ran in (``half`` or ``fp32``) and the share TF32 may take."""
    half = saved.get(torch.bfloat16, 0) + saved.get(torch.float16, 0)
    if half > saved.get(torch.float32, 0):
        return {"compute_precision": "half", "tf32_fraction": 0.0}
    total = counter.get_total_flops()
    by_op = counter.get_flop_counts().get("Global", {})
    conv = sum(n for op, n in by_op.items() if "convolution" in str(op))
    tf32 = conv if torch.backends.cudnn.allow_tf32 else 0
    if torch.get_float32_matmul_precision() != "highest":
        tf32 += total - conv
    return {"compute_precision": "fp32", "tf32_fraction": tf32 / total if total else 0.0}


def stage_shares(model: torch.nn.Module, flops_by_module: dict[str, dict[Any, int]]
                 ) -> dict[str, float]:
    """Per 2..8 stages, the largest FLOP share of one stage under the pipeline's default cut."""
    from replicator.parallel import pipeline_split as split

    try:
        chain = split.flatten_chain(model)
    except split.PipelineSplitError:
        return {}
    prefix = type(model).__name__  # the FLOP counter names blocks "<root class>.<path>"
    flops = [float(sum(flops_by_module.get(f"{prefix}.{name}", {}).values())) for name, _ in chain]
    total = sum(flops)
    if total <= 0:
        return {}
    costs = split.parameter_costs(chain)
    out: dict[str, float] = {}
    for stages in range(2, min(8, len(chain)) + 1):
        starts = [*split.balanced_starts(costs, stages), len(chain)]
        out[str(stages)] = max(sum(flops[a:b]) for a, b in zip(starts, starts[1:])) / total
    return out


class Probe(StepObserver):
    """Observes this process's steps and collects per-step records."""

    def __init__(self, steps: int, warmup: int, mode: str = "bench") -> None:
        if mode not in ("bench", "profile"):
            raise ValueError(f"probe mode must be 'bench' or 'profile', got {mode!r}")
        self.steps, self.warmup, self.mode = steps, warmup, mode
        self.calls = self.collective_calls = 0
        self.records: list[dict[str, float]] = []
        self.strategy_name = ""
        self.replicas = 1
        self.rank = int(os.environ.get("RANK", "0"))
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.batch_sizes: list[int] = []
        self.extra: dict[str, Any] = {}
        self._opt = self._ps = self._comm_in_opt = self._comm_pre = 0.0
        # the optimizer's step began, and its strategy's own pre-step hooks ended
        self._t_pre: float | None = None
        self._t_pre2: float | None = None
        self._run: dict[str, Any] | None = None  # the step now inside ``run``
        self._open: dict[str, Any] | None = None  # the step ended, until the next begins
        self._progress_path: str | None = None
        self._progress_at = -math.inf
        self._t_forward: float | None = None  # when the step's model call returned
        self._undo: list[Callable[[], None]] = []
        self._threads = torch.get_num_threads()
        self._scale = 1  # profile phases' steps are PROFILE_PHASES' counts times this
        self._warm_steps: list[float] = []
        self._cuda: torch.device | None = None  # the strategy's device, when it is a GPU
        self._counting: tuple[contextlib.ExitStack, Any, Any, list, list] | None = None

    @property
    def total_calls(self) -> int:
        if self.mode == "profile":
            return self.warmup + self._scale * sum(p[1] for p in PROFILE_PHASES) + 1
        return self.warmup + self.steps

    # -- installation --------------------------------------------------------------------
    def install(self, progress_path: str | None = None) -> None:
        """Observe the steps, hook the optimizers' steps and turn the comm timers on."""
        was_on = timing.enabled()
        timing.enable(True)
        self._undo.append(lambda: timing.enable(was_on))
        self._progress_path = progress_path
        self._undo.append(add_step_observer(self))
        pre = optim.register_optimizer_step_pre_hook(self._before_opt)
        post = optim.register_optimizer_step_post_hook(self._after_opt)
        self._undo += [pre.remove, post.remove]

    def run(self, body: Callable[[], Any], progress_path: str | None = None) -> None:
        """``body()`` under this probe, until it ends or the bench has its steps."""
        self.install(progress_path)
        try:
            with contextlib.suppress(BenchComplete):
                body()
        finally:
            self.uninstall()

    def uninstall(self) -> None:
        """Undo :meth:`install` (the observer, hooks, timers and thread count)."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        torch.set_num_threads(self._threads)

    def _now(self) -> float:
        """The time once the work queued on the GPU (if any) is done."""
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        return time.perf_counter()

    # -- optimizer hooks -------------------------------------------------------------------
    def _before_opt(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.setdefault(id(optimizer), optimizer)
        self._t_pre = self._now()
        self._comm_pre = timing.snapshot().exposed

    def _after_pre_hooks(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._t_pre2 = self._now()  # a parameter server's push and pull ended

    def _after_opt(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        now = self._now()
        if self._t_pre is None:
            return
        t_mid = self._t_pre2 if self._t_pre2 is not None else self._t_pre
        self._ps += t_mid - self._t_pre  # the strategy's own pre-step hooks (push and pull)
        self._opt += now - t_mid
        self._comm_in_opt += timing.snapshot().exposed - self._comm_pre
        self._t_pre = self._t_pre2 = None

    def _forward_end(self, module: Any, args: Any, output: Any) -> None:
        if self._run is not None and self._t_forward is None:
            self._t_forward = self._now()

    # -- the step boundary (the observer's calls) -----------------------------------------------
    def called(self, strategy: Any, name: str) -> None:
        if name == "forward_backward":
            self.extra["forward_backward"] = True
        else:
            self.collective_calls += 1

    def _first_step(self, strategy: Any) -> None:
        """What the first step shows: the device, the strategy, its own optimizer hooks."""
        if strategy.device.type == "cuda":
            self._cuda = strategy.device
        # only when the strategy registered step hooks of its own (a parameter server)
        if len(getattr(optim, "_global_optimizer_pre_hooks", ())) > 1:
            handle = optim.register_optimizer_step_pre_hook(self._after_pre_hooks)
            self._undo.append(handle.remove)
        samples = getattr(type(strategy), "_activation_samples", None)
        if self.mode == "profile" and isinstance(samples, int):
            # warm up past the strategy's own activation metering (saved-tensor hooks)
            self.warmup = max(self.warmup, samples)
        self.strategy_name = type(strategy).__name__
        self.replicas = int(strategy.num_replicas_in_sync)

    def run_started(self, strategy: Any, args: tuple) -> tuple:
        if not self.strategy_name:  # set by the first step
            self._first_step(strategy)
        now = self._now()
        comm_now = timing.snapshot()
        if self._open is not None:
            self._close(now, comm_now)
        if self.mode == "profile" and self.calls == self.warmup and self._warm_steps:
            shortest = min(p[1] for p in PROFILE_PHASES) * min(self._warm_steps)
            self._scale = max(1, min(PROFILE_MAX_SCALE,
                                     math.ceil(PROFILE_PHASE_SECONDS / max(shortest, 1e-6))))
        if self.calls >= self.total_calls:
            raise BenchComplete()
        self.calls += 1
        phase = self._phase()
        size = next((int(t.shape[0]) for t in flatten(args)[0]  # the leading dimension
                     if isinstance(t, torch.Tensor) and t.dim()), None)
        if size is not None:
            if phase is not None and phase[3] < 1.0 and size >= 4:
                keep = max(1, int(size * phase[3]))
                args = slice_batch(args, keep, size)
                size = keep
            self.batch_sizes.append(size)
        if phase is not None and torch.get_num_threads() != (phase[2] or self._threads):
            torch.set_num_threads(phase[2] or self._threads)  # at a phase's first step only
        if self.mode == "profile" and self.calls == self.warmup + 1:
            # first after the warmup: a script that stops before the phases end still has it
            self._start_counting()
            return args
        self._opt = self._ps = self._comm_in_opt = 0.0
        self.collective_calls = 0
        self._t_forward = None
        self._run = {"start": now, "comm_start": comm_now, "phase": phase,
                     "ckpt_start": timing.region_seconds("checkpoint"),
                     "t_run": time.perf_counter(), "comm_run": timing.snapshot()}
        return args

    def run_finished(self, strategy: Any) -> None:
        if self._counting is not None:
            self._finish_counting()
            return
        r, self._run = self._run, None
        if r is None:
            return
        t_end, t_run = self._now(), r["t_run"]
        comm_end = timing.snapshot()
        ckpt_now = timing.region_seconds("checkpoint")
        r.update(run=t_end - t_run, comm_run=(comm_end - r["comm_run"]).exposed, opt=self._opt,
                 ps=self._ps, comm_in_opt=self._comm_in_opt, end=t_end, ckpt_end=ckpt_now,
                 ckpt_run=ckpt_now - r["ckpt_start"], pre=t_run - r["start"],
                 forward=(self._t_forward - t_run) if self._t_forward else 0.0,
                 phase=PROFILE_PHASES.index(r["phase"]) if r["phase"] else -1,
                 batch=float(self.batch_sizes[-1]) if self.batch_sizes else 0.0)
        self._open = r
        self._write_progress()

    def _write_progress(self) -> None:
        """The chief's step count for the progress bar, at most every ``PROGRESS_INTERVAL``."""
        if self._progress_path is None or self.rank != 0:
            return
        now = time.perf_counter()
        if now - self._progress_at < PROGRESS_INTERVAL and self.calls < self.total_calls:
            return
        self._progress_at = now
        with contextlib.suppress(OSError), open(self._progress_path, "w") as f:
            f.write(str(min(self.calls, self.total_calls)))

    def _phase(self) -> tuple[str, int, int, float] | None:
        if self.mode != "profile" or self.calls <= self.warmup + 1:
            return None  # the warmup, then the counted step
        k = self.calls - self.warmup - 1
        first, rest = PROFILE_PHASES[0], PROFILE_PHASES[1:]
        if k <= first[1] * self._scale:
            return first
        k -= first[1] * self._scale
        # the one-thread phases take turns step by step, so the machine's load lands on every
        # batch size alike (one after another, a busy spell bent the compute fit)
        return rest[(k - 1) % len(rest)] if k <= sum(p[1] for p in rest) * self._scale else None

    def _close(self, now: float, comm_now: timing.CommTime) -> None:
        """Finish the open step's record at the start of the next ``run``."""
        r, self._open = self._open, None
        assert r is not None
        step = now - r["start"]
        if self.calls <= self.warmup:
            self._warm_steps.append(step)
            return
        comm_total = comm_now.exposed - r["comm_start"].exposed
        comm_gap = comm_total - r["comm_run"]
        ckpt = timing.region_seconds("checkpoint") - r["ckpt_end"]  # saved between steps
        opt = max(0.0, r["opt"] - r["comm_in_opt"])
        comm = comm_total + r["ps"]
        compute = max(0.0, r["run"] - opt - r["ps"] - r["comm_run"] - r["ckpt_run"])
        background = comm_now.background - r["comm_start"].background
        self.records.append({
            "step": step, "compute": compute, "communication": comm, "optimizer": opt,
            # the gap between steps, and the probe's own bookkeeping before this step
            "input": max(0.0, now - r["end"] - comm_gap - ckpt) + r["pre"],
            "checkpoint": ckpt + r["ckpt_run"],
            "overlapped": max(0.0, background - comm), "phase": r["phase"],
            "batch": r["batch"], "collectives": float(self.collective_calls),
            # from the run's start to the end of the model's call (0: not seen; profile only)
            "forward": r["forward"]})

    # -- profile mode: FLOPs and activations of one step ---------------------------------------
    def _start_counting(self) -> None:
        """Run the next step under the FLOP, saved-tensor and layer-call counters."""
        from torch.utils.flop_counter import FlopCounterMode

        torch.set_num_threads(self._threads)
        saved = _SavedBytes({p.untyped_storage().data_ptr() for p in self._params()})
        counter = FlopCounterMode(display=False)
        roots: list[torch.nn.Module] = []
        leaf_calls = [0]

        def first_module(module: torch.nn.Module, args: Any) -> None:
            if not roots:
                roots.append(module)  # the step's first call: the model, as a rule
            if next(module.children(), None) is None:
                leaf_calls[0] += 1  # a layer's call (a pipeline stage repeats its share)

        stack = contextlib.ExitStack()
        stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(
            first_module).remove)
        stack.enter_context(counter)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))
        self._counting = (stack, saved, counter, roots, leaf_calls)

    def _finish_counting(self) -> None:
        assert self._counting is not None
        (stack, saved, counter, roots, leaf_calls), self._counting = self._counting, None
        stack.close()
        batch = self.batch_sizes[-1] if self.batch_sizes else 1
        self.extra.update(layer_calls=leaf_calls[0],
                          flops_per_sample=counter.get_total_flops() / max(1, batch),
                          activation_bytes_per_sample=saved.total / max(1, batch),
                          **_precision(saved.floating, counter))
        if roots:  # the blocks FSDPStrategy would shard one by one, the pipeline's stages
            self.extra["fsdp_units"] = len(shard_units(roots[0]))
            self.extra["pipeline_stage_shares"] = stage_shares(roots[0], counter.get_flop_counts())
            # every later step's forward pass ends when the model's call returns
            self._undo.append(roots[0].register_forward_hook(self._forward_end).remove)

    # -- results --------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        """The parameters of the optimizers seen, each once."""
        return list({id(p): p for opt in self.optimizers.values() for g in opt.param_groups
                     for p in g["params"]}.values())

    def results(self) -> dict[str, Any]:
        """Everything measured in this process, as JSON-ready data."""
        unique = self._params()
        state_bytes = sum(v.numel() * v.element_size() for opt in self.optimizers.values()
                          for per_param in opt.state.values() for v in per_param.values()
                          if isinstance(v, torch.Tensor))
        return {
            "rank": self.rank, "strategy": self.strategy_name, "replicas": self.replicas,
            "mode": self.mode, "records": self.records, "calls": self.calls,
            "params": sum(p.numel() for p in unique),
            "param_bytes": sum(p.numel() * p.element_size() for p in unique),
            "grad_bytes": sum(p.numel() * p.element_size() for p in unique if p.requires_grad),
            "optimizer_state_bytes": state_bytes,
            "largest_tensor_bytes": max((p.numel() * p.element_size() for p in unique),
                                        default=0),
            "weight_tensors": sum(1 for p in unique if p.dim() >= 2),
            "batch": statistics.median(self.batch_sizes) if self.batch_sizes else 0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_device_bytes": (torch.cuda.max_memory_allocated(self._cuda)
                                  if self._cuda is not None else 0),
            "threads": self._threads, "comm_timing": timing.enabled(),
            "profile_phase_scale": self._scale, **self.extra,
        }

    def write(self, directory: str) -> None:
        save_json(os.path.join(directory, f"rank{self.rank}.json"), self.results())
