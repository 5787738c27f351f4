"""Back up every step (keeping one), then fail at step 10 on rank 1.

Usage: fail_after_backups.py BACKUP_DIR raise|kill: ``raise`` raises RuntimeError, ``kill``
SIGKILLs the process (no cleanup at all).
"""

import os
import signal
import sys

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
for step, (x,) in backup.steps(strategy.distribute_dataset(data, batch_size=8), epochs=3):
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 10 and strategy.replica_id == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("failing on purpose at step 10")
