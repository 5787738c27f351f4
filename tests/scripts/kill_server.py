"""Parameter servers: the chief SIGKILLs server 0 at step 10; the workers then lose it."""

import os
import signal

import torch
import torch.nn.functional as F

import replicator as rp

strategy = rp.ParameterServerStrategy(num_ps=1, staleness=0, timeout_seconds=30)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


for i in range(500):
    strategy.run(step, args=(torch.randn(8, 4), torch.randint(0, 2, (8,))))
    if i == 10 and strategy.is_chief:
        os.kill(strategy.server_pids[0], signal.SIGKILL)
