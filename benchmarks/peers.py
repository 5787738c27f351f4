"""The same 2-process CPU training loop under replicator and its peers, in one run.

Variants, all in the same two worker processes (1 thread each) over the same gloo group and
interleaved round by round so machine noise hits all alike:

* ``replicator``: ``MirroredStrategy()`` with default options (``"auto"``);
* ``ddp``: hand-written ``DistributedDataParallel``;
* ``fabric``: Lightning Fabric with ``strategy="ddp"`` (optional: ``pip install lightning``);
* ``accelerate``: Hugging Face Accelerate's ``Accelerator`` (optional: ``pip install
  accelerate``).

The peers are the ``[bench]`` extra (``pip install replicator[bench]``), never a dependency; a
peer that is not installed is skipped with a printed line. The model is the 1M-parameter MLP
of ``scaling.py`` with a global batch of 512. Reported: median step time of each and the ratio
peer / replicator (goal: every peer >= 1.2, i.e. ours at least 20% faster on CPU).

Run: ``python benchmarks/peers.py [--rounds 7] [--steps 15]``
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402
from benchmarks.scaling import wide_mlp  # noqa: E402

GLOBAL_BATCH = 512
PEERS = {"fabric": "lightning", "accelerate": "accelerate"}


def installed() -> dict[str, bool]:
    """Which optional peers can be imported here."""
    return {name: importlib.util.find_spec(module) is not None for name, module in PEERS.items()}


def _check_data_parallel(peer: str, wrapped: nn.Module) -> None:
    """A peer that did not detect the 2-process job would train alone: not a comparison."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not any(isinstance(m, DDP) for m in wrapped.modules()):
        raise RuntimeError(f"{peer} did not wrap the model in DistributedDataParallel "
                           f"({type(wrapped).__name__}); its figure would not be comparable")


def _fabric(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any, Any], None]:
    from lightning.fabric import Fabric

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        fabric = Fabric(accelerator="cpu", strategy="ddp",
                        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=1)
        fabric.launch()  # launched externally: uses the running process group
        wrapped, wrapped_opt = fabric.setup(model, opt)
    _check_data_parallel("fabric", wrapped)
    return _step(wrapped, wrapped_opt, fabric.backward)


def _accelerate(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any, Any], None]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    wrapped, wrapped_opt = accelerator.prepare(model, opt)
    _check_data_parallel("accelerate", wrapped)
    return _step(wrapped, wrapped_opt, accelerator.backward)


def _step(model: nn.Module, opt: Any,
          backward: Callable[[torch.Tensor], None]) -> Callable[[Any, Any], None]:
    """One training step of ``model``, with the framework's own ``backward``."""
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    return step


def _plain(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any, Any], None]:
    return _step(model, opt, torch.Tensor.backward)


def worker(rounds: int, steps: int, peers: list[str]) -> dict[str, Any]:
    """Each of the 2 processes: every variant in turn, ``rounds`` times; seconds per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.filterwarnings("ignore")
    strategy = rp.MirroredStrategy()
    variants: dict[str, Callable[[Any, Any], None]] = {}
    with strategy.scope():
        torch.manual_seed(0)
        ours = wide_mlp()
    variants["replicator"] = _plain(ours, torch.optim.SGD(ours.parameters(), lr=0.01))
    torch.manual_seed(0)
    ddp = DDP(wide_mlp())
    variants["ddp"] = _plain(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    makers = {"fabric": _fabric, "accelerate": _accelerate}
    for name in peers:
        torch.manual_seed(0)
        model = wide_mlp()
        variants[name] = makers[name](model, torch.optim.SGD(model.parameters(), lr=0.01))
    local = GLOBAL_BATCH // strategy.num_replicas_in_sync
    torch.manual_seed(1 + strategy.replica_id)
    x, y = torch.randn(local, 512), torch.randint(0, 10, (local,))
    names = list(variants)
    for name in names:  # warm-up: allocators, buckets, connections
        for _ in range(3):
            variants[name](x, y)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            strategy.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                variants[name](x, y)
            times[name].append((time.perf_counter() - start) / steps)
    return {"times": times, "algorithm": strategy.cross_device_ops.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    have = installed()
    for name, ok in have.items():
        if not ok:
            print(f"peers: {name} is not installed ({PEERS[name]}); skipped. HINT: pip install "
                  "'replicator[bench]'")
    peers = [name for name, ok in have.items() if ok]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        per_rank = rp.launch(worker, num_replicas=2, args=(args.rounds, args.steps, peers),
                             timeout_seconds=120)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    # a synchronous step is as slow as the slower rank
    step = {name: median([max(t) for t in zip(*(r["times"][name] for r in per_rank))])
            for name in per_rank[0]["times"]}
    ours = step["replicator"]
    print(f"\n2 CPU processes x 1 thread, 1M-parameter MLP, global batch {GLOBAL_BATCH} "
          f"(median step time over {args.rounds} interleaved rounds)")
    print_table(["variant", "ms/step", "samples/s", "ratio to replicator"],
                [[f"replicator (auto = {per_rank[0]['algorithm']})" if n == "replicator"
                  else n, t * 1e3, GLOBAL_BATCH / t, t / ours] for n, t in step.items()])
    print()
    for name, t in step.items():
        if name != "replicator":
            emit("peers", f"{name}_vs_ours", t / ours, ">= 1.2",
                 ours_ms=round(ours * 1e3, 3), peer_ms=round(t * 1e3, 3))


if __name__ == "__main__":
    main()
