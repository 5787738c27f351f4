"""The demo's command-line options and the strategies it runs under, apart from the demo
itself: ``replicator --help`` and ``replicator demo`` read them without importing torch."""

from __future__ import annotations

import argparse

#: The strategies the demo trains under (tried: each reaches the usual accuracy), and what
#: each needs from the command line.
DEMO_STRATEGIES = {
    "mirrored": "mirrored (the default)",
    "multi_worker_mirrored": "multi_worker_mirrored",
    "central_storage": "central_storage",
    "fsdp": "fsdp",
    "tensor_parallel": "tensor_parallel",
    "parameter_server": "parameter_server (with --num-ps 1)",
    "one_device": "one_device (with --nproc 1)",
}
#: Why the others cannot run it.
_CANNOT = {
    "pipeline": "it cuts an nn.Sequential (or a Hugging Face GPT-2) into stages, and the "
                "demo's CNN has a forward of its own",
    "mesh": "it needs the mesh's axes (rp.MeshStrategy(data=2, tensor=2) in a script of "
            "your own), which a name alone does not give",
}


def strategy_refusal(name: str, nproc: int | None, num_ps: int = 0) -> str | None:
    """Why ``replicator demo --strategy name`` cannot run with these flags (``None``: it can),
    said before any worker starts, with the strategies that work."""
    from replicator.ps import find_strategy_class  # every built-in strategy registered

    cls = find_strategy_class(name)  # the names get_strategy takes, aliases included
    works = "; the demo runs with: " + ", ".join(DEMO_STRATEGIES.values()) + "."
    if cls is None:
        return f"--strategy {name!r} is not a strategy name{works}"
    canonical = cls.name
    why = _CANNOT.get(canonical)
    if canonical == "one_device" and (nproc or 1) > 1:
        why = (f"it would train {nproc} independent models, one per worker, each on all "
               "the data")
    if canonical == "parameter_server" and num_ps < 1:
        why = ("it needs parameter servers: add --num-ps 1 (the last process serves the "
               "variables; --nproc counts it)")
    if why is None and canonical not in DEMO_STRATEGIES:
        why = "the demo has not been tried with it"
    return None if why is None else f"--strategy {name} cannot run the demo: {why}{works}"


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup
                  ) -> list[argparse.Action]:
    """Add the demo's options to ``parser`` (``replicator demo --help`` lists them too)."""
    return [
        parser.add_argument("--epochs", type=int, default=12,
                            help="passes over the training digits (default 12)"),
        parser.add_argument("--batch-size", type=int, default=64,
                            help="global batch size, split across the replicas (default 64)"),
        parser.add_argument("--lr", type=float, default=3e-3,
                            help="Adam learning rate (default 0.003)"),
        parser.add_argument("--strategy", default="mirrored",
                            help="strategy name for rp.get_strategy (default mirrored)"),
        parser.add_argument("--steps", type=int, default=None,
                            help="stop after this many steps (default: all epochs)"),
    ]
