"""Pick one setting from the predictions, and say why in one sentence.

Among the settings that fit and can run, the highest predicted throughput; one with more
processes, or one that changes what training computes (an asynchronous parameter server,
DiLoCo), must beat the others by more than :data:`WORTH_IT`. One process is a setting like the
others. When none fits, the reason gives the arithmetic and the ranks sharding would need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from replicator.plan.cost_model import STRATEGIES, Cluster, Prediction, _gb, predict
from replicator.plan.formulas import check_count
from replicator.plan.profiles import ModelProfile

__all__ = ["Plan", "WORTH_IT", "make_plan", "recommend"]

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
    others = [p for p in predictions if p.feasible and p is not chosen]
    if chosen.strategy == "one_device":
        rivals = [p for p in others if p.fits and p.workers > 1]
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
        return (f"stay on one process: the best distributed setting, {best.setting}, gains "
                f"only {ratio:.2f}x, less than the {WORTH_IT:.2f}x that more processes must "
                "bring")
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
        reasons = {p.why_not for p in predictions}
        return "no setting can run: " + "; ".join(sorted(reasons))
    smallest = min(runnable, key=lambda p: p.memory_per_rank / p.memory_capacity)
    text = f"does not fit: even {smallest.setting} needs {smallest.memory_detail}"
    fsdp = [p for p in runnable if p.strategy == "fsdp"]
    if fsdp and model is not None:
        p = max(fsdp, key=lambda q: q.workers)
        fixed = p.memory_per_rank - (model.state_bytes + model.activation_bytes_per_sample
                                     * model.global_batch) / p.workers
        room = p.memory_capacity - fixed
        if room <= 0:
            text += (f"; under FSDP the gathered layer and the process alone "
                     f"({_gb(fixed)}) exceed the {_gb(p.memory_capacity)} of a rank")
        else:
            need = math.ceil((model.state_bytes + model.activation_bytes_per_sample
                              * model.global_batch) / room)
            text += f"; FSDP would need at least {need} ranks of {_gb(p.memory_capacity)}"
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
    predictions = [predict("one_device", 1, model, cluster)] if "one_device" in strategies \
        else []
    predictions += [predict(s, n, model, cluster, num_ps=num_ps) for n in sorted(set(workers))
                    if n > 1 for s in strategies if s != "one_device"]
    chosen, reason = recommend(predictions, model)
    return Plan(model, cluster, predictions, chosen, reason)
