"""``replicator bench``: run the user's training under each setting and measure every step.

The script runs unchanged (the contract: docs/planning.md) and trains through ``strategy.run``,
which the bench stops after ``warmup + steps`` calls. The settings run in interleaved rounds,
each figure its median round, so that a busy minute lands on every setting.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from replicator.plan import probe as probe_mod
from replicator.plan.settings import (
    BenchReport,
    Setting,
    SettingResult,
    combine_rounds,
    parse_settings,
    summarize,
    write_bench_report,
)

__all__ = ["bench_function", "bench_script", "input_notes", "input_share", "launcher",
           "limiting_stage", "run_setting"]

ENTRY = str(Path(__file__).with_name("bench_entry.py"))
#: A step waiting this share of its time for input is input-bound (tf.data's fleet study
#: counts the jobs that wait more than a third of their time).
INPUT_BOUND_SHARE = 1 / 3
#: A stage whose consumer waited less than this share of its time for it limits nothing.
STAGE_WAIT = 0.05


# -- input: is the step waiting for it, and which stage limits it ---------------------------
def limiting_stage(pipelines: Sequence[dict[str, Any]]) -> str | None:
    """The ``rp.data`` stage the step waited for longest (prefetch aside), else the ordered part."""
    stages = [(name, st, p) for p in pipelines for name, st in p.get("stages", {}).items()
              if name != "prefetch" and st.get("tasks")]
    if not pipelines:
        return None
    name, st, p = max(stages, key=lambda s: s[1]["wait_share"],
                      default=("", {"wait_share": 0.0}, {}))
    if st["wait_share"] < STAGE_WAIT:
        return (f"the ordered part of `{pipelines[0]['pipeline']}` (sources, shuffle, filter, "
                "cache: read by the consumer, not by workers)")
    if not st["autotune"]:
        room = (f"fixed by num_parallel_calls; the CPU budget is {p['cpu_budget']}: "
                "rp.data.AUTOTUNE chooses within it")
    elif st["parallelism"] >= st["max_parallelism"]:
        room = "at its CPU budget: more cores or a cheaper map would help"
    else:
        room = f"below its CPU budget of {st['max_parallelism']}"
    return (f"`{name}` (waited for {st['wait_share']:.0%} of the time; {st['parallelism']} "
            f"workers, {st['task_ms']:.1f} ms per task, {room})")


def input_share(r: SettingResult) -> float:
    """The share of a step that waits for input: the median step's, averaged over the ranks
    (an input-bound script waits at nearly every step, not at one a neighbour preempted)."""
    if not r.ok or not r.step_seconds:
        return 0.0
    shares = [statistics.median(k["input"] / k["step"] if k["step"] > 0 else 0.0
                                for k in rank["records"])
              for rank in r.ranks if rank.get("records")]
    return statistics.mean(shares) if shares else r.breakdown.get("input", 0.0) / r.step_seconds


def input_notes(bench: BenchReport) -> list[str]:
    """A line per setting whose median step waits a third or more for input, naming the stage."""
    notes = []
    for r in bench.results:
        share = input_share(r)
        if share < INPUT_BOUND_SHARE:
            continue
        chief = min(r.ranks, key=lambda rank: rank.get("rank", 0), default={})
        stage = limiting_stage(chief.get("input_pipelines", []))
        notes.append(f"{r.setting.label} is input-bound: {share:.0%} of each step waits for "
                     "input; " + (f"the limiting stage is {stage}" if stage else
                                  "an rp.data.Dataset pipeline would name the stage limiting it"))
    return notes


# -- running one setting -------------------------------------------------------------------
def _read_ranks(out: Path) -> list[dict[str, Any]]:
    ranks = []
    for path in sorted(out.glob("rank*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            ranks.append(json.loads(path.read_text()))
    return ranks


def run_setting(setting: Setting, out: Path, launch: Callable[[], object], steps: int,
                warmup: int, mode: str = "bench") -> SettingResult:
    """Run ``launch()`` with the bench environment for ``setting``; read the ranks' files."""
    from replicator.errors import ReplicatorError

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {probe_mod.STRATEGY_ENV: setting.strategy, probe_mod.OUT_ENV: str(out),
           probe_mod.STEPS_ENV: str(steps), probe_mod.WARMUP_ENV: str(warmup),
           probe_mod.MODE_ENV: mode, "REPLICATOR_COMM_TIMING": "1"}
    if setting.threads:
        env["OMP_NUM_THREADS"] = str(setting.threads)
    error, saved = "", {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        launch()
    except (ReplicatorError, OSError, ValueError) as exc:  # its first and last lines
        lines = str(exc).strip().splitlines()
        tail = [line for line in lines if line.strip()][-1:] if len(lines) > 1 else []
        error = (f"{lines[0] if lines else type(exc).__name__}"
                 f"{' ... ' + tail[0] if tail else ''} (logs: {out})")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result = summarize(setting, _read_ranks(out))
    if error:
        result.ok, result.error = False, error
    result.steps_asked, result.log_dir = steps, str(out)
    return result


#: What the bench runs: a script's path, or a function called with the strategy.
Target = str | Callable[[Any], Any]


def _function_worker(train_fn: Callable[[Any], Any], name: str) -> None:
    """One worker of :func:`bench_function`: ``train_fn`` with the strategy, under the probe."""
    import replicator as rp
    from replicator.plan.bench_entry import run_probed

    run_probed(lambda: train_fn(rp.get_strategy(name)))


def launcher(target: Target, script_args: Sequence[str], setting: Setting
             ) -> Callable[[], object]:
    """How ``setting`` runs ``target``: a script through the bench's entry, or a function."""
    if callable(target):
        from replicator.launch import launch

        return lambda: launch(_function_worker, num_replicas=setting.processes,
                              num_ps=setting.num_ps, args=(target, setting.strategy),
                              timeout_seconds=120.0)
    from replicator.launch.script_launch import run_script

    argv = [a.replace("{strategy}", setting.strategy) for a in script_args]
    return lambda: run_script(ENTRY, [target, *argv], setting.processes, num_ps=setting.num_ps,
                              quiet_workers=True, timeout_seconds=120.0)


# -- progress --------------------------------------------------------------------------------
@contextlib.contextmanager
def _tracked(bar: Any, label: str, out: Path, total: int) -> Iterator[None]:
    """A setting's bar fed from the chief's progress file, or a line when it is done."""
    task = bar.add_task(label, total=total, note="") if bar else None
    stop = threading.Event()
    started = time.perf_counter()

    def poll() -> None:
        while not stop.wait(0.2):
            with contextlib.suppress(OSError, ValueError):
                bar.update(task, completed=int((out / "progress").read_text() or 0))

    thread = threading.Thread(target=poll, daemon=True)
    if bar:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        seconds = time.perf_counter() - started
        if bar:
            thread.join()
            bar.update(task, completed=total, note=f"{seconds:.1f} s")
        else:
            print(f"bench: {label} done in {seconds:.1f} s", flush=True)


# -- the whole bench -----------------------------------------------------------------------
def _run_all(target: str, settings: list[Setting], skipped: list[str], out_dir: str,
             steps: int, warmup: int, make_launch: Callable[[Setting], Callable[[], object]],
             *, report: bool = True, quiet: bool = False, rounds: int = 1,
             steps_for: Callable[[Setting], int] | None = None) -> BenchReport:
    """Every setting once per round, in turn, the steps split over the rounds; write the report."""
    for name, value, least in (("--steps", steps, 2), ("warmup", warmup, 0),
                               ("--rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    bar = None
    if not quiet and sys.stdout.isatty():  # a rich progress display on a terminal
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        bar = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                       MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
        bar.start()
    runs: dict[Setting, list[SettingResult]] = {s: [] for s in settings}
    try:
        for k in range(rounds):
            for setting in settings:
                out = root / "logs" / (setting.slug + (f"-r{k + 1}" if rounds > 1 else ""))
                total = max(steps, steps_for(setting)) if steps_for is not None else steps
                measured = max(2, math.ceil(total / rounds))
                track = contextlib.nullcontext() if quiet else _tracked(
                    bar, setting.label, out, warmup + measured)
                with track:
                    runs[setting].append(run_setting(setting, out, make_launch(setting),
                                                     measured, warmup))
    finally:
        if bar:
            bar.stop()
    bench = BenchReport(target, [combine_rounds(runs[s]) for s in settings], skipped,
                        str(root), (load_start, os.getloadavg()[0]))
    if report:  # quiet: --json prints only the plan
        write_bench_report(bench, echo=not quiet)
        notes = input_notes(bench) or ["no setting is input-bound (each waits less than a "
                                       "third of its step for input)"]
        if (root / "report.md").exists():
            with (root / "report.md").open("a") as f:
                f.write("\n## Input\n\n" + "".join(f"- {n}\n" for n in notes))
        if not quiet:
            print("\n".join(f"input: {n}" for n in notes), flush=True)
    return bench


def _default_threads(processes: int = 1) -> int:
    """The threads the launcher gives each of ``processes`` processes here."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // processes))


def bench_script(script: str, script_args: Sequence[str] = (), *,
                 nproc: Sequence[int] | str = (1, 2),
                 strategies: Sequence[str] | str = ("one_device", "mirrored"),
                 steps: int = 30, warmup: int = 3, out_dir: str = "bench",
                 report: bool = True, quiet: bool = False, rounds: int = 3) -> BenchReport:
    """Run ``script`` under every setting, ``rounds`` times in turn; write the report."""
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} not found (looked in {os.getcwd()}). HINT: give "
                         "the path of the training script")
    settings, skipped = parse_settings(strategies, nproc, _default_threads())
    return _run_all(script, settings, skipped, out_dir, steps, warmup,
                    lambda s: launcher(script, script_args, s), report=report,
                    quiet=quiet, rounds=rounds)


def bench_function(train_fn: Callable[[Any], Any], *, nproc: Sequence[int] | str = (1, 2),
                   strategies: Sequence[str] | str = ("one_device", "mirrored"),
                   steps: int = 30, warmup: int = 3, out_dir: str = "bench",
                   report: bool = True, quiet: bool = False, rounds: int = 3) -> BenchReport:
    """``rp.plan.bench``: ``train_fn(strategy)`` (importable by workers) under every setting."""
    if not callable(train_fn):
        raise TypeError(f"bench needs a callable train_fn(strategy), got "
                        f"{type(train_fn).__name__}")
    settings, skipped = parse_settings(strategies, nproc, _default_threads())
    name = getattr(train_fn, "__qualname__", repr(train_fn))
    return _run_all(name, settings, skipped, out_dir, steps, warmup,
                    lambda s: launcher(train_fn, (), s), report=report, quiet=quiet,
                    rounds=rounds)
