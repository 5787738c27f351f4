"""What ``bench`` runs and what it found: settings, per-setting results, rounds, the baseline.

Data only (no processes are started here), so that the report and the runner both read it
without importing each other. A setting runs in several interleaved rounds (every setting once,
then again): each setting's figure is its median round, and the spread between its rounds says
how much the machine's load moved it. The one-process baseline is the faster of one process
at the launcher's default threads and at one thread, as ``plan`` predicts it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from replicator.plan.profiles import kept_steps

__all__ = ["BENCH_STRATEGIES", "BenchReport", "Setting", "SettingResult", "baseline",
           "combine_rounds", "parse_settings", "positive_ints", "reliability_notes",
           "summarize"]

#: The strategies ``bench`` knows how to launch (registry names).
BENCH_STRATEGIES = ("one_device", "mirrored", "central_storage", "parameter_server",
                    "pipeline", "fsdp")
PARTS = ("compute", "communication", "input", "optimizer", "checkpoint")
#: Rounds of one setting further apart than this (max - min over the median) are unreliable.
SPREAD_LIMIT = 0.25


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
    def key(self) -> str:
        """The setting as the plan names it (threads aside)."""
        return f"{self.strategy} x{self.workers}"

    @property
    def label(self) -> str:
        return self.key + (f" ({self.threads} thread{'s' * (self.threads > 1)})"
                           if self.threads else "")

    @property
    def slug(self) -> str:
        return f"{self.strategy}-x{self.workers}" + (f"-t{self.threads}" if self.threads else "")


def positive_ints(values: Sequence[int] | str, what: str) -> list[int]:
    """Comma-separated positive integers (or a sequence of them), sorted, each once."""
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
                             f"process; e.g. {what} 1,2")
        out.append(v)
    if not out:
        raise ValueError(f"{what} is empty. HINT: give at least one number, e.g. 1,2")
    return sorted(set(out))


def parse_settings(strategies: Sequence[str] | str, nproc: Sequence[int] | str,
                   default_threads: int = 1) -> tuple[list[Setting], list[str]]:
    """Every (strategy, worker count) that can run, and a note for each skipped pair:
    ``one_device`` runs only on one process (and, where one process gets more than one
    thread, on one thread too: the baseline is the faster), the others on two or more; a
    pipeline has 2 stages, so it needs an even count; a parameter server adds one server."""
    names = [s.strip() for s in strategies.split(",")] if isinstance(strategies, str) \
        else list(strategies)
    counts = positive_ints(nproc, "--nproc")
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
                    if default_threads > 1:
                        settings.append(Setting(key, 1, threads=1))
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
    rounds: list[float] = field(default_factory=list)  # each round's step seconds
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(slowest - fastest round) / the median round; 0 with one round."""
        if len(self.rounds) < 2:
            return 0.0
        return (max(self.rounds) - min(self.rounds)) / statistics.median(self.rounds)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("ranks")
        out.update(setting=self.setting.label, key=self.setting.key, strategy=self.setting.strategy,
                   workers=self.setting.workers, processes=self.setting.processes,
                   threads=self.setting.threads, spread=self.spread)
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
    if setting.strategy not in ran:
        return SettingResult(setting, False, f"the script ran {', '.join(sorted(ran))} "
                             f"instead of {setting.strategy}. HINT: build the strategy with "
                             "rp.get_strategy(os.environ['REPLICATOR_STRATEGY']) or pass "
                             "{strategy} in the script's arguments", peak_rss=rss, ranks=ranks)
    kept = [kept_steps(r["records"]) for r in workers]
    steps = [statistics.mean(k["step"] for k in rows) for rows in kept]
    rates = [float(r.get("batch", 0)) / s if s > 0 else 0.0 for r, s in zip(workers, steps)]
    replicas = max(int(r.get("replicas", 1)) for r in workers)
    return SettingResult(
        setting, True, steps=min(len(r["records"]) for r in workers),
        step_seconds=statistics.mean(steps),
        step_median=statistics.mean(statistics.median(k["step"] for k in r["records"])
                                    for r in workers),
        samples_per_second=replicas * statistics.mean(rates),
        breakdown={p: statistics.mean(statistics.mean(k[p] for k in rows) for rows in kept)
                   for p in PARTS},
        overlapped=statistics.mean(statistics.mean(k["overlapped"] for k in rows)
                                   for rows in kept),
        peak_rss=rss, peak_device=device,
        batch=statistics.mean(float(r.get("batch", 0)) for r in workers),
        comm_timing=all(r.get("comm_timing", False) for r in workers), ranks=ranks)


def combine_rounds(rounds: Sequence[SettingResult]) -> SettingResult:
    """One setting's result over its rounds: the median step, with the parts of the round
    nearest it (scaled to sum to the median) and every round's step kept (``rounds``) for the
    spread; a failed round fails the setting only when every round failed."""
    ok = [r for r in rounds if r.ok]
    if not ok:
        return rounds[-1]
    median = statistics.median(r.step_seconds for r in ok)
    chosen = min(ok, key=lambda r: abs(r.step_seconds - median))
    scale = median / chosen.step_seconds if chosen.step_seconds > 0 else 1.0
    return replace(chosen, step_seconds=median, rounds=[r.step_seconds for r in ok],
                   samples_per_second=chosen.samples_per_second / scale,
                   breakdown={k: v * scale for k, v in chosen.breakdown.items()},
                   overlapped=chosen.overlapped * scale,
                   steps=sum(r.steps for r in ok), steps_asked=sum(r.steps_asked for r in ok))


def baseline(results: Sequence[SettingResult]) -> SettingResult | None:
    """The one-process figure the others are compared with: the fastest ``one_device x1``
    (the launcher's default threads, or one thread where that is faster), as plan takes it."""
    single = [r for r in results if r.ok and r.setting.key == "one_device x1"]
    return max(single, key=lambda r: r.samples_per_second, default=None)


def reliability_notes(results: Sequence[SettingResult], load: tuple[float, float],
                      cores: int) -> list[str]:
    """What makes the figures unreliable: rounds of a setting far apart, or a machine busier
    than its cores (other work then takes a share of every setting's time)."""
    notes = []
    wide = [f"{r.setting.label} {r.spread:.0%}" for r in results
            if r.ok and r.spread > SPREAD_LIMIT]
    if wide:
        notes.append("unreliable: the rounds of " + ", ".join(wide) + " differed by more "
                     f"than {SPREAD_LIMIT:.0%} (the machine's load moved them); run again "
                     "on a quieter machine or with more --rounds")
    if max(load) > cores:
        notes.append(f"unreliable: the load average ({max(load):.1f}) was above the {cores} "
                     "cores, so other work took part of every setting's time")
    return notes


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
