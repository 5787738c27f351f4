"""Shared output format of the benchmarks: a readable table, then one JSON line per figure."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def emit(bench: str, name: str, ratio: float, goal: str, **extra: object) -> None:
    print(json.dumps({"bench": bench, "name": name, "ratio": round(ratio, 4), "goal": goal,
                      **extra}), flush=True)
