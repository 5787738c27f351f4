"""Models ``replicator plan`` was never calibrated on, each a different shape.

The cost model's figures were tuned on ``examples/plan_models.py`` (tiny, mlp, cnn); these
check that its predictions hold on models it never saw. Same contract as there: the strategy
comes from ``REPLICATOR_STRATEGY``, an ordinary ``strategy.run`` loop reduces the loss every
step, and each model is an ``nn.Sequential`` so that ``PipelineStrategy`` can cut it.

* ``--model upcnn``: 0.1M parameters, convolutions on inputs upsampled 4x (compute-bound,
  about a third of a second a step in one process);
* ``--model attn``: two small transformer encoder layers over 32 tokens (attention);
* ``--model embed``: a 100k x 32 embedding, mean-pooled, then one Linear (wide and shallow:
  3.2M parameters, little compute);
* ``--model wide``: three wide Linear layers (3.2M parameters in 12.8 MB of dense weights);
* ``--model bag``: a 40k x 48 embedding bag, then a two-layer head (1.9M parameters).

``wide`` and ``bag`` were added after the pipeline's gradient accumulation term was read from
``embed``, to check it on models it was not read from.

Run: ``replicator plan examples/plan_holdout_models.py --workers 1,2,3,4 --per-host 4
--validate -- --model upcnn``.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


class MeanTokens(nn.Module):
    """The mean over the token axis of ``(batch, tokens, features)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The model and one input sample (its dtype and shape)."""
    if name == "upcnn":
        return nn.Sequential(
            nn.Upsample(scale_factor=4), nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 96, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(96, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)), torch.randn(3, 16, 16)
    if name == "attn":
        def layer() -> nn.Module:
            return nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True,
                                              dropout=0.0)

        return nn.Sequential(nn.Embedding(1000, 64), layer(), layer(), MeanTokens(),
                             nn.Linear(64, 10)), torch.randint(0, 1000, (32,))
    if name == "embed":
        return nn.Sequential(nn.Embedding(100_000, 32), MeanTokens(), nn.Linear(32, 10)), \
            torch.randint(0, 100_000, (16,))
    if name == "wide":
        return nn.Sequential(nn.Linear(512, 1536), nn.ReLU(), nn.Linear(1536, 1536), nn.ReLU(),
                             nn.Linear(1536, 10)), torch.randn(512)
    if name == "bag":
        return nn.Sequential(nn.Embedding(40_000, 48), MeanTokens(), nn.Linear(48, 256),
                             nn.ReLU(), nn.Linear(256, 10)), torch.randint(0, 40_000, (24,))
    raise SystemExit(f"unknown --model {name!r}: upcnn, attn, embed, wide or bag")


BATCH = {"upcnn": 64, "attn": 128, "wide": 128, "bag": 192, "embed": 256}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="attn")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch (default: upcnn 64, attn and wide 128, bag 192, "
                        "embed 256)")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many steps (default: every epoch's batches)")
    args = parser.parse_args()
    batch = args.batch or BATCH.get(args.model, 64)
    strategy = rp.get_strategy(os.environ.get("REPLICATOR_STRATEGY", "mirrored"))
    torch.manual_seed(0)
    sample = build(args.model)[1]
    vocab = {"attn": 1000, "embed": 100_000, "bag": 40_000}.get(args.model)
    x = torch.randint(0, vocab, (batch * 8, *sample.shape)) if vocab else \
        torch.randn(batch * 8, *sample.shape)
    y = torch.randint(0, 10, (batch * 8,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
    with strategy.scope():
        torch.manual_seed(0)
        model, _ = build(args.model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = b
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = strategy.distribute_dataset(loader)
    loss, done = torch.zeros(()), 0
    for _ in range(args.epochs):
        for b in data:
            loss = strategy.reduce("mean", strategy.run(step, args=(b,)))
            done += 1
            if done == args.steps:
                break
        if done == args.steps:
            break
    if strategy.is_chief:
        print(f"done: loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
