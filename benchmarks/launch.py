"""Starting workers: ``replicator run`` forking them from a warm forkserver, against fresh
interpreters (``--start-method spawn``) and torchrun, the peer.

Two figures per launcher, rounds interleaved: ``launch_s``, the wall time of the whole command
for a script whose workers join the group with one all-reduce and leave (the command's own
start included); ``restart_s``, from the moment every worker of the first attempt reached its
all-reduce and failed on purpose to the moment every worker of the restarted attempt reached
it again (``--max-restarts 1``). JSON lines: ``restart_forkserver_vs_spawn`` and
``restart_forkserver_vs_torchrun`` (restart time over the other's, goal <= 0.5),
``launch_forkserver_vs_spawn`` and ``launch_forkserver_vs_torchrun`` (goal <= 1.0).
Run: ``python benchmarks/launch.py [--nproc 2 4] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import emit, median, print_table  # noqa: E402

PROBE = str(Path(__file__).resolve().parent / "_launch_probe.py")
LAUNCHERS = ("forkserver", "spawn", "torchrun")


def _command(launcher: str, nproc: int, out: str, fail_first: bool) -> list[str]:
    args = [PROBE, out, *(["fail-first"] if fail_first else [])]
    restarts = ["--max-restarts", "1"] if fail_first else []
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), *restarts, *args]
    return [sys.executable, "-m", "replicator.cli", "run", "--nproc", str(nproc),
            "--start-method", launcher, *restarts, *args]


def _ready_times(out: Path, attempt: int, nproc: int) -> list[float]:
    return [float((out / f"ready-a{attempt}-r{r}").read_text()) for r in range(nproc)]


def measure(launcher: str, nproc: int, fail_first: bool) -> float:
    """``launch_s`` (no failure) or ``restart_s`` (``fail_first``) of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        start = time.perf_counter()
        done = subprocess.run(_command(launcher, nproc, tmp, fail_first), env=env,
                              capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{launcher} x{nproc} failed:\n{done.stderr[-3000:]}")
        if not fail_first:
            return wall
        out = Path(tmp)
        return min(_ready_times(out, 1, nproc)) - max(_ready_times(out, 0, nproc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)  # a run stays under 5 minutes
    args = parser.parse_args()
    figures: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for nproc in args.nproc:
            for launcher in LAUNCHERS:
                for kind, fail_first in (("launch_s", False), ("restart_s", True)):
                    figures.setdefault((launcher, nproc, kind), []).append(
                        measure(launcher, nproc, fail_first))
    rows = [[launcher, nproc, median(figures[(launcher, nproc, "launch_s")]),
             median(figures[(launcher, nproc, "restart_s")])]
            for nproc in args.nproc for launcher in LAUNCHERS]
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (medians of {args.rounds})")
    print_table(["launcher", "nproc", "launch_s", "restart_s"], rows)
    for nproc in args.nproc:
        ours = {k: median(figures[("forkserver", nproc, k)]) for k in ("launch_s", "restart_s")}
        for peer in ("spawn", "torchrun"):
            theirs = {k: median(figures[(peer, nproc, k)]) for k in ("launch_s", "restart_s")}
            emit("launch", f"restart_forkserver_vs_{peer}_x{nproc}",
                 ours["restart_s"] / theirs["restart_s"], "<= 0.5")
            emit("launch", f"launch_forkserver_vs_{peer}_x{nproc}",
                 ours["launch_s"] / theirs["launch_s"], "<= 1.0")


if __name__ == "__main__":
    main()
