"""``replicator bench``: run the user's training under each setting and measure every step.

How the script is run, unchanged, under each strategy (the contract, also in docs/planning.md):

* the script builds its strategy by name from the environment variable ``REPLICATOR_STRATEGY``,
  ``strategy = rp.get_strategy(os.environ.get("REPLICATOR_STRATEGY", "mirrored"))``, or takes
  the name as an argument: ``{strategy}`` in the script's arguments is replaced by the name
  (``replicator bench demo.py -- --strategy {strategy}``);
* it trains with ``strategy.run`` (a custom loop, ``rp.Trainer`` or ``rp.Replicator``): each
  call is one step. The bench stops it after ``warmup + steps`` calls, on every rank at the
  same call, so the script's own step count does not matter.

A function works the same way: ``rp.plan.bench(train_fn)`` calls ``train_fn(strategy)`` in
each worker process with the strategy already built. The script runs in worker processes of
the ordinary launcher (``--num-ps 1`` added for the parameter server); its output goes to
``bench/logs/<setting>/rank<R>.log``. Results: ``bench/report.md``, ``bench/results.json``,
``bench/throughput.png`` and ``bench/breakdown.png``, a table on the terminal and one JSON line
per setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from replicator.plan import probe as probe_mod
from replicator.plan.profiles import kept_steps

__all__ = ["BENCH_STRATEGIES", "BenchReport", "Setting", "SettingResult", "bench_function",
           "bench_script", "parse_settings"]

#: The strategies ``bench`` knows how to launch (registry names).
BENCH_STRATEGIES = ("one_device", "mirrored", "central_storage", "parameter_server",
                    "pipeline", "fsdp")
PARTS = ("compute", "communication", "input", "optimizer", "checkpoint")
ENTRY = str(Path(__file__).with_name("bench_entry.py"))


@dataclass(frozen=True)
class Setting:
    """One way of running: ``strategy`` on ``workers`` replicas (+ ``num_ps`` servers)."""

    strategy: str
    workers: int
    num_ps: int = 0
    threads: int = 0  # torch threads per process (0: the launcher's default)

    @property
    def processes(self) -> int:
        return self.workers + self.num_ps

    @property
    def label(self) -> str:
        return f"{self.strategy} x{self.workers}"

    @property
    def slug(self) -> str:
        return f"{self.strategy}-x{self.workers}"


def _positive_ints(values: Sequence[int] | str, what: str) -> list[int]:
    if isinstance(values, str):
        try:
            values = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers such as 1,2,4, got "
                             f"{values!r}") from None
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be positive integers, got {v!r}. HINT: 1 is one "
                             "process; e.g. --nproc 1,2")
        out.append(v)
    if not out:
        raise ValueError(f"{what} is empty. HINT: give at least one number, e.g. 1,2")
    return sorted(set(out))


def parse_settings(strategies: Sequence[str] | str, nproc: Sequence[int] | str
                   ) -> tuple[list[Setting], list[str]]:
    """Every (strategy, worker count) that can run, and a note for each skipped pair:
    ``one_device`` runs only on one process, the others on two or more; a pipeline has 2
    stages, so it needs an even count; a parameter server adds one server process."""
    names = [s.strip() for s in strategies.split(",")] if isinstance(strategies, str) \
        else list(strategies)
    counts = _positive_ints(nproc, "--nproc")
    settings: list[Setting] = []
    skipped: list[str] = []
    for name in names:
        key = name.strip().lower().replace("-", "_")
        if key not in BENCH_STRATEGIES:
            raise ValueError(f"unknown strategy {name!r} for bench; available: "
                             f"{', '.join(BENCH_STRATEGIES)}")
        for n in counts:
            if key == "one_device":
                if n == 1:
                    settings.append(Setting(key, 1))
            elif n == 1:
                skipped.append(f"{key} x1 (one replica: that is one_device)")
            elif key == "pipeline" and n % 2:
                skipped.append(f"pipeline x{n} (2 stages need an even number of processes)")
            else:
                settings.append(Setting(key, n, 1 if key == "parameter_server" else 0))
    if not settings:
        raise ValueError("no setting to run from --strategies and --nproc. HINT: one_device "
                         "runs on --nproc 1, the others on 2 or more")
    return settings, skipped


@dataclass
class SettingResult:
    """What one setting measured (times in seconds, per step, means over kept steps)."""

    setting: Setting
    ok: bool
    error: str = ""
    steps: int = 0
    steps_asked: int = 0  # the steps the bench would have measured had the script gone on
    step_seconds: float = 0.0
    step_median: float = 0.0
    samples_per_second: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    overlapped: float = 0.0
    peak_rss: list[float] = field(default_factory=list)
    peak_device: list[float] = field(default_factory=list)  # GPU memory allocated; 0: CPU
    batch: float = 0.0
    comm_timing: bool = True
    log_dir: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("ranks")
        out["setting"] = self.setting.label
        out["strategy"] = self.setting.strategy
        out["workers"] = self.setting.workers
        out["processes"] = self.setting.processes
        return out


def _class_key(name: str) -> str:
    base = name.removesuffix("Strategy")
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", base).lower()


def summarize(setting: Setting, ranks: list[dict[str, Any]]) -> SettingResult:
    """Combine the ranks' records into one result (or an error saying what went wrong)."""
    workers = [r for r in ranks if r.get("records")]
    by_rank = sorted(ranks, key=lambda r: r["rank"])
    rss = [float(r.get("peak_rss_bytes", 0)) for r in by_rank]
    device = [float(r.get("peak_device_bytes", 0)) for r in by_rank]
    if not workers:
        return SettingResult(setting, False, "no step was measured: the script never called "
                             "strategy.run (HINT: train through strategy.run, rp.Trainer or "
                             "rp.Replicator), or ended before the warmup steps", peak_rss=rss,
                             ranks=ranks)
    ran = {_class_key(r["strategy"]) for r in workers}
    expected = setting.strategy
    if expected not in ran:
        return SettingResult(setting, False, f"the script ran {', '.join(sorted(ran))} "
                             f"instead of {expected}. HINT: build the strategy with "
                             "rp.get_strategy(os.environ['REPLICATOR_STRATEGY']) or pass "
                             "{strategy} in the script's arguments", peak_rss=rss, ranks=ranks)
    steps: list[float] = []
    rates: list[float] = []
    medians: list[float] = []
    overl: list[float] = []
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    replicas = max(int(r.get("replicas", 1)) for r in workers)
    batch = statistics.mean(float(r.get("batch", 0)) for r in workers)
    for r in workers:
        kept = kept_steps(r["records"])
        step = statistics.mean(k["step"] for k in kept)
        steps.append(step)
        medians.append(statistics.median(k["step"] for k in r["records"]))
        for p in PARTS:
            parts[p].append(statistics.mean(k[p] for k in kept))
        overl.append(statistics.mean(k["overlapped"] for k in kept))
        rates.append(float(r.get("batch", 0)) / step if step > 0 else 0.0)
    return SettingResult(
        setting, True, steps=min(len(r["records"]) for r in workers),
        step_seconds=statistics.mean(steps), step_median=statistics.mean(medians),
        samples_per_second=replicas * statistics.mean(rates),
        breakdown={p: statistics.mean(v) for p, v in parts.items()},
        overlapped=statistics.mean(overl), peak_rss=rss, peak_device=device, batch=batch,
        comm_timing=all(r.get("comm_timing", False) for r in workers), ranks=ranks)


# -- running one setting -------------------------------------------------------------------
@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _bench_env(setting: Setting, out: Path, steps: int, warmup: int, mode: str
               ) -> dict[str, str]:
    env = {probe_mod.STRATEGY_ENV: setting.strategy, probe_mod.OUT_ENV: str(out),
           probe_mod.STEPS_ENV: str(steps), probe_mod.WARMUP_ENV: str(warmup),
           probe_mod.MODE_ENV: mode, "REPLICATOR_COMM_TIMING": "1"}
    if setting.threads:
        env["OMP_NUM_THREADS"] = str(setting.threads)
    return env


def _read_ranks(out: Path) -> list[dict[str, Any]]:
    ranks = []
    for path in sorted(out.glob("rank*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            ranks.append(json.loads(path.read_text()))
    return ranks


def _failure_text(exc: BaseException, out: Path) -> str:
    first = str(exc).strip().splitlines()
    head = first[0] if first else type(exc).__name__
    tail = [line for line in first if line.strip()][-1:] if len(first) > 1 else []
    return f"{head}{' ... ' + tail[0] if tail else ''} (logs: {out})"


def run_setting(setting: Setting, out: Path, launch: Callable[[], None], steps: int,
                warmup: int, mode: str = "bench") -> SettingResult:
    """Run ``launch()`` with the bench environment for ``setting``; read the ranks' files."""
    from replicator.errors import ReplicatorError

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    error = ""
    with _environment(_bench_env(setting, out, steps, warmup, mode)):
        try:
            launch()
        except (ReplicatorError, OSError, ValueError) as exc:
            error = _failure_text(exc, out)
    result = summarize(setting, _read_ranks(out))
    if error:
        result.ok, result.error = False, error
    result.steps_asked = steps
    result.log_dir = str(out)
    return result


def _script_launcher(script: str, args: Sequence[str], setting: Setting
                     ) -> Callable[[], None]:
    from replicator.launch.launcher import run_script

    argv = [a.replace("{strategy}", setting.strategy) for a in args]

    def launch() -> None:
        run_script(ENTRY, [script, *argv], setting.processes, num_ps=setting.num_ps,
                   quiet_workers=True, timeout_seconds=120.0)

    return launch


def _function_worker(train_fn: Callable[[Any], Any], name: str) -> None:
    """One worker of :func:`bench_function`: the probe, the strategy, then ``train_fn``."""
    import replicator as rp
    from replicator.plan.bench_entry import _redirect_output

    out = os.environ[probe_mod.OUT_ENV]
    rank = int(os.environ.get("RANK", "0"))
    _redirect_output(out, rank)
    probe = probe_mod.Probe(int(os.environ[probe_mod.STEPS_ENV]),
                            int(os.environ[probe_mod.WARMUP_ENV]),
                            os.environ.get(probe_mod.MODE_ENV, "bench"))
    probe.install(progress_path=os.path.join(out, "progress"))
    try:
        strategy = rp.get_strategy(name)
        train_fn(strategy)
    except probe_mod.BenchComplete:
        pass
    finally:
        probe.uninstall()
        probe.write(out)


def _function_launcher(train_fn: Callable[[Any], Any], setting: Setting
                       ) -> Callable[[], None]:
    from replicator.launch import launch as rp_launch

    def launch() -> None:
        rp_launch(_function_worker, num_replicas=setting.processes, num_ps=setting.num_ps,
                  args=(train_fn, setting.strategy), timeout_seconds=120.0)

    return launch


# -- progress --------------------------------------------------------------------------------
class _Progress:
    """A bar per setting (a terminal) or a line per setting, fed from the chief's file."""

    def __init__(self) -> None:
        self.rich: Any = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.rich = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
            self.rich.start()

    @contextlib.contextmanager
    def track(self, label: str, out: Path, total: int) -> Iterator[None]:
        task = self.rich.add_task(label, total=total, note="") if self.rich else None
        stop = threading.Event()
        started = time.perf_counter()

        def poll() -> None:
            while not stop.wait(0.2):
                with contextlib.suppress(OSError, ValueError):
                    done = int((out / "progress").read_text() or 0)
                    if self.rich is not None:
                        self.rich.update(task, completed=done)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            seconds = time.perf_counter() - started
            if self.rich is not None:
                self.rich.update(task, completed=total, note=f"{seconds:.1f} s")
            else:
                print(f"bench: {label} done in {seconds:.1f} s", flush=True)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()


# -- the whole bench -----------------------------------------------------------------------
@dataclass
class BenchReport:
    """Every setting's result, where the files went, and the machine's state."""

    target: str
    results: list[SettingResult]
    skipped: list[str]
    out_dir: str
    load_average: tuple[float, float]
    ceiling: dict[int, float] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def result(self, label: str) -> SettingResult | None:
        return next((r for r in self.results if r.setting.label == label), None)


def _run_all(target: str, settings: list[Setting], skipped: list[str], out_dir: str,
             steps: int, warmup: int, make_launch: Callable[[Setting], Callable[[], None]],
             *, report: bool = True, quiet: bool = False,
             steps_for: Callable[[Setting], int] | None = None) -> BenchReport:
    """Run each setting in turn (``steps_for(setting)`` measured steps where given, else
    ``steps``) and write the report."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"--steps must be an integer >= 2, got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    progress = _Progress() if not quiet else None
    results = []
    try:
        for setting in settings:
            out = root / "logs" / setting.slug
            measured = max(steps, steps_for(setting)) if steps_for is not None else steps
            track = progress.track(setting.label, out, warmup + measured) if progress else \
                contextlib.nullcontext()
            with track:
                results.append(run_setting(setting, out, make_launch(setting), measured,
                                           warmup))
    finally:
        if progress:
            progress.close()
    bench = BenchReport(target, results, skipped, str(root),
                        (load_start, os.getloadavg()[0]))
    if report:
        from replicator.plan.report import write_bench_report

        write_bench_report(bench, echo=not quiet)  # quiet: --json prints only the plan
    return bench


def bench_script(script: str, script_args: Sequence[str] = (), *,
                 nproc: Sequence[int] | str = (1, 2),
                 strategies: Sequence[str] | str = ("one_device", "mirrored"),
                 steps: int = 30, warmup: int = 3, out_dir: str = "bench",
                 report: bool = True, quiet: bool = False) -> BenchReport:
    """Run ``script`` under every setting (see the module doc); write the report."""
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} not found (looked in {os.getcwd()}). HINT: give "
                         "the path of the training script")
    settings, skipped = parse_settings(strategies, nproc)
    return _run_all(script, settings, skipped, out_dir, steps, warmup,
                    lambda s: _script_launcher(script, script_args, s), report=report,
                    quiet=quiet)


def bench_function(train_fn: Callable[[Any], Any], *, nproc: Sequence[int] | str = (1, 2),
                   strategies: Sequence[str] | str = ("one_device", "mirrored"),
                   steps: int = 30, warmup: int = 3, out_dir: str = "bench",
                   report: bool = True, quiet: bool = False) -> BenchReport:
    """``rp.plan.bench(train_fn)``: call ``train_fn(strategy)`` under every setting.

    ``train_fn`` must be importable by the worker processes (a module-level function); it
    trains with ``strategy.run`` and may loop for as long as it likes: the bench stops it
    after ``warmup + steps`` steps.
    """
    if not callable(train_fn):
        raise TypeError(f"bench needs a callable train_fn(strategy), got "
                        f"{type(train_fn).__name__}")
    settings, skipped = parse_settings(strategies, nproc)
    name = getattr(train_fn, "__qualname__", repr(train_fn))
    return _run_all(name, settings, skipped, out_dir, steps, warmup,
                    lambda s: _function_launcher(train_fn, s), report=report, quiet=quiet)


def temporary_out_dir() -> str:
    """A private folder for runs whose files are not kept (profiles, validation)."""
    return tempfile.mkdtemp(prefix="replicator-bench-")
