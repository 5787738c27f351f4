"""Which failures a restart cannot fix, and how the launcher summarises many ranks.

A restart replays the same script from the last backup. A NaN loss comes back at the same
step, replicas that disagree disagree again, and a script that does not import or compile fails
the same way: restarting those only wastes the restart budget and hides the cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Exception types (or their base classes) that fail the same way after a restart, and why.
REPEATING_FAILURES: dict[str, str] = {
    "NonFiniteLossError": "the restart replays the same steps from the last backup",
    "ReplicaMismatchError": "the replicas run the same code again",
    "CollectiveMismatchError": "the replicas run the same code again",
    "SyntaxError": "the script does not compile",
    "ImportError": "the same import fails again",
    "ScriptNotFoundError": "the script file does not exist",
}


def restart_refusal(error_types: Iterable[str]) -> str | None:
    """``None`` when a restart may help; else the line that says why not.

    ``error_types`` are the names of the failure's exception class and its bases (the error
    file records them), most derived first.
    """
    names = list(error_types)
    for name in names:
        if name in REPEATING_FAILURES:
            shown = names[0] if names else name
            return f"not restarting: {shown} repeats on restart ({REPEATING_FAILURES[name]})"
    return None


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"ranks 0, 2-4, 7"``; one rank -> ``"rank 5"``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    spans: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else
                     f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(spans)


def group_by_rank(details: Mapping[int, str], min_group: int = 3) -> list[str]:
    """One line per rank (``"rank 4: text"``), except that ``min_group`` or more ranks with
    the same text share one line (``"ranks 2-98: text"``); ordered by lowest rank."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(details):
        by_text.setdefault(details[rank], []).append(rank)
    entries: list[tuple[int, str]] = []
    for text, ranks in by_text.items():
        if len(ranks) >= min_group:
            entries.append((ranks[0], f"{rank_ranges(ranks)}: {text}"))
        else:
            entries += [(r, f"rank {r}: {text}") for r in ranks]
    return [line for _, line in sorted(entries)]
