"""The worker script of ``benchmarks/launch.py``: joins the group (one all-reduce), writes when
it got there, and on the first attempt fails once it is there, so that a launcher with one
restart starts it again."""

from __future__ import annotations

import os
import sys
import time

import torch

import replicator as rp


def main() -> None:
    out = sys.argv[1]
    fail_first = len(sys.argv) > 2 and sys.argv[2] == "fail-first"
    attempt = int(os.environ.get("REPLICATOR_RESTART_COUNT",
                                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    strategy = rp.MirroredStrategy()
    strategy.reduce("sum", torch.ones(1))
    now = time.time()
    with open(os.path.join(out, f"ready-a{attempt}-r{strategy.replica_id}"), "w") as f:
        f.write(repr(now))
    if fail_first and attempt == 0:
        raise SystemExit(f"failing attempt 0 on purpose at {now!r}")


if __name__ == "__main__":
    main()
