"""``replicator plan --validate``: run the settings this machine can run, compare with the plan.

Runnable here: ``cpu`` plans whose setting fits on this host (one host, at most
:data:`MAX_LOCAL_PROCESSES` processes; the pipeline as 2 stages, which is what
``PipelineStrategy()`` builds). Each runs through ``bench`` (the same probe and launcher), and
its mean step time is set beside the prediction; the error is ``(predicted - measured) /
measured``. The goal is within :data:`GOAL` for every setting; the summary says how the
machine was loaded while it ran, since a shared 2-core machine moves these figures a lot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replicator.plan.benchmark import (
    BENCH_STRATEGIES,
    BenchReport,
    Setting,
    _function_launcher,
    _run_all,
    _script_launcher,
)
from replicator.plan.cost_model import Prediction
from replicator.plan.recommend import Plan

__all__ = ["GOAL", "MAX_LOCAL_PROCESSES", "runnable_here", "summary", "validate"]

#: The error the cost model aims to stay within on this machine.
GOAL = 0.20
#: Processes one validation setting may start on this machine.
MAX_LOCAL_PROCESSES = 4


def runnable_here(p: Prediction, plan: Plan) -> bool:
    """Whether ``p`` can run on this machine as predicted."""
    return (plan.cluster.device.is_cpu and p.feasible and p.fits and p.hosts == 1
            and p.processes <= MAX_LOCAL_PROCESSES and p.strategy in BENCH_STRATEGIES
            and (p.strategy != "pipeline" or p.workers == 2))


def _settings(plan: Plan) -> list[Setting]:
    out = []
    for p in plan.predictions:
        if runnable_here(p, plan):
            out.append(Setting(p.strategy, p.workers,
                               p.processes - p.workers, threads=p.threads))
    return out


def validate(plan: Plan, *, script: str | None = None, script_args: tuple[str, ...] = (),
             train_fn: Callable[[Any], Any] | None = None, out_dir: str = "bench",
             steps: int = 20, warmup: int = 3, quiet: bool = False) -> BenchReport:
    """Run every runnable setting of ``plan`` (a script or a function) and fill
    ``plan.measured`` with the measured step times; returns the bench report (written to
    ``out_dir/validate``)."""
    if (script is None) == (train_fn is None):
        raise ValueError("validate needs the script or the function the plan was made for. "
                         "HINT: --validate works with a script, not with --model-params alone")
    settings = _settings(plan)
    if not settings:
        raise ValueError("no setting of this plan can run on this machine (a cpu plan with "
                         f"settings of at most {MAX_LOCAL_PROCESSES} processes on one host). "
                         "HINT: --device cpu --workers 1,2,3,4 --per-host 4")
    target = script if script is not None else str(getattr(train_fn, "__qualname__",
                                                           "train_fn"))
    if script is not None:
        def make(s: Setting) -> Callable[[], None]:
            return _script_launcher(script, script_args, s)
    else:
        assert train_fn is not None

        def make(s: Setting) -> Callable[[], None]:
            return _function_launcher(train_fn, s)

    report = _run_all(target, settings, [], str(Path(out_dir) / "validate"), steps, warmup,
                      make, report=True, quiet=quiet)
    for r in report.results:
        plan.measured[r.setting.label] = r.step_seconds if r.ok else None
    return report


def summary(plan: Plan, report: BenchReport) -> str:
    """One paragraph: how many settings ran, the errors against the goal, the load."""
    from replicator.plan.report import load_note

    errors = []
    for p in plan.predictions:
        got = plan.measured.get(p.setting)
        if got:
            errors.append((abs(p.step_seconds - got) / got, p.setting))
    failed = [r.setting.label for r in report.results if not r.ok]
    text = f"validated {len(errors)} setting(s) on this machine"
    if errors:
        mean = sum(e for e, _ in errors) / len(errors)
        worst = max(errors)
        within = sum(1 for e, _ in errors if e <= GOAL)
        text += (f": mean |error| {mean:.0%}, worst {worst[0]:.0%} ({worst[1]}); "
                 f"{within} of {len(errors)} within the {GOAL:.0%} goal")
    if failed:
        text += f"; failed to run: {', '.join(failed)} (see {report.out_dir}/report.md)"
    return text + "; " + load_note(report.load_average, os.cpu_count() or 1)
