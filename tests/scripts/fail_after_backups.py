"""Back up every step (keeping one), then fail at step 10 on rank 1.

Usage: fail_after_backups.py BACKUP_DIR raise|kill|exit: ``raise`` raises RuntimeError, ``kill``
SIGKILLs the process (no cleanup at all), ``exit`` calls ``sys.exit(3)`` after printing
``exiting at <time.time()>`` (the background saver's thread is alive and idle then).
"""

import os
import signal
import sys
import time

import torch

import replicator as rp

backup_dir, how = sys.argv[1], sys.argv[2]
strategy = rp.MirroredStrategy()
with strategy.scope():
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
backup = rp.BackupAndRestore(backup_dir, save_freq=1, keep=1)
backup.track(model=model, optimizer=optimizer)
data = torch.utils.data.TensorDataset(torch.randn(64, 256))
held = []  # ``exit`` keeps the loop (and its background saver) alive while the process leaves


def training_loop():
    loop = backup.steps(strategy.distribute_dataset(data, batch_size=8), epochs=3)
    if how == "exit":
        held.append(loop)
    return loop


for step, (x,) in training_loop():
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 10 and strategy.replica_id == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            print(f"exiting at {time.time()}", file=sys.stderr, flush=True)
            sys.exit(3)
        raise RuntimeError("failing on purpose at step 10")
