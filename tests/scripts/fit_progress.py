"""Trainer.fit with the default progress display (for the live-bar test under the launcher)."""
import torch
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

strategy = rp.MirroredStrategy()
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
trainer = rp.Trainer(strategy, lambda: torch.nn.Linear(3, 1),
                     lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss())
trainer.fit(DataLoader(data, batch_size=8), epochs=2)
