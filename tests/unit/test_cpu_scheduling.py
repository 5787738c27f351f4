"""Batch CPU scheduling of a job's processes when they outnumber the cores: when it applies,
that every thread of the process (and a thread started later) gets it, and the opt-out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from replicator.cluster import cpu_scheduling

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"),
                                reason="scheduling policies are Linux's")

PROBE = """
import os, threading
from replicator.cluster.cpu_scheduling import use_batch_scheduling
early = threading.Event(); done = threading.Event(); seen = {}
def before():  # a thread running before the policy is set
    early.set(); done.wait(); seen['before'] = os.sched_getscheduler(0)
t = threading.Thread(target=before); t.start(); early.wait()
applied = use_batch_scheduling(PROCESSES)
after = threading.Thread(target=lambda: seen.__setitem__('after', os.sched_getscheduler(0)))
after.start(); after.join(); done.set(); t.join()
print(applied, os.sched_getscheduler(0) == os.SCHED_BATCH, seen['before'] == os.SCHED_BATCH,
      seen['after'] == os.SCHED_BATCH)
"""


def _run(n: int, choice: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("REPLICATOR_CPU_SCHEDULING", None)
    if choice is not None:
        env["REPLICATOR_CPU_SCHEDULING"] = choice
    code = PROBE.replace("PROCESSES", str(n))
    out = subprocess.run([sys.executable, "-c", code], env=env, timeout=60,
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_more_processes_than_cores_run_every_thread_under_batch_scheduling():
    assert _run(cpu_scheduling.usable_cores() + 1, None) == ["True"] * 4


def test_as_many_processes_as_cores_or_the_opt_out_keep_the_systems_policy():
    assert _run(cpu_scheduling.usable_cores(), None) == ["False"] * 4
    assert _run(99, "default") == ["False"] * 4
    assert _run(1, "batch") == ["True"] * 4


def test_an_unknown_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("REPLICATOR_CPU_SCHEDULING", "fast")
    with pytest.raises(ValueError, match="'fast' is not one of auto, batch, default"):
        cpu_scheduling.wanted(3)
