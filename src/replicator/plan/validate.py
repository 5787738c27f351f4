"""``replicator plan --validate``: run the settings this machine can run, compare with the plan.
With ``repeat`` > 1 the profile, the machine and every setting are taken in turn and medians
compared, so that the machine's swings reach both sides alike."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from replicator.plan.benchmark import Target, _run_all, launcher
from replicator.plan.cost_model import Prediction
from replicator.plan.planner import Plan
from replicator.plan.profiles import MachineProfile, ModelProfile
from replicator.plan.settings import (
    BENCH_STRATEGIES,
    BenchReport,
    Setting,
    combine_rounds,
    load_note,
    write_bench_report,
)

__all__ = ["GOAL", "MAX_LOCAL_PROCESSES", "MIN_MEASURED_SECONDS", "combine_passes",
           "runnable_here", "summary", "validate", "validate_interleaved"]

#: The error the cost model aims to stay within on this machine.
GOAL = 0.20
#: Processes one validation setting may start on this machine.
MAX_LOCAL_PROCESSES = 4
#: Each setting measures at least this long (by its predicted step), steps permitting.
MIN_MEASURED_SECONDS = 1.0
#: ... but never more steps than this.
MAX_MEASURED_STEPS = 2000


def runnable_here(p: Prediction, plan: Plan) -> bool:
    """Whether ``p`` can run on this machine as predicted."""
    return (plan.cluster.device.is_cpu and p.feasible and p.fits and p.hosts == 1
            and p.processes <= MAX_LOCAL_PROCESSES and p.strategy in BENCH_STRATEGIES
            and (p.strategy != "pipeline" or p.workers == 2))


def steps_to_measure(p: Prediction, steps: int,
                     min_seconds: float = MIN_MEASURED_SECONDS) -> int:
    """``steps``, or more to last ``min_seconds`` (at most :data:`MAX_MEASURED_STEPS`)."""
    return (steps if p.step_seconds <= 0
            else max(steps, min(math.ceil(min_seconds / p.step_seconds), MAX_MEASURED_STEPS)))


def validate(plan: Plan, target: Target, script_args: tuple[str, ...] = (), *,
             out_dir: str = "bench", steps: int = 20, warmup: int = 3, quiet: bool = False,
             min_seconds: float = MIN_MEASURED_SECONDS, folder: str = "validate"
             ) -> BenchReport:
    """Run ``plan``'s runnable settings of ``target`` and fill ``plan.measured``."""
    settings = [Setting(p.strategy, p.workers, p.processes - p.workers, threads=p.threads)
                for p in plan.predictions if runnable_here(p, plan)]
    if not settings:
        device = plan.cluster.device
        why = (f"a plan for {device.name} is predicted from nominal figures, and --validate "
               "measures CPU plans only" if not device.is_cpu else
               f"every setting needs more than {MAX_LOCAL_PROCESSES} processes or one host")
        raise ValueError("no setting of this plan can run on this machine: --validate runs "
                         f"settings of a --device cpu plan with at most {MAX_LOCAL_PROCESSES} "
                         f"processes on one host ({why}). "
                         "HINT: --device cpu --workers 1,2,3,4 --per-host 4")
    name = target if isinstance(target, str) else getattr(target, "__qualname__", "train_fn")
    predicted = {p.setting: p for p in plan.predictions}

    def steps_for(s: Setting) -> int:
        p = predicted.get(s.key)
        return steps_to_measure(p, steps, min_seconds) if p is not None else steps

    report = _run_all(name, settings, [], str(Path(out_dir) / folder), steps, warmup,
                      lambda s: launcher(target, script_args, s), report=True, quiet=quiet,
                      steps_for=steps_for)
    for r in report.results:
        plan.measured[r.setting.key] = r.step_seconds if r.ok else None
    return report


def combine_passes(reports: list[BenchReport], out_dir: str, echo: bool = True
                   ) -> tuple[dict[str, float | None], BenchReport]:
    """Each setting's median step over ``reports``, and one report of them."""
    results = [combine_rounds([r for rep in reports
                               if (r := rep.result(first.setting.label)) is not None])
               for first in reports[0].results]
    measured = {r.setting.key: r.step_seconds if r.ok else None for r in results}
    loads = [rep.load_average for rep in reports]
    combined = BenchReport(reports[0].target, results, reports[0].skipped, out_dir,
                           (loads[0][0], loads[-1][1]))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_bench_report(combined, echo=echo)
    return measured, combined


def validate_interleaved(model: ModelProfile, machine: MachineProfile,
                         make_plan: Callable[[ModelProfile, MachineProfile], Plan],
                         reprofile: Callable[[], ModelProfile],
                         remeasure: Callable[[], MachineProfile] | None, repeat: int,
                         target: Target, script_args: tuple[str, ...] = (), *,
                         out_dir: str = "bench", steps: int = 20, warmup: int = 3,
                         quiet: bool = False, log: Callable[[str], None] = print
                         ) -> tuple[Plan, BenchReport]:
    """``repeat`` passes; the plan of the median profiles, each setting's median step."""
    plan = make_plan(model, machine)
    if repeat == 1:
        return plan, validate(plan, target, script_args, out_dir=out_dir, steps=steps,
                              warmup=warmup, quiet=quiet)
    models, machines, reports = [model], [machine], []
    for i in range(repeat):
        log(f"pass {i + 1} of {repeat}" + (": profiling again ..." if i else ""))
        if i:
            models.append(reprofile())
            if remeasure is not None:
                machines.append(remeasure())
        last = models[-1]
        one_thread = last.compute_1thread(last.global_batch)
        log(f"pass {i + 1}: the profile's step {last.step_seconds * 1e3:.3g} ms (forward and "
            f"backward on one thread {one_thread * 1e3:.3g} ms)")
        reports.append(validate(plan, target, script_args, out_dir=out_dir, steps=steps,
                                warmup=warmup, quiet=quiet, folder=f"validate/pass{i + 1}"))
    final = make_plan(ModelProfile.median_of(models), MachineProfile.median_of(machines))
    if not quiet:
        log(f"each setting's median of {repeat} passes, against the plan of the median "
            "profile" + (" and machine figures:" if len(machines) > 1 else ":"))
    final.measured, report = combine_passes(reports, str(Path(out_dir) / "validate"),
                                            echo=not quiet)
    return final, report


def summary(plan: Plan, report: BenchReport) -> str:
    """One paragraph: how many settings ran, the errors against the goal, the load."""
    errors = [(abs(p.step_seconds - got) / got, p.setting) for p in plan.predictions
              if (got := plan.measured.get(p.setting))]
    failed = [r.setting.label for r in report.results if not r.ok]
    text = f"validated {len(errors)} setting(s) on this machine"
    if errors:
        mean, worst = sum(e for e, _ in errors) / len(errors), max(errors)
        text += (f": mean |error| {mean:.0%}, worst {worst[0]:.0%} ({worst[1]}); "
                 f"{sum(1 for e, _ in errors if e <= GOAL)} of {len(errors)} within the "
                 f"{GOAL:.0%} goal")
    if failed:
        text += f"; failed to run: {', '.join(failed)} (see {report.out_dir}/report.md)"
    return text + "; " + load_note(report.load_average, os.cpu_count() or 1)
