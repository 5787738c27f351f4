"""Two strategies made one after another in a process each wait their own timeout: the second
one's timeout reaches its collectives even though the process group already exists."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import replicator as rp
from replicator.testing import run_distributed
from tests.helpers import hang

SHORT, LONG = 2.0, 14.0
#: A wait of the short timeout ends well below this; a wait of the long one never does.
BETWEEN = 8.0


def _make(kind: str, seconds: float) -> rp.Strategy:
    # the backend's own collectives (on one CPU host "auto" would take shared memory, whose
    # waits the algorithm times itself): the process group's timeout is what is tested
    options = rp.CommunicationOptions(timeout_seconds=seconds, implementation="gloo")
    if kind == "central_storage":
        return rp.CentralStorageStrategy(communication_options=options)
    return rp.MirroredStrategy(communication_options=options)


def _withheld_reduces(folder: str, made: list[tuple[str, float]]) -> list[tuple[str, str, float]]:
    """Make every strategy of ``made`` in order; then, newest first, rank 0 reduces with each
    while rank 1 withholds the collective: rank 0's error (class and text) and how long it
    waited, in the order of ``made``."""
    strategies = [_make(kind, seconds) for kind, seconds in made]
    out = []
    for i, strategy in reversed(list(enumerate(strategies))):
        gave_up = Path(folder) / f"gave_up_{i}"
        if strategy.replica_id == 0:
            start = time.monotonic()
            try:
                strategy.reduce("sum", torch.ones(3))
                out.append(("no error", "", time.monotonic() - start))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append((type(exc).__name__, str(exc), time.monotonic() - start))
            gave_up.touch()
        else:
            hang(LONG * 4, gave_up)
    return out[::-1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("made", [
    [("mirrored", SHORT), ("central_storage", LONG)],
    [("mirrored", LONG), ("mirrored", SHORT)],
], ids=["short-then-long", "long-then-short"])
def test_each_strategy_waits_its_own_timeout(tmp_path, made):
    results = run_distributed(_withheld_reduces, 2, args=(str(tmp_path), made),
                              timeout_seconds=90)
    waits = results[0]
    for (kind, seconds), (error, text, waited) in zip(made, waits):
        assert error == "ReplicaTimeoutError", (kind, seconds, error, text)
        assert f"waited {seconds:g} s" in text, (kind, text)
        if seconds == SHORT:
            assert waited < BETWEEN, f"{kind} with a {seconds:g} s timeout waited {waited:.1f} s"
        else:
            assert waited >= BETWEEN, f"{kind} with a {seconds:g} s timeout gave up after " \
                                      f"{waited:.1f} s"
