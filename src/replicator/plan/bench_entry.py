"""``bench_entry.py SCRIPT ARGS...``: run a user's script under the probe, in one worker, in
place of the script; its settings come from the environment (``REPLICATOR_BENCH_*``)."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from typing import Any


def run_probed(body: Callable[[], Any]) -> None:
    """Run ``body`` under the probe the bench's environment sets up; write this rank's records."""
    out = os.environ["REPLICATOR_BENCH_OUT"]
    sys.stdout.flush()  # stdout and stderr (file descriptors too) go to rank<R>.log
    sys.stderr.flush()
    fd = os.open(os.path.join(out, f"rank{int(os.environ.get('RANK', '0'))}.log"),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

    from replicator.data.dataflow.dataset import running_stats
    from replicator.plan.probe import Probe

    probe = Probe(steps=int(os.environ.get("REPLICATOR_BENCH_STEPS", "30")),
                  warmup=int(os.environ.get("REPLICATOR_BENCH_WARMUP", "3")),
                  mode=os.environ.get("REPLICATOR_BENCH_MODE", "bench"))
    try:
        probe.run(body, progress_path=os.path.join(out, "progress"))
    finally:
        probe.extra["input_pipelines"] = running_stats()
        probe.write(out)


def _run_script(script: str) -> None:
    """The script as ``__main__``; a clean ``sys.exit`` ends it like a return."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: bench_entry.py SCRIPT [ARGS...] (run by replicator bench)")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    run_probed(lambda: _run_script(script))


if __name__ == "__main__":
    main()
