"""The ``replicator`` command: ``run`` a script on N workers, ``demo``, ``env``, ``bench``,
``plan``, ``checkpoints``, ``--version``."""

from __future__ import annotations

import argparse
import os
import sys

import replicator
from replicator.cluster.timeouts import DEFAULT_TIMEOUT_SECONDS
from replicator.errors import ClusterConfigError, LighthouseError, WorkerFailedError

#: Exit code of a command-line mistake (argparse's too).
USAGE_EXIT_CODE = 2


def _add_launch_flags(p: argparse.ArgumentParser, default_nproc: int | None) -> None:
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=default_nproc,
                   help="number of local worker processes (replicas)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole group up to this many times after a failure (with "
                   "--replica-groups: each replica group alone, this many times per group)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on 127.0.0.1 "
                   "(default: MASTER_PORT if set, else a free one)")
    p.add_argument("--timeout", type=float, default=None, dest="timeout_seconds",
                   help="seconds a collective may wait for the other replicas (default 300)")
    p.add_argument("--num-ps", type=int, default=0, help="how many of the --nproc processes "
                   "(the last ranks) are parameter servers, for ParameterServerStrategy")
    p.add_argument("--num-actors", type=int, default=0,
                   help="actor processes started beside the --nproc learners, for rp.rl "
                   "(reinforcement learning); restarted alone with --max-restarts")
    p.add_argument("--force", action="store_true", help="start the workers even when this "
                   "machine's available memory cannot hold them (about 300 MB each)")
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                   help="forkserver (default): fork each worker from a process that imported "
                   "torch once, starting workers and restarts in a fraction of a second; "
                   "spawn: a fresh python per worker (with --nnodes torchrun starts them)")
    p.add_argument("--quiet-workers", action="store_true", help="show only the chief's (rank "
                   "0) output; failures of any rank are still reported")
    multi = p.add_argument_group("several nodes (torch.distributed.elastic, like torchrun)")
    multi.add_argument("--nnodes", type=int, default=1,
                       help="number of nodes (machines) of the job; run the same command on each")
    multi.add_argument("--node-rank", type=int, default=None,
                       help="this node's index, 0..nnodes-1 (node 0 hosts the rendezvous)")
    multi.add_argument("--master-addr", default=None, help="node 0's address on the network "
                       "every node shares; the rendezvous store listens there only (trusted "
                       "networks only: torch.distributed has no authentication)")
    multi.add_argument("--rdzv-timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                       help="seconds the nodes may take to meet (default %(default)s)")


def _add_replica_group_flags(p: argparse.ArgumentParser) -> None:
    live = p.add_argument_group(
        "replica groups (live recovery on torchft; needs pip install 'replicator[live]')",
        "N groups of --nproc processes each: a group that fails is restarted alone and heals "
        "from a live peer while the others keep training. torchft's lighthouse and managers "
        "have no authentication: use them on trusted networks only.")
    live.add_argument("--replica-groups", type=int, default=None, metavar="N",
                      help="start N replica groups of --nproc processes each, and torchft's "
                      "lighthouse on 127.0.0.1 (unless --lighthouse/--join)")
    live.add_argument("--min-replicas", type=int, default=1, metavar="M", help="fewest "
                      "replica groups a step may commit with; below it the job waits (default 1)")
    live.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                      help="use the torchft lighthouse running at HOST:PORT instead of "
                      "starting one (groups 0..N-1, or from --replica-group-id)")
    live.add_argument("--join", default=None, metavar="HOST:PORT",
                      help="add replica groups (default 1) to the running job whose lighthouse "
                      "is at HOST:PORT, with ids it has not seen")
    live.add_argument("--replica-group-id", type=int, default=None, metavar="G", help="the id "
                      "of this command's first group (the others follow: G, G+1, ...)")
    live.add_argument("--lighthouse-bind", default=None, metavar="ADDR[:PORT]",
                      help="where the lighthouse started here listens (default 127.0.0.1 and "
                      "a free port); another address exposes it to that network")
    live.add_argument("--heartbeat-timeout", type=float, default=2.0, metavar="SECONDS",
                      help="a group silent this long counts as gone, and the next step goes "
                      "on without it (default 2)")
    live.add_argument("--join-timeout", type=float, default=60.0, metavar="SECONDS",
                      help="how long a step waits for a live group that has not asked to "
                      "join yet (default 60)")


def _replica_groups_asked(args: argparse.Namespace) -> bool:
    return args.command == "run" and (args.replica_groups is not None
                                      or args.join is not None or args.lighthouse is not None)


def _stray_replica_group_flag(args: argparse.Namespace) -> str | None:
    """A replica-group flag given without ``--replica-groups``/``--join``/``--lighthouse``."""
    if args.command != "run" or _replica_groups_asked(args):
        return None
    return next((flag for flag, given in (
        ("--min-replicas", args.min_replicas != 1),
        ("--replica-group-id", args.replica_group_id is not None),
        ("--lighthouse-bind", args.lighthouse_bind is not None),
        ("--heartbeat-timeout", args.heartbeat_timeout != 2.0),
        ("--join-timeout", args.join_timeout != 60.0)) if given), None)


def _run_replica_groups(args: argparse.Namespace) -> None:
    """``replicator run --replica-groups N ...``: checked, then run."""
    from replicator.launch.lighthouse import LighthouseSettings
    from replicator.launch.replica_groups import check_config, run_replica_groups

    for flag, given in (("--nnodes", args.nnodes != 1 or args.node_rank is not None),
                        ("--num-ps", args.num_ps != 0),
                        ("--num-actors", args.num_actors != 0),
                        ("--master-port", args.master_port is not None)):
        if given:
            raise ClusterConfigError(
                f"{flag} does not combine with --replica-groups. HINT: each replica group "
                "has its own rendezvous on a free port; to span machines, start groups on "
                "each machine with --join HOST:PORT (or --lighthouse) naming one lighthouse.")
    for flag, value in (("--heartbeat-timeout", args.heartbeat_timeout),
                        ("--join-timeout", args.join_timeout)):
        if not value > 0:
            raise ClusterConfigError(f"{flag} must be a number of seconds > 0, got {value}")
    settings = LighthouseSettings(join_timeout=args.join_timeout,
                                  heartbeat_timeout=args.heartbeat_timeout)
    cfg = check_config(groups=args.replica_groups, nproc=args.nproc,
                       min_replicas=args.min_replicas, lighthouse=args.lighthouse,
                       lighthouse_bind=args.lighthouse_bind, join=args.join,
                       group_id=args.replica_group_id, max_restarts=args.max_restarts,
                       timeout_seconds=args.timeout_seconds, quiet_workers=args.quiet_workers,
                       settings=settings, start_method=args.start_method)
    run_replica_groups(args.script, args.script_args, cfg=cfg)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"replicator {replicator.__version__} (torch {version('torch')})"
    except PackageNotFoundError:
        return f"replicator {replicator.__version__} (torch not installed)"


def _parser() -> tuple[argparse.ArgumentParser, list[argparse.Action]]:
    """The command's parser, and the demo's own options (forwarded to the demo)."""
    from replicator.checkpoint import command_line
    from replicator.demo import options as demo_options
    from replicator.plan import cli_commands

    parser = argparse.ArgumentParser(prog="replicator", description="Distributed training for "
                                     "PyTorch: run scripts on several local workers.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training script on N local workers",
                         description="Run SCRIPT in N worker processes on this machine (CPU + "
                         "gloo, or one process per GPU + NCCL). For several machines run the "
                         "same command on each with --nnodes/--node-rank/--master-addr (or use "
                         "torchrun); the script needs no change. With --replica-groups N, N "
                         "groups that fail and heal one at a time while the others keep "
                         "training (torchft).")
    _add_launch_flags(run, None)
    _add_replica_group_flags(run)
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    demo = sub.add_parser("demo", help="train a small CNN on the digits dataset on 2 workers",
                          description="Train a small CNN on scikit-learn's 8x8 digits with "
                          "MirroredStrategy on --nproc local workers (nothing is downloaded).")
    _add_launch_flags(demo, 2)
    demo_actions = demo_options.add_arguments(demo.add_argument_group("demo options"))
    sub.add_parser("env", help="print what replicator sees: devices, cores, torch, and the "
                   "all-reduce that 'auto' picks")
    cli_commands.add_subcommands(sub)  # bench, plan
    command_line.add_subcommand(sub)  # checkpoints list|verify|export
    return parser, demo_actions


def _demo_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The demo's options as given, to pass on to the demo script."""
    return [arg for a in actions if getattr(args, a.dest) != a.default
            for arg in (a.option_strings[-1], str(getattr(args, a.dest)))]


def _print_env() -> None:
    import torch

    from replicator.cluster.devices import available_accelerators
    from replicator.cluster.environment import resolve_cluster
    from replicator.comm.selection import describe_auto

    print(f"torch {torch.__version__}; CPU cores {os.cpu_count()}; CUDA devices "
          f"{available_accelerators()}; gloo {torch.distributed.is_gloo_available()}; "
          f"nccl {torch.distributed.is_nccl_available()}")
    spec = resolve_cluster()
    print(f"cluster: {spec}")
    choice = describe_auto(local_replicas=max(1, spec.local_world_size))
    hosts = "; across several hosts: hierarchical" if choice.name == "shared_memory" else ""
    print(f"CommunicationOptions(implementation='auto') would choose: {choice.name} "
          f"({choice.reason}{hosts})")


def _master_port(args: argparse.Namespace) -> int | None:
    """``--master-port``, else ``MASTER_PORT`` from the environment (as torchrun reads it),
    else ``None``: the launcher picks a free port."""
    if args.master_port is not None:
        return int(args.master_port)
    raw = os.environ.get("MASTER_PORT", "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(f"MASTER_PORT={raw!r} (from the environment) is not a port "
                                 "number. HINT: set it to a free port such as 29500, or unset "
                                 "it to let replicator choose a free one.") from None


def _refusal(args: argparse.Namespace) -> str | None:
    """What is refused before any worker starts: ``run`` without ``--nproc``, a strategy the
    demo cannot run, more workers than this machine's memory holds (unless ``--force``), and a
    replica-group flag without ``--replica-groups``."""
    if args.command == "run" and args.nproc is None:
        return "--nproc is required. HINT: add --nproc 2 (the number of worker processes)."
    if args.command == "demo":
        from replicator.demo.options import strategy_refusal

        if (refusal := strategy_refusal(args.strategy, args.nproc, args.num_ps)) is not None:
            return refusal
    if not args.force and isinstance(args.nproc, int):
        from replicator.launch.memory_budget import available_memory, memory_refusal

        groups = args.replica_groups if _replica_groups_asked(args) else None
        total = args.nproc * groups if isinstance(groups, int) and groups > 0 else args.nproc
        if (refusal := memory_refusal(total, available_memory())) is not None:
            return refusal
    stray = _stray_replica_group_flag(args)
    return None if stray is None else (
        f"{stray} needs --replica-groups N (or --join HOST:PORT). HINT: add --replica-groups 2 "
        "to run 2 replica groups with live recovery.")


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
    if args.command == "checkpoints":
        from replicator.checkpoint import inspection

        return inspection.run(args)
    from replicator.launch.script_launch import run_script

    if (refusal := _refusal(args)) is not None:
        print(f"replicator {args.command}: error: {refusal}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.command == "demo":
        from importlib.util import find_spec

        spec = find_spec("replicator.demo.digits")  # its path: the workers import it
        assert spec is not None and spec.origin is not None
        script, script_args = spec.origin, _demo_argv(args, demo_actions)
    else:
        script, script_args = args.script, args.script_args
    try:
        if _replica_groups_asked(args):
            _run_replica_groups(args)
            return 0
        if args.nnodes != 1 or args.node_rank is not None or args.master_addr is not None:
            from replicator.launch.multi_node import run_multi_node

            if args.num_actors:
                raise ClusterConfigError("--num-actors runs on one machine for now. HINT: "
                                         "drop --nnodes/--node-rank/--master-addr.")
            run_multi_node(script, script_args, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, nproc_per_node=args.nproc,
                           master_port=_master_port(args), max_restarts=args.max_restarts,
                           timeout_seconds=args.timeout_seconds,
                           rdzv_timeout=args.rdzv_timeout)
            return 0
        run_script(script, script_args, args.nproc, master_port=_master_port(args),
                   timeout_seconds=args.timeout_seconds, max_restarts=args.max_restarts,
                   quiet_workers=args.quiet_workers, num_ps=args.num_ps,
                   num_actors=args.num_actors, start_method=args.start_method)
    except (ClusterConfigError, LighthouseError) as exc:
        print(f"replicator {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE if isinstance(exc, ClusterConfigError) else 1
    except WorkerFailedError as exc:
        print(f"replicator {args.command}: {exc}", file=sys.stderr)
        code = exc.exitcode
        return code if isinstance(code, int) and 0 < code < 128 else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
