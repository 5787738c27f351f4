"""The ``replicator`` command: ``run`` a script on N workers, ``demo``, ``env``, ``bench``,
``plan``, ``--version``."""

from __future__ import annotations

import argparse
import os
import sys

import replicator
from replicator.errors import ClusterConfigError, WorkerFailedError

#: Exit code of a command-line mistake (argparse's too).
USAGE_EXIT_CODE = 2


def _add_launch_flags(p: argparse.ArgumentParser, default_nproc: int | None) -> None:
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=default_nproc,
                   help="number of local worker processes (replicas)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole group up to this many times after a failure")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, dest="timeout_seconds",
                   help="seconds a collective may wait for the other replicas (default 300)")
    p.add_argument("--num-ps", type=int, default=0,
                   help="how many of the --nproc processes (the last ranks) are parameter "
                   "servers, for ParameterServerStrategy")
    p.add_argument("--force", action="store_true",
                   help="start the workers even when this machine's available memory cannot "
                   "hold them (about 300 MB each)")
    p.add_argument("--quiet-workers", action="store_true",
                   help="show only the chief's (rank 0) output; failures of any rank are "
                   "still reported")
    multi = p.add_argument_group("several nodes (torch.distributed.elastic, like torchrun)")
    multi.add_argument("--nnodes", type=int, default=1,
                       help="number of nodes (machines) of the job; run the same command on each")
    multi.add_argument("--node-rank", type=int, default=None,
                       help="this node's index, 0..nnodes-1 (node 0 hosts the rendezvous)")
    multi.add_argument("--master-addr", default=None,
                       help="node 0's address on the network every node shares; the "
                       "rendezvous store listens there only (trusted networks only: "
                       "torch.distributed has no authentication)")
    multi.add_argument("--rdzv-timeout", type=float, default=300.0,
                       help="seconds the nodes may take to meet (default 300)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"replicator {replicator.__version__} (torch {torch_version})"


def _parser() -> tuple[argparse.ArgumentParser, list[argparse.Action]]:
    """The command's parser, and the demo's own options (forwarded to the demo)."""
    from replicator.demo import digits

    parser = argparse.ArgumentParser(prog="replicator", description="Distributed training for "
                                     "PyTorch: run scripts on several local workers.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training script on N local workers",
                         description="Run SCRIPT in N worker processes on this machine (CPU + "
                         "gloo, or one process per GPU + NCCL). For several machines run the "
                         "same command on each with --nnodes/--node-rank/--master-addr (or use "
                         "torchrun); the script needs no change.")
    _add_launch_flags(run, None)
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    demo = sub.add_parser("demo", help="train a small CNN on the digits dataset on 2 workers",
                          description="Train a small CNN on scikit-learn's 8x8 digits with "
                          "MirroredStrategy on --nproc local workers (nothing is downloaded).")
    _add_launch_flags(demo, 2)
    demo_actions = digits.add_arguments(demo.add_argument_group("demo options"))
    sub.add_parser("env", help="print what replicator sees: devices, cores, torch, and the "
                   "all-reduce that 'auto' picks")
    from replicator.plan import cli_commands

    cli_commands.add_subcommands(sub)  # bench, plan
    return parser, demo_actions


def _demo_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The demo's options as given, to pass on to the demo script."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value != action.default:
            argv += [action.option_strings[-1], str(value)]
    return argv


def _print_env() -> None:
    import torch

    from replicator.cluster.devices import available_accelerators
    from replicator.cluster.environment import resolve_cluster

    print(f"torch {torch.__version__}; CPU cores {os.cpu_count()}; CUDA devices "
          f"{available_accelerators()}; gloo {torch.distributed.is_gloo_available()}; "
          f"nccl {torch.distributed.is_nccl_available()}")
    spec = resolve_cluster()
    print(f"cluster: {spec}")
    from replicator.comm.selection import describe_auto

    choice = describe_auto(local_replicas=max(1, spec.local_world_size))
    hosts = "; across several hosts: hierarchical" if choice.name == "shared_memory" else ""
    print(f"CommunicationOptions(implementation='auto') would choose: {choice.name} "
          f"({choice.reason}{hosts})")


def _refusal(args: argparse.Namespace) -> str | None:
    """What is refused before any worker starts: a strategy the demo cannot run, and more
    workers than this machine's memory holds (unless ``--force``)."""
    if args.command == "demo":
        from replicator.demo import digits

        refusal = digits.strategy_refusal(args.strategy, args.nproc, args.num_ps)
        if refusal is not None:
            return refusal
    if args.force or not isinstance(args.nproc, int):
        return None
    from replicator.cluster.memory_budget import available_memory, memory_refusal

    return memory_refusal(args.nproc, available_memory())


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser, demo_actions = _parser()
    args = parser.parse_args(argv)
    if args.command == "env":
        _print_env()
        return 0
    if args.command in ("bench", "plan"):
        from replicator.plan import cli_commands

        return cli_commands.run(args)
    from replicator.cluster.launcher import run_script

    if args.command == "demo":
        from replicator.demo import digits

        script, script_args = digits.__file__, _demo_argv(args, demo_actions)
    else:
        if args.nproc is None:
            print("replicator run: error: --nproc is required. HINT: add --nproc 2 (the number "
                  "of worker processes).", file=sys.stderr)
            return USAGE_EXIT_CODE
        script, script_args = args.script, args.script_args
    refusal = _refusal(args)
    if refusal is not None:
        print(f"replicator {args.command}: error: {refusal}", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        if args.nnodes != 1 or args.node_rank is not None or args.master_addr is not None:
            from replicator.cluster.multi_node import run_multi_node

            run_multi_node(script, script_args, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, nproc_per_node=args.nproc,
                           master_port=args.master_port, max_restarts=args.max_restarts,
                           timeout_seconds=args.timeout_seconds,
                           rdzv_timeout=args.rdzv_timeout)
            return 0
        run_script(script, script_args, args.nproc, master_port=args.master_port,
                   timeout_seconds=args.timeout_seconds, max_restarts=args.max_restarts,
                   quiet_workers=args.quiet_workers, num_ps=args.num_ps)
    except ClusterConfigError as exc:
        print(f"replicator {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except WorkerFailedError as exc:
        print(f"replicator {args.command}: {exc}", file=sys.stderr)
        code = exc.exitcode
        return code if isinstance(code, int) and 0 < code < 128 else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
