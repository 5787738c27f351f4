"""``replicator plan``: profile the model, load this machine's figures, predict, recommend.

The profile is cached in ``bench/profile-<hash>.json`` until the script or its arguments
change, this machine's figures in ``bench/machine.json``. The recommendation: the highest
predicted throughput that fits; more processes, or a change to what training computes (a
parameter server, DiLoCo), must beat the others by more than :data:`WORTH_IT`.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replicator.plan.cost_model import STRATEGIES, Cluster, Prediction, _gb, predict
from replicator.plan.devices import get_device, parse_duration, parse_link
from replicator.plan.formulas import check_count
from replicator.plan.profiles import (
    MACHINE_VERSION,
    AlphaBeta,
    MachineProfile,
    ModelProfile,
    kept_steps,
    machine_profile_cached,
    save_json,
)
from replicator.plan.settings import format_table, ms

if TYPE_CHECKING:
    import torch

__all__ = ["Plan", "WORTH_IT", "load_machine", "make_plan", "model_from_probe", "plan_line",
           "plan_model", "plan_table", "print_plan", "print_plan_line", "profile_here",
           "profile_script", "recommend", "save_profile"]

#: Steps before the profile's measured phases (imports, first-call allocations).
PROFILE_WARMUP = 2


def model_from_probe(result: dict[str, Any], name: str) -> ModelProfile:
    """Build a :class:`ModelProfile` from the probe's ``profile``-mode results of one rank."""
    records = result.get("records") or []
    if not records or not result.get("params"):
        raise ValueError(f"profiling {name} measured no training step with an optimizer. "
                         "HINT: the script must train through strategy.run (or rp.Trainer) "
                         "and call optimizer.step() inside the step")
    phases: dict[int, list[dict[str, float]]] = {}
    for r in records:
        phases.setdefault(int(r["phase"]), []).append(r)

    def med(phase: list[dict[str, float]], key: str) -> float:
        """A phase's typical ``key``: the mean of its kept steps, or the median of a few."""
        return (statistics.median(r[key] for r in phase) if len(phase) < 10
                else statistics.mean(r[key] for r in kept_steps(phase)))

    full = phases.get(0) or records
    one_full = phases.get(1) or full  # the one-thread phase of the full batch
    # the median step's share of compute up to the end of the model's call (0: unseen)
    shares = [r["forward"] / r["compute"] for r in one_full
              if r.get("forward", 0.0) > 0 and r["compute"] > 0]
    # the input's mean beyond its typical step's: the occasional long gaps
    occasional = max(0.0, med(one_full, "input") - statistics.median(
        r["input"] for r in one_full)) if len(one_full) >= 10 else 0.0
    one = [r for i in (1, 2, 3) for r in phases.get(i, [])]
    points: dict[float, list[dict[str, float]]] = {}
    for r in one:
        points.setdefault(r["batch"], []).append(r)
    if len(points) >= 2:
        sizes = sorted(points)
        # the line's shape from each size's fastest steps (noise only adds: typical steps beside
        # busy processes read a fixed cost no quiet run shows), its height from typical ones
        fastest = [sorted(r["compute"] for r in points[b]) for b in sizes]  # a quarter of them
        shape = AlphaBeta.fit(sizes, [statistics.mean(t[:max(1, len(t) // 4)]) for t in fastest])
        largest = shape.a + shape.b * sizes[-1]
        height = med(points[sizes[-1]], "compute") / largest if largest > 0 else 1.0
        compute_fit = (shape.a * height, shape.b * height)
    else:  # a batch the probe could not cut: assume compute proportional to the batch
        per = med(one or full, "compute") / max(1.0, float(result.get("batch") or 1))
        compute_fit = (0.0, per)
    batch = int(max(r["batch"] for r in full))
    return ModelProfile(
        name=name, params=int(result["params"]), global_batch=max(1, batch),
        param_bytes=float(result["param_bytes"]), grad_bytes=float(result["grad_bytes"]),
        optimizer_state_bytes=float(result.get("optimizer_state_bytes", 0)),
        activation_bytes_per_sample=float(result.get("activation_bytes_per_sample", 0)),
        flops_per_sample=float(result.get("flops_per_sample", 0)),
        largest_tensor_bytes=float(result.get("largest_tensor_bytes", 0)),
        weight_tensors=max(1, int(result.get("weight_tensors", 1))),
        fsdp_units=int(result.get("fsdp_units", 0)),
        step_seconds=med(full, "step"), compute_seconds=med(full, "compute"),
        # the optimizer does the same work every step: its median, which a busy neighbour's
        # preemptions of a few steps cannot move (their mean tipped a plan to FSDP)
        optimizer_seconds=statistics.median(r["optimizer"] for r in full),
        input_seconds=med(full, "input"), compute_fit=compute_fit,
        optimizer_seconds_1thread=statistics.median(r["optimizer"] for r in one or full),
        input_seconds_1thread=med(one_full, "input"), input_occasional_seconds=occasional,
        forward_fraction=min(1.0, statistics.median(shares)) if shares else 0.0,
        collectives_per_step=statistics.mean(r["collectives"] for r in records),
        threads=int(result.get("threads", 1)), rss_bytes=float(result.get("peak_rss_bytes", 0)),
        pipeline_forward_backward=bool(result.get("forward_backward", False)),
        compute_precision=str(result.get("compute_precision", "half")),
        tf32_fraction=float(result.get("tf32_fraction", 0.0)),
        pipeline_stage_shares={str(k): float(v) for k, v in
                               dict(result.get("pipeline_stage_shares") or {}).items()},
        layer_calls=int(result.get("layer_calls", 0)))


#: Bumped when the profile measures something new, so a cached older profile is measured again.
PROFILE_VERSION = 5


def _cache_path(script: str, script_args: Sequence[str], out_dir: str) -> Path:
    """The profile's cache, keyed by the script's content and arguments."""
    h = hashlib.sha256(Path(script).read_bytes())
    h.update(f"profile v{PROFILE_VERSION}".encode())
    h.update(json.dumps(list(script_args)).encode())
    return Path(out_dir) / f"profile-{h.hexdigest()[:16]}.json"


def save_profile(script: str, script_args: Sequence[str], out_dir: str,
                 model: ModelProfile) -> None:
    """Cache ``model`` as the profile of ``script`` with ``script_args`` (in ``out_dir``)."""
    save_json(_cache_path(script, script_args, out_dir), model.to_json())


def profile_script(script: str, script_args: Sequence[str] = (), *, out_dir: str = "bench",
                   refresh: bool = False, log: Callable[[str], None] = print) -> ModelProfile:
    """Profile ``script`` in one process (cached by the script's content and arguments)."""
    from replicator.plan.benchmark import launcher, run_setting
    from replicator.plan.probe import PROFILE_PHASES
    from replicator.plan.settings import Setting

    if not Path(script).is_file():
        raise ValueError(f"script {script!r} not found. HINT: give the path of the training "
                         "script, or --model-params for a model known only by its size")
    cache = _cache_path(script, script_args, out_dir)
    if cache.exists() and not refresh:
        return ModelProfile.from_json(json.loads(cache.read_text()))
    steps = sum(p[1] for p in PROFILE_PHASES) + PROFILE_WARMUP
    log(f"profiling {script} in one process ({steps} steps, more when they are short) ...")
    setting = Setting("one_device", 1)
    out = Path(out_dir) / "logs" / "profile"
    result = run_setting(setting, out, launcher(script, script_args, setting),
                         steps=0, warmup=PROFILE_WARMUP, mode="profile")
    if not result.ranks or not result.ranks[0].get("records"):
        raise ValueError(f"profiling {script} failed: {result.error or 'no step measured'}")
    model = model_from_probe(result.ranks[0], Path(script).name)
    save_json(cache, model.to_json())
    return model


def profile_here(train_fn: Callable[[Any], Any], name: str | None = None) -> ModelProfile:
    """Profile ``train_fn(strategy)`` in this process under a ``OneDeviceStrategy``."""
    from replicator.plan.probe import Probe
    from replicator.strategies import OneDeviceStrategy

    probe = Probe(steps=0, warmup=PROFILE_WARMUP, mode="profile")
    with warnings.catch_warnings():  # one process of a job: profiling on its own is the point
        warnings.simplefilter("ignore", UserWarning)
        strategy = OneDeviceStrategy("cpu")
    probe.run(lambda: train_fn(strategy))
    return model_from_probe(probe.results(),
                            name or str(getattr(train_fn, "__qualname__", "train_fn")))


def load_machine(out_dir: str = "bench", *, remeasure: bool = False,
                 log: Callable[[str], None] = print) -> MachineProfile:
    """This machine's figures: cached in ``out_dir/machine.json``, else measured and saved."""
    cached = None if remeasure else machine_profile_cached(out_dir)
    if cached is not None and cached.version >= MACHINE_VERSION:
        return cached
    from replicator.plan.measure import measure_machine

    if cached is not None:
        log(f"{Path(out_dir) / 'machine.json'} comes from an older calibration (version "
            f"{cached.version}, now {MACHINE_VERSION}): measuring again")
    log("measuring this machine once (about a minute; cached in "
        f"{Path(out_dir) / 'machine.json'}) ...")
    machine = measure_machine(log=log)
    save_json(Path(out_dir) / "machine.json", machine.to_json())
    return machine


def plan_model(model: ModelProfile, workers: Sequence[int], *, device: str = "cpu",
               link: str = "25gbit", latency: str | None = None,
               machine: MachineProfile | None = None,
               strategies: Sequence[str] = STRATEGIES, num_ps: int = 1,
               ranks_per_host: int | None = None) -> Plan:
    """The plan for ``model`` at each worker count (pure arithmetic: fast)."""
    dev = get_device(device)
    if not dev.is_cpu and model.flops_per_sample <= 0:
        raise ValueError(
            f"the profile of {model.name} counted no FLOPs, and a plan for {dev.name} computes "
            "its step from them. HINT: the script must run at least one step past the "
            "profile's warmup (3 steps), forward and backward inside strategy.run")
    alpha = parse_duration(latency) if latency is not None else None
    cluster = Cluster(dev, parse_link(link, alpha), machine or MachineProfile.nominal(),
                      ranks_per_host)
    return make_plan(model, cluster, list(workers), tuple(strategies), num_ps=num_ps)


# -- the recommendation: one setting and why, in one sentence -----------------------------
#: How much more throughput a setting with more processes must give to be preferred.
WORTH_IT = 1.10
#: Preference among strategies with equal throughput (simplest first).
_SIMPLICITY = {name: i for i, name in enumerate(STRATEGIES)}
#: Strategies whose training differs from per-step synchronous training of the same batch.
_CHANGES_TRAINING = ("parameter_server", "diloco")


@dataclass
class Plan:
    """Every predicted setting, the recommended one (``None`` when nothing fits) and why."""

    model: ModelProfile
    cluster: Cluster
    predictions: list[Prediction]
    recommended: Prediction | None
    reason: str
    measured: dict[str, float | None] = field(default_factory=dict)

    def reason_for(self, p: Prediction) -> str:
        """One sentence about ``p``: why it was chosen, why it was not, or why it cannot run."""
        if p is self.recommended:
            return self.reason
        if not p.feasible:
            return f"cannot run: {p.why_not}"
        if not p.fits:
            return f"does not fit: {p.memory_detail}"
        best = self.recommended
        if best is None:
            return "not recommended"
        ratio = p.samples_per_second / best.samples_per_second
        return (f"{ratio:.2f}x the throughput of {best.setting}"
                + (f" with {p.processes} processes instead of {best.processes}"
                   if p.processes > best.processes and ratio > 1 else ""))


def recommend(predictions: list[Prediction], model: ModelProfile | None = None
              ) -> tuple[Prediction | None, str]:
    """The chosen setting and a one-sentence reason (see the module doc)."""
    candidates = sorted((p for p in predictions if p.fits),
                        key=lambda p: (p.processes, _SIMPLICITY.get(p.strategy, 99)))
    if not candidates:
        return None, _nothing_fits(predictions, model)
    chosen = candidates[0]
    for p in candidates[1:]:
        # more processes, or giving up synchronous training, must be clearly worth it
        costly = p.processes > chosen.processes or (
            p.strategy in _CHANGES_TRAINING and chosen.strategy not in _CHANGES_TRAINING)
        if p.samples_per_second > chosen.samples_per_second * (WORTH_IT if costly else 1.0):
            chosen = p
    return chosen, _why(chosen, predictions)


def _share(p: Prediction, part: str) -> float:
    return p.breakdown.get(part, 0.0) / p.step_seconds if p.step_seconds > 0 else 0.0


def _why(chosen: Prediction, predictions: list[Prediction]) -> str:
    single = next((p for p in predictions if p.strategy == "one_device"), None)
    if chosen.strategy == "one_device":
        rivals = [p for p in predictions if p.fits and p.workers > 1 and p is not chosen]
        if not rivals:
            return "stay on one process: no distributed setting fits or can run"
        best = max(rivals, key=lambda p: p.samples_per_second)
        ratio = best.samples_per_second / chosen.samples_per_second
        cost = best.breakdown["communication"] + best.breakdown["overhead"]
        saved = chosen.breakdown["compute"] - best.breakdown["compute"]
        if ratio < 1:
            return (f"stay on one process: the best distributed setting, {best.setting}, is "
                    f"predicted at {ratio:.2f}x its throughput, because communication and "
                    f"synchronisation ({cost * 1e3:.3g} ms a step) cost more than the "
                    f"{max(saved, 0) * 1e3:.3g} ms of compute it saves")
        return (f"stay on one process: the best distributed setting, {best.setting}, gains only "
                f"{ratio:.2f}x, less than the {WORTH_IT:.2f}x that more processes must bring")
    speedup = (chosen.samples_per_second / single.samples_per_second
               if single is not None and single.fits else None)
    gain = f"{speedup:.1f}x one process's throughput" if speedup else "the fastest that fits"
    if chosen.strategy == "diloco":
        return _why_diloco(chosen, predictions, gain)
    replicated = [p for p in predictions if p.feasible and p.strategy in
                  ("one_device", "mirrored", "central_storage", "parameter_server")]
    if chosen.strategy in ("fsdp", "pipeline") and replicated and \
            not any(p.fits for p in replicated):
        need = min(replicated, key=lambda p: p.memory_per_rank)
        how = "shards the weights, gradients and optimizer state" if chosen.strategy == \
            "fsdp" else "splits the layers into stages"
        return (f"{chosen.setting}: a full replica needs {_gb(need.memory_per_rank)} per rank, "
                f"more than {_gb(need.memory_capacity)}; {chosen.strategy} {how} to "
                f"{_gb(chosen.memory_per_rank)} per rank and is predicted at {gain}")
    comm = _share(chosen, "communication") + _share(chosen, "overhead")
    return (f"{chosen.setting}: predicted at {gain}; communication and synchronisation are "
            f"{comm:.0%} of its step")


def _why_diloco(chosen: Prediction, predictions: list[Prediction], gain: str) -> str:
    """DiLoCo chosen: how link-bound per-step synchronisation of the same processes is."""
    synced = [p for p in predictions if p.fits and p.workers == chosen.workers
              and p.strategy in ("mirrored", "central_storage", "fsdp")]
    text = f"{chosen.setting} as {chosen.spelling}: predicted at {gain}"
    if synced:
        best = max(synced, key=lambda p: p.samples_per_second)
        text += (f", {chosen.samples_per_second / best.samples_per_second:.1f}x {best.setting}, "
                 f"whose per-step synchronisation across the hosts is "
                 f"{_share(best, 'communication'):.0%} of its step")
    return text + ("; it trains H local steps between exchanges, so compare its held-out loss "
                   "with per-step synchronous training before relying on it")


def _nothing_fits(predictions: list[Prediction], model: ModelProfile | None = None) -> str:
    runnable = [p for p in predictions if p.feasible]
    if not runnable:
        return "no setting can run: " + "; ".join(sorted({p.why_not for p in predictions}))
    smallest = min(runnable, key=lambda p: p.memory_per_rank / p.memory_capacity)
    text = f"does not fit: even {smallest.setting} needs {smallest.memory_detail}"
    fsdp = [p for p in runnable if p.strategy == "fsdp"]
    if fsdp and model is not None:
        p = max(fsdp, key=lambda q: q.workers)
        shared = model.state_bytes + model.activation_bytes_per_sample * model.global_batch
        fixed = p.memory_per_rank - shared / p.workers
        room = p.memory_capacity - fixed
        if room <= 0:
            text += (f"; under FSDP the gathered layer and the process alone "
                     f"({_gb(fixed)}) exceed the {_gb(p.memory_capacity)} of a rank")
        else:
            text += (f"; FSDP would need at least {math.ceil(shared / room)} ranks of "
                     f"{_gb(p.memory_capacity)}")
    return text


def make_plan(model: ModelProfile, cluster: Cluster, workers: list[int],
              strategies: tuple[str, ...] = STRATEGIES, *, num_ps: int = 1) -> Plan:
    """Predict every strategy at every worker count (plus one process), then recommend."""
    if not workers:
        raise ValueError("give at least one worker count. HINT: --workers 2,8,64")
    for n in workers:
        check_count(n, "worker counts")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r} for the planner; known: "
                         f"{', '.join(STRATEGIES)}")
    predictions = [predict("one_device", 1, model, cluster)] if "one_device" in strategies else []
    predictions += [predict(s, n, model, cluster, num_ps=num_ps) for n in sorted(set(workers))
                    if n > 1 for s in strategies if s != "one_device"]
    chosen, reason = recommend(predictions, model)
    return Plan(model, cluster, predictions, chosen, reason)


def plan_table(plan: Plan) -> tuple[list[str], list[list[object]]]:
    """The plan as rows: one per setting, measured and error columns when validated."""
    single = next((p for p in plan.predictions if p.strategy == "one_device"), None)
    headers = ["setting", "procs", "hosts", "step ms", "samples/s", "vs 1 proc", "comm %",
               "memory/rank", "fits"]
    validated = bool(plan.measured)
    if validated:
        headers += ["measured ms", "error"]
    rows: list[list[object]] = []
    for p in plan.predictions:
        mark = " *" if p is plan.recommended else ""
        if not p.feasible:
            row: list[object] = [p.setting + mark, p.processes, p.hosts, *["-"] * 5, "no"]
        else:
            share = (p.breakdown["communication"] + p.breakdown["overhead"]) / p.step_seconds
            ratio = (f"{p.samples_per_second / single.samples_per_second:.2f}x"
                     if single is not None and single.feasible else "")
            mem = p.memory_per_rank
            row = [p.setting + mark, p.processes, p.hosts, ms(p.step_seconds),
                   f"{p.samples_per_second:.4g}", ratio, f"{share:.0%}",
                   f"{mem / 1e9:.3g} GB" if mem >= 1e9 else f"{mem / 1e6:.3g} MB",
                   "yes" if p.fits else "no"]
        if validated:
            got = plan.measured.get(p.setting)
            row += [ms(got) if got else "-",
                    f"{(p.step_seconds - got) / got:+.0%}" if got and p.feasible else "-"]
        rows.append(row)
    return headers, rows


def json_lines(plan: Plan) -> list[dict[str, Any]]:
    """One JSON object per setting; exactly one ``recommended`` when any setting fits."""
    out = []
    for p in plan.predictions:
        got = plan.measured.get(p.setting)
        out.append({
            "setting": p.setting, "strategy": p.strategy, "workers": p.workers,
            "processes": p.processes, "hosts": p.hosts,
            "predicted_step_s": round(p.step_seconds, 6) if p.feasible else None,
            "predicted_samples_per_s": round(p.samples_per_second, 3) if p.feasible else None,
            "measured_step_s": round(got, 6) if got else None,
            "memory_per_rank_bytes": round(p.memory_per_rank),
            "fits": p.fits, "recommended": p is plan.recommended,
            "reason": plan.reason_for(p),
            "breakdown_s": {k: round(v, 6) for k, v in p.breakdown.items()},
        })
        if p.link_bytes is not None and p.feasible:
            out[-1]["link_bytes_per_step"] = round(p.link_bytes)
        if p.spelling:
            out[-1]["spelling"] = p.spelling
    return out


def print_plan(plan: Plan, *, as_json: bool = False, plot_path: str | Path | None = None,
               summary: str | None = None) -> None:
    """Print the table, the recommendation and ``summary`` then the JSON lines; draw the plot."""
    if plot_path is not None:
        _plot(plan, plot_path)
    if not as_json:
        m, c = plan.model, plan.cluster
        where = "hosts like this one"
        if not c.device.is_cpu:
            rate = c.device.flops_rate(m.compute_precision, m.tf32_fraction)
            kind = ("bf16/fp16" if m.compute_precision == "half"
                    else f"fp32, {m.tf32_fraction:.0%} of FLOPs as TF32")
            where = f"{c.device.description} ({kind}: {rate / 1e12:.0f} TFLOP/s nominal)"
        source = "measured here" if m.measured else "estimated from its size"
        print(f"plan for {m.name} ({m.params:,} parameters, global batch {m.global_batch}, "
              f"{source}) on {where}, {c.per_host()} per host, {c.link} between hosts; "
              f"machine figures: {c.machine.source}"
              + (f" {c.machine.measured_at} at load {c.machine.load_average:.1f}"
                 if c.machine.measured_at else ""))
        print(format_table(*plan_table(plan)))
        for p in plan.predictions:
            for note in p.notes if p.feasible else ():
                print(f"note ({p.setting}): {note}")
        print(f"{'recommended' if plan.recommended else 'no recommendation'}: {plan.reason}")
        if summary:
            print(summary)
        if plot_path is not None and Path(plot_path).exists():
            print(f"wrote {plot_path}")
    for line in json_lines(plan):
        print(json.dumps(line), flush=True)


def _plot(plan: Plan, path: str | Path) -> None:
    from replicator.plan import plots

    if not plots.available():
        return
    points: dict[str, list[tuple[float, float]]] = {}
    misfits: dict[str, list[tuple[float, float]]] = {}
    for p in plan.predictions:
        if not p.feasible or p.samples_per_second <= 0:
            continue
        xy = (float(p.workers), p.samples_per_second)
        points.setdefault(p.strategy, []).append(xy)
        if not p.fits:
            misfits.setdefault(p.strategy, []).append(xy)
    rec: Prediction | None = plan.recommended
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plots.plan_plot(points, path, misfits=misfits,
                    recommended=(float(rec.workers), rec.samples_per_second) if rec else None,
                    title=f"{plan.model.name} on {plan.cluster.device.name}: predicted throughput")


# -- one line of the plan, from inside a training script (the demo ends on it) --------------
def plan_line(model_fn: Callable[[], torch.nn.Module], dataset: Any, global_batch: int, *,
              workers: Sequence[int] = (2, 8, 64), device: str = "cpu", link: str = "25gbit",
              out_dir: str = "bench", script: str = "your_script.py",
              script_args: str = "") -> str:
    """One line recommending a setting for ``model_fn()``, once this machine is measured."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    def train(strategy: Any) -> None:
        torch.manual_seed(0)
        with strategy.scope():
            model = model_fn()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        data = strategy.distribute_dataset(DataLoader(dataset, batch_size=global_batch,
                                                      shuffle=True, drop_last=True))
        while True:
            for batch in data:
                strategy.run(step, args=(batch,))

    machine = machine_profile_cached(out_dir)
    if machine is None and device == "cpu":
        command = f"replicator plan {script} --workers {','.join(map(str, workers))}" + (
            f" -- {script_args}" if script_args else "")
        return (f"plan: no recommendation yet: this machine's contention and collectives are "
                f"not measured (figures from elsewhere could say the opposite of what runs "
                f"fastest here). HINT: {command} measures them once (about a minute, cached "
                f"in {out_dir}/machine.json)")
    model = profile_here(train, getattr(model_fn, "__name__", "the model"))
    plan = plan_model(model, list(workers), device=device, link=link,
                      machine=machine or MachineProfile.nominal())
    figures = "this machine's measured figures" if machine else "datasheet figures"
    return (f"plan ({model.name}, {model.params:,} parameters, {','.join(map(str, workers))} "
            f"workers on {device}, {figures}) -> {plan.reason}")


def print_plan_line(strategy: Any, model_fn: Callable[[], torch.nn.Module], dataset: Any,
                    global_batch: int, **kwargs: Any) -> None:
    """Print :func:`plan_line` on the chief; a failure prints a line instead of ending the run."""
    if not strategy.is_chief:
        return
    try:
        line = plan_line(model_fn, dataset, global_batch, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the plan line must never break a training run
        line = f"plan: not available ({type(exc).__name__}: {exc})"
    print(line, flush=True)
