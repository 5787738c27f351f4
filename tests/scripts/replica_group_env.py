"""A replica-group process without the live engine: records what the launcher gave it.

Appends one JSON line per start to ``OUT/starts.jsonl`` (group, rank, attempt, pid and the
replica-group variables), then acts as ``MODE`` says:

* ``exit``: leave at once (exit 0).
* ``wait``: wait (at most 120 s) until ``OUT/finish`` exists, then exit 0.
* ``die-in-group G``: group G raises on every attempt; the others leave at once.

In every mode SIGTERM makes the process record ``left`` and exit with code ``LEAVE_CODE``
(argument 3 of ``wait``; default 0), as a group leaving at a step boundary does. The lighthouse
is asked for its status page, to show that it was up while the groups ran.
"""

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
group = int(os.environ["REPLICATOR_REPLICA_GROUP"])
leave_code = int(sys.argv[3]) if mode == "wait" and len(sys.argv) > 3 else 0


def leave(signum, frame):
    with open(out / "left.jsonl", "a") as f:
        f.write(json.dumps({"group": group, "pid": os.getpid()}) + "\n")
    sys.exit(leave_code)


signal.signal(signal.SIGTERM, leave)
names = ("REPLICATOR_REPLICA_GROUP", "REPLICATOR_REPLICA_GROUPS", "REPLICATOR_LIGHTHOUSE",
         "REPLICATOR_MIN_REPLICAS", "REPLICATOR_LIVE_BIND", "TORCHFT_LIGHTHOUSE", "RANK",
         "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "REPLICATOR_RESTART_COUNT")
record = {name: os.environ.get(name) for name in names}
record["pid"] = os.getpid()
with urllib.request.urlopen(os.environ["REPLICATOR_LIGHTHOUSE"] + "/status", timeout=30) as r:
    record["lighthouse_status"] = r.status
with open(out / "starts.jsonl", "a") as f:  # one short line per write: appends stay whole
    f.write(json.dumps(record) + "\n")
print(f"group {group} rank {os.environ['RANK']} started", flush=True)
if mode == "wait":
    deadline = time.monotonic() + 120
    while not (out / "finish").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
elif mode == "die-in-group" and group == int(sys.argv[3]):
    raise ValueError(f"bad value on purpose in group {group}")
print(f"group {group} rank {os.environ['RANK']} done", flush=True)
