"""One line of the plan for a classifier, from inside a training script (the demo ends on it).

:func:`print_plan_line` profiles a fresh copy of the model in this process (a few dozen small
steps under a ``OneDeviceStrategy``, cross-entropy on ``(x, y)`` batches) with this machine's
figures from ``bench/machine.json`` and prints the recommendation. Before a plan has measured
this machine the line recommends nothing (figures not measured here would decide it) and says
how to measure. Only the chief does this; the other replicas return at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["plan_line", "print_plan_line"]


def plan_line(model_fn: Callable[[], torch.nn.Module], dataset: Any, global_batch: int, *,
              workers: Sequence[int] = (2, 8, 64), device: str = "cpu", link: str = "25gbit",
              out_dir: str = "bench", script: str = "your_script.py",
              script_args: str = "") -> str:
    """The recommendation for ``model_fn()`` trained with Adam and cross-entropy on
    ``dataset`` at ``global_batch``, as one line of text (``script`` and ``script_args``: the
    command that plans it, named when this machine is not measured yet)."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from replicator.plan.planner import plan_model, profile_here
    from replicator.plan.profiles import MachineProfile, machine_profile_cached

    def train(strategy: Any) -> None:
        torch.manual_seed(0)
        with strategy.scope():
            model = model_fn()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        data = strategy.distribute_dataset(DataLoader(dataset, batch_size=global_batch,
                                                      shuffle=True, drop_last=True))
        while True:
            for batch in data:
                strategy.run(step, args=(batch,))

    machine = machine_profile_cached(out_dir)
    if machine is None and device == "cpu":
        command = f"replicator plan {script} --workers {','.join(map(str, workers))}" + (
            f" -- {script_args}" if script_args else "")
        return (f"plan: no recommendation yet: this machine's contention and collectives are "
                f"not measured (figures from elsewhere could say the opposite of what runs "
                f"fastest here). HINT: {command} measures them once (about a minute, cached "
                f"in {out_dir}/machine.json)")
    model = profile_here(train, getattr(model_fn, "__name__", "the model"))
    plan = plan_model(model, list(workers), device=device, link=link,
                      machine=machine or MachineProfile.nominal())
    figures = "this machine's measured figures" if machine else "datasheet figures"
    return (f"plan ({model.name}, {model.params:,} parameters, {','.join(map(str, workers))} "
            f"workers on {device}, {figures}) -> {plan.reason}")


def print_plan_line(strategy: Any, model_fn: Callable[[], torch.nn.Module], dataset: Any,
                    global_batch: int, **kwargs: Any) -> None:
    """Print :func:`plan_line` on the chief replica of ``strategy`` (others do nothing); a
    failure prints one line instead of ending the script."""
    if not strategy.is_chief:
        return
    try:
        line = plan_line(model_fn, dataset, global_batch, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the plan line must never break a training run
        line = f"plan: not available ({type(exc).__name__}: {exc})"
    print(line, flush=True)
