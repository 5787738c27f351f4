"""Tables, ``report.md`` and JSON lines of ``bench`` (the plan's table is in ``planner.py``).

A benchmark prints a readable table and ends with one JSON line per setting; the same table
goes to ``bench/report.md`` with the load of the machine during the run, and the raw numbers
to ``bench/results.json``.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicator.plan.profiles import MachineProfile, save_json
from replicator.plan.settings import BenchReport, baseline, reliability_notes

__all__ = ["format_table", "machine_profile_cached", "write_bench_report"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 markdown: bool = False) -> str:
    """Columns padded to their widest cell (first column left-aligned), or a Markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f}"


def machine_profile_cached(directory: str | Path) -> MachineProfile | None:
    """``machine.json`` in ``directory`` when a plan measured this machine before."""
    path = Path(directory) / "machine.json"
    if not path.exists():
        return None
    try:
        return MachineProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_note(load: tuple[float, float], cores: int) -> str:
    worst = max(load)
    state = "quiet" if worst < 0.5 * cores else "loaded (shared with other work)" \
        if worst > 1.2 * cores else "partly busy"
    return (f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end on "
            f"{cores} cores: {state}")


def _ceiling(bench: BenchReport, base: float | None) -> dict[int, float]:
    """Per replica count, the throughput its fastest setting would reach without its exposed
    communication (its compute, input and optimizer as measured, contention included)."""
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
        rows.append([
            r.setting.label, r.setting.processes, r.steps, ms(r.step_seconds),
            f"{r.samples_per_second:.4g}",
            f"{r.samples_per_second / base:.2f}x" if base else "",
            ms(b["compute"]), ms(b["communication"]), ms(r.overlapped), ms(b["input"]),
            ms(b["optimizer"]), ms(b["checkpoint"]),
            _memory(r)])
    return rows


def _memory(r: Any) -> str:
    """Peak memory per rank: the process's, and the GPU's allocated memory where it ran on one."""
    host = " / ".join(mb(x) for x in r.peak_rss)
    if not any(r.peak_device):
        return host
    return f"{host} (GPU {' / '.join(mb(x) for x in r.peak_device)})"


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
        "target": bench.target, "load_average": list(bench.load_average),
        "ceiling": bench.ceiling, "skipped": bench.skipped,
        "results": [r.to_json() for r in bench.results]})
    bench.files = files = [*files, str(root / "report.md"), str(root / "results.json")]
    if echo:
        print(format_table(HEADERS, rows))
        for line in [*(f"note: {n}" for n in notes), *(f"failed: {f}" for f in failures),
                     f"wrote {', '.join(files)}"]:
            print(line)
        for r in bench.results:
            print(json.dumps(_json_line(r)), flush=True)


def _json_line(r: Any) -> dict[str, Any]:
    return {"bench": "replicator bench", "setting": r.setting.label,
            "strategy": r.setting.strategy, "workers": r.setting.workers, "ok": r.ok,
            "step_s": round(r.step_seconds, 6) if r.ok else None,
            "samples_per_s": round(r.samples_per_second, 3) if r.ok else None,
            "breakdown_s": {k: round(v, 6) for k, v in r.breakdown.items()},
            "overlapped_s": round(r.overlapped, 6),
            "peak_rss_bytes": r.peak_rss, "peak_device_bytes": r.peak_device,
            "error": r.error or None}
