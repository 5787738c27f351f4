"""One member of a LiveProcessGroup over a TCPStore on loopback (tests/distributed/
test_live_process_group.py): sums, reports what it saw as JSON lines, optionally dies mid-sum."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator.strategies.live.process_group import LiveProcessGroup


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--die-in-sum", type=int, default=-1, help="the rank that dies")
    args = parser.parse_args()
    rank, world = args.rank, args.world
    store = dist.TCPStore("127.0.0.1", args.port, world, rank == 0,
                          timeout=timedelta(seconds=60))
    pg = LiveProcessGroup(timedelta(seconds=60), args.transport)
    pg.configure(f"127.0.0.1:{args.port}/quorum/1", f"g{rank}", rank, world)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    floats = torch.arange(3_000_001, dtype=torch.float32) * (rank + 1)  # a few slot pieces
    ints = torch.full((5,), rank + 1, dtype=torch.int64)                 # gloo's
    pg.allreduce([floats], opts).wait()
    pg.allreduce([ints], opts).wait()
    report(rank=rank, shared=pg.uses_shared_memory, floats_0=float(floats[1]),
           floats_last=float(floats[-1]), ints=int(ints[0]))
    if args.die_in_sum < 0:
        return
    if rank == args.die_in_sum:  # the others wait for it in the next sum: it never comes
        store.set(f"died{rank}", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait([f"died{args.die_in_sum}"])
    start = time.monotonic()
    try:
        pg.allreduce([floats], opts).wait()
        report(rank=rank, sum_after_death="returned")
    except Exception as exc:  # noqa: BLE001 - the error is what the test reads
        report(rank=rank, sum_after_death=f"{type(exc).__name__}: {exc}",
               seconds=time.monotonic() - start)
    try:
        pg.allreduce([floats], opts).wait()
        report(rank=rank, second_sum="returned")
    except Exception as exc:  # noqa: BLE001
        report(rank=rank, second_sum=f"{type(exc).__name__}: {exc}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
