"""The comm room's timers: off costs nothing, on they count the main thread's waits once and
communication-thread work as background."""

import threading
import time

import torch

from replicator.comm import timing
from replicator.comm.collectives import Collectives


def _collectives():
    return Collectives(0, 1, torch.device("cpu"), 5.0)


def test_off_by_default_and_nothing_counted():
    was = timing.enabled()
    timing.enable(False)
    try:
        before = timing.snapshot()
        with _collectives().guard("all_reduce"):
            time.sleep(0.01)
        assert timing.snapshot() == before
    finally:
        timing.enable(was)


def test_guarded_waits_count_once_when_nested():
    was = timing.enabled()
    timing.enable(True)
    try:
        coll = _collectives()
        before = timing.snapshot()
        with coll.guard("outer"):
            time.sleep(0.02)
            with coll.guard("inner"):
                time.sleep(0.02)
        spent = timing.snapshot() - before
        assert spent.calls == 1
        assert 0.035 < spent.exposed < 1.0
        assert spent.background == 0.0
    finally:
        timing.enable(was)


def test_other_threads_count_as_background():
    was = timing.enabled()
    timing.enable(True)
    try:
        before = timing.snapshot()

        def work():
            token = timing.start()
            time.sleep(0.02)
            timing.stop(token)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        spent = timing.snapshot() - before
        assert spent.exposed == 0.0 and spent.background_calls == 1
        assert spent.background >= 0.015
    finally:
        timing.enable(was)
