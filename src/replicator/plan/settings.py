"""What ``bench`` runs, what it found and its report: settings, results over interleaved rounds
(each figure its median round), the baseline, the table, ``report.md`` and ``results.json``."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from replicator.plan.profiles import kept_steps, save_json

__all__ = ["BENCH_STRATEGIES", "BenchReport", "Setting", "SettingResult", "baseline",
           "combine_rounds", "format_table", "load_note", "parse_settings", "positive_ints",
           "reliability_notes", "summarize", "write_bench_report"]

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
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be positive integers, got {v!r}. HINT: 1 is one "
                             f"process; e.g. {what} 1,2")
    if not values:
        raise ValueError(f"{what} is empty. HINT: give at least one number, e.g. 1,2")
    return sorted(set(values))


def parse_settings(strategies: Sequence[str] | str, nproc: Sequence[int] | str,
                   default_threads: int = 1) -> tuple[list[Setting], list[str]]:
    """Every (strategy, worker count) that can run, and a note for each skipped pair."""
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
        rounds = self.rounds
        return (max(rounds) - min(rounds)) / statistics.median(rounds) if len(rounds) > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("ranks")
        out.update(setting=self.setting.label, key=self.setting.key, strategy=self.setting.strategy,
                   workers=self.setting.workers, processes=self.setting.processes,
                   threads=self.setting.threads, spread=self.spread)
        return out


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
    ran = {re.sub(r"(?<=[a-z])(?=[A-Z])", "_", r["strategy"].removesuffix("Strategy")).lower()
           for r in workers}  # the registry's names: MirroredStrategy -> mirrored
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
    """The median round, its parts scaled to it; failed only if every round failed."""
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
    """The fastest ``one_device x1`` (default threads or one thread), as plan takes it."""
    single = [r for r in results if r.ok and r.setting.key == "one_device x1"]
    return max(single, key=lambda r: r.samples_per_second, default=None)


def reliability_notes(results: Sequence[SettingResult], load: tuple[float, float],
                      cores: int) -> list[str]:
    """Rounds far apart, or a machine busier than its cores."""
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


# -- the report ---------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 markdown: bool = False) -> str:
    """Columns padded to their widest cell (first column left-aligned), or a Markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    if markdown:
        rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"
        return "\n".join(["| " + " | ".join(cells[0]) + " |", rule]
                         + ["| " + " | ".join(row) + " |" for row in cells[1:]])
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))  # under the headers
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def load_note(load: tuple[float, float], cores: int) -> str:
    worst = max(load)
    state = "quiet" if worst < 0.5 * cores else "loaded (shared with other work)" \
        if worst > 1.2 * cores else "partly busy"
    return (f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end on "
            f"{cores} cores: {state}")


def _ceiling(bench: BenchReport, base: float | None) -> dict[int, float]:
    """Per replica count, the best throughput without its exposed communication."""
    if base is None:
        return {}
    out = {1: base}
    for r in bench.results:
        comm = r.breakdown.get("communication", 0.0) if r.ok else 0.0
        if r.ok and r.setting.workers > 1 and r.step_seconds > comm:
            rate = r.samples_per_second * r.step_seconds / (r.step_seconds - comm)
            out[r.setting.workers] = max(out.get(r.setting.workers, 0.0), rate)
    return out if len(out) > 1 else {}


def _rows(bench: BenchReport, base: float | None) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in bench.results:
        if not r.ok:
            rows.append([r.setting.label, r.setting.processes, "failed",
                         *[""] * (len(HEADERS) - 3)])
            continue
        b = r.breakdown
        # peak memory per rank: the process's, and the GPU's allocated memory where it ran
        rss, gpu = (" / ".join(f"{x / 1e6:.0f}" for x in v) for v in (r.peak_rss, r.peak_device))
        rows.append([
            r.setting.label, r.setting.processes, r.steps, ms(r.step_seconds),
            f"{r.samples_per_second:.4g}", f"{r.samples_per_second / base:.2f}x" if base else "",
            ms(b["compute"]), ms(b["communication"]), ms(r.overlapped), ms(b["input"]),
            ms(b["optimizer"]), ms(b["checkpoint"]),
            rss + (f" (GPU {gpu})" if any(r.peak_device) else "")])
    return rows


HEADERS = ("setting", "procs", "steps", "step ms", "samples/s", "vs 1 proc", "compute",
           "comm exposed", "comm overlapped", "input+loop", "optimizer", "checkpoint",
           "peak MB per rank")


def _notes(bench: BenchReport, single: Any, cores: int) -> list[str]:
    """The load first, then what the reader must know to trust (or not) the figures."""
    results = bench.results
    notes = [load_note(bench.load_average, cores)]
    if single is not None and sum(r.setting.key == "one_device x1" for r in results) > 1:
        notes.append(f"vs 1 proc: against {single.setting.label}, the faster one-process run")
    notes += reliability_notes(results, bench.load_average, cores)
    if any(r.ok and not r.comm_timing for r in results):
        notes.append("the comm room's timers were off: communication counts as compute")
    if any(r.ok and r.setting.strategy in ("fsdp", "pipeline") for r in results):
        notes.append("fsdp: FSDP2's own collectives bypass the comm room and count as compute; "
                     "pipeline: the whole schedule runs inside one guarded call and counts "
                     "as communication")
    short = [f"{r.setting.label} {r.steps} of {r.steps_asked}" for r in results
             if r.ok and 0 < r.steps < r.steps_asked]
    if short:
        notes.append("the script ended before the steps asked for (" + ", ".join(short)
                     + " measured): the figures rest on fewer steps; train longer (more "
                     "epochs or data) for steadier ones")
    return notes


def _plots(bench: BenchReport, base: float | None, notes: list[str]) -> list[str]:
    """Draw the two PNGs (with matplotlib; else a note says how to get them)."""
    from replicator.plan import plots

    root, name = Path(bench.out_dir), Path(bench.target).name
    if not plots.available():
        notes.append('no plots: matplotlib is not installed (pip install "replicator[examples]" '
                     "for bench/throughput.png and bench/breakdown.png)")
        return []
    if not any(r.ok for r in bench.results):
        return []
    points: dict[str, list[tuple[float, float]]] = {}
    for r in bench.results:
        if r.ok and r.setting.threads == 0:
            points.setdefault(r.setting.strategy, []).append(
                (float(r.setting.workers), r.samples_per_second))
    plots.throughput_plot(points, root / "throughput.png", baseline=base, ceiling=bench.ceiling,
                          title=f"{name}: throughput against replicas")
    plots.breakdown_plot([(r.setting.label, r.breakdown) for r in bench.results if r.ok],
                         root / "breakdown.png", title=f"{name}: a step's breakdown")
    return [str(root / "throughput.png"), str(root / "breakdown.png")]


def write_bench_report(bench: BenchReport, *, echo: bool = True) -> None:
    """Write ``report.md``, ``results.json`` and the two PNGs; print the table and JSON."""
    root = Path(bench.out_dir)
    single = baseline(bench.results)
    base = single.samples_per_second if single else None
    bench.ceiling = _ceiling(bench, base)
    rows = _rows(bench, base)
    cores = os.cpu_count() or 1
    notes = _notes(bench, single, cores)
    failures = [f"{r.setting.label}: {r.error}" for r in bench.results if not r.ok]
    files = _plots(bench, base, notes)
    md = [f"# replicator bench: {bench.target}", "",
          f"{platform.node() or 'this machine'}, {cores} cores; {notes[0]}.", "",
          format_table(HEADERS, rows, markdown=True), "",
          "Times are milliseconds per step, the median of the rounds (each a mean over the "
          "steps kept: the fastest and slowest tenth dropped); the parts sum to the step. "
          "*comm exposed*: time the training loop waited in collectives (incl. a parameter "
          "server's push and pull); *comm overlapped*: communication that ran on another "
          "thread meanwhile (not in the sum); *input+loop*: fetching the next batch and the "
          "loop's own code.", ""]
    md += [f"- {n}" for n in notes[1:]]
    if bench.skipped:
        md.append("- skipped: " + "; ".join(bench.skipped))
    if failures:
        md += ["", "## Failed settings", ""] + [f"- {f}" for f in failures]
    if files:
        md += ["", "![throughput](throughput.png)", "", "![breakdown](breakdown.png)"]
    (root / "report.md").write_text("\n".join(md) + "\n")
    save_json(root / "results.json", {
        "target": bench.target, "load_average": list(bench.load_average), "ceiling": bench.ceiling,
        "skipped": bench.skipped, "results": [r.to_json() for r in bench.results]})
    bench.files = files = [*files, str(root / "report.md"), str(root / "results.json")]
    if echo:
        print(format_table(HEADERS, rows))
        for line in [*(f"note: {n}" for n in notes), *(f"failed: {f}" for f in failures),
                     f"wrote {', '.join(files)}"]:
            print(line)
        for r in bench.results:
            print(json.dumps({
                "bench": "replicator bench", "setting": r.setting.label,
                "strategy": r.setting.strategy, "workers": r.setting.workers, "ok": r.ok,
                "step_s": round(r.step_seconds, 6) if r.ok else None,
                "samples_per_s": round(r.samples_per_second, 3) if r.ok else None,
                "breakdown_s": {k: round(v, 6) for k, v in r.breakdown.items()},
                "overlapped_s": round(r.overlapped, 6), "peak_rss_bytes": r.peak_rss,
                "peak_device_bytes": r.peak_device, "error": r.error or None}), flush=True)
