"""A finished script whose helper threads are inside torch code when the script ends.

Usage: leave_with_busy_helpers.py [prefetch|thread]. ``prefetch`` (default): the loop leaves
early, just after letting the input's prefetch thread start a batch whose transform keeps it in
torch's C++ code for about 2 s. ``thread``: a helper thread of the library's naming
(``replicator-...``) is in torch code for 2 s. A daemon thread still there when the interpreter
finalizes aborts the process ("terminate called without an active exception"), unless the
library waits for its helper threads at exit. Prints ``rank R done`` and exits 0.
"""

import sys
import threading
import time

import torch
from torch.utils.data import TensorDataset

import replicator as rp

LEAVING = threading.Event()
SLOW_ONCE = threading.Event()
WEIGHT = torch.randn(256, 256)


def busy() -> None:
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        torch.mm(WEIGHT, WEIGHT)


def transform(sample):
    if LEAVING.is_set() and not SLOW_ONCE.is_set():
        SLOW_ONCE.set()
        busy()
    return sample


strategy = rp.MirroredStrategy()
if sys.argv[1:] == ["thread"]:
    threading.Thread(target=busy, name="replicator-test-busy", daemon=True).start()
    time.sleep(0.2)
    print(f"rank {strategy.replica_id} done", flush=True)
    sys.exit(0)
data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
dist = strategy.distribute_dataset(data, batch_size=8, transform=transform,
                                   options=rp.data.InputOptions(prefetch=2, num_workers=0))
for step, (x, _) in enumerate(dist):
    strategy.reduce("sum", x.sum())
    if step == 2:
        LEAVING.set()  # the next pop frees a slot: the thread starts a slow batch
    if step == 3:
        time.sleep(0.2)  # let it get into the slow transform
        break
print(f"rank {strategy.replica_id} done", flush=True)
