"""At exit, the library stops its input prefetch threads before it waits for its helper threads,
whatever order its rooms were imported in: the wait for a prefetch thread that nobody stopped
lasted its whole 60 s, and a preempted worker kept its launcher waiting past its grace."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import itertools
import replicator.data.prefetch as prefetch  # the input room first: its exit handler too
import replicator.cluster.process_group  # noqa: F401 (then the process group's)
from replicator.cluster import helper_threads

queue = prefetch.PrefetchQueue(itertools.count(), lambda item: item, capacity=1,
                               timeout_seconds=30, name="replicator-prefetch-test")
helper_threads.wait_at_exit()  # as a process that created a process group does
print("leaving", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_prefetch_thread_left_running_is_stopped_before_the_helper_threads_are_awaited():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr
    assert "leaving" in done.stdout
    # the wait names the threads still running after it; none is left when the order is right
    assert "still running" not in done.stderr, done.stderr
