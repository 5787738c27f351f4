"""Memory per rank: FSDP vs a replicated strategy, for a model of about 100 MB, on 2 ranks.

The model (``--layers`` x Linear(``--width``, ``--width``), 6 x 2048^2 = 25M parameters =
100 MB in fp32) trains ``--steps`` Adam steps under :class:`~replicator.FSDPStrategy` and
under :class:`~replicator.MirroredStrategy` (every rank holds everything). Each rank reports
``strategy.memory_report()`` for FSDP (parameters, gradients and optimizer state it holds,
plus peak activations); the replicated figure is the same accounting of a full replica (what
every Mirrored rank holds). Also printed: each process's peak resident memory growth
(``ru_maxrss`` after training minus before building the model), which for FSDP includes the
full model the scope builds before sharding it.

JSON line ``fsdp_vs_mirrored_peak_2ranks``: ratio = FSDP / replicated accounted peak bytes
per rank (goal <= 0.6).

Run: ``python benchmarks/memory.py [--width 2048] [--layers 6] [--steps 2]``
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, print_table  # noqa: E402
from replicator.strategies.memory import ActivationMeter, optimizer_state_bytes  # noqa: E402
from replicator.testing import run_distributed  # noqa: E402

BENCH = "memory"


def _model(width: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    parts: list[torch.nn.Module] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*parts)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fsdp(width: int, layers: int, steps: int) -> dict:
    rss0 = _rss_bytes()
    strategy = rp.FSDPStrategy()
    with strategy.scope():
        model = _model(width, layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)
    for _ in range(steps):
        strategy.run(lambda: (model(x).square().mean().backward(), optimizer.step()))
    report = strategy.memory_report()
    return {"total": report.total_bytes, "report": str(report), "rss": _rss_bytes() - rss0}


def _replicated(width: int, layers: int, steps: int) -> dict:
    """What every replica of a replicated strategy holds: the full model, gradients, Adam
    state, and the activations of its part of the batch (16 of the 32 rows)."""
    rss0 = _rss_bytes()
    model = _model(width, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)
    peak = 0
    for _ in range(steps):
        with ActivationMeter() as meter:
            model(x).square().mean().backward()
        optimizer.step()
        peak = max(peak, meter.peak_bytes)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if p.grad is not None)
    total = params + grads + optimizer_state_bytes([optimizer]) + peak
    return {"total": total, "rss": _rss_bytes() - rss0}


def _mirrored(width: int, layers: int, steps: int) -> dict:
    rss0 = _rss_bytes()
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = _model(width, layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)
    for _ in range(steps):
        strategy.run(lambda: (model(x).square().mean().backward(), optimizer.step()))
    return {"rss": _rss_bytes() - rss0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    shape = (args.width, args.layers, args.steps)
    fsdp = run_distributed(_fsdp, 2, args=shape, timeout_seconds=600)
    replicated = _replicated(*shape)
    try:
        mirrored_rss = [r["rss"] for r in run_distributed(_mirrored, 2, args=shape,
                                                            timeout_seconds=600)]
    except Exception as exc:  # noqa: BLE001 - the RSS column is informative only
        print(f"(MirroredStrategy run failed, RSS column left out: {exc})".splitlines()[0])
        mirrored_rss = [0, 0]
    mb = 2 ** 20
    rows = [(f"rank {r}", fsdp[r]["total"] / mb, replicated["total"] / mb,
             fsdp[r]["total"] / replicated["total"], fsdp[r]["rss"] / mb, mirrored_rss[r] / mb)
            for r in range(2)]
    print_table(["rank", "FSDP MB", "replicated MB", "ratio", "FSDP RSS growth MB",
                 "Mirrored RSS growth MB"], rows)
    for r in range(2):
        print("  FSDP", fsdp[r]["report"])
    worst = max(fsdp[r]["total"] for r in range(2)) / replicated["total"]
    emit(BENCH, "fsdp_vs_mirrored_peak_2ranks", worst, "<= 0.6",
         fsdp_bytes=max(f["total"] for f in fsdp), replicated_bytes=replicated["total"])


if __name__ == "__main__":
    main()
