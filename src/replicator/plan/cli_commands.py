"""The ``replicator bench`` and ``replicator plan`` subcommands. Options may come before or
after the script; its own arguments follow ``--``: ``replicator bench train.py -- --epochs 3``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "add_subcommands", "run"]

COMMANDS = ("bench", "plan")
_PARSERS: dict[str, argparse.ArgumentParser] = {}


def add_subcommands(sub: Any) -> None:
    """Add ``bench`` and ``plan`` to the ``replicator`` command's subparsers."""
    from replicator.plan.cost_model import STRATEGIES
    from replicator.plan.devices import DEVICES
    from replicator.plan.settings import BENCH_STRATEGIES

    bench = sub.add_parser(
        "bench", help="run a training script under each setting and measure every step",
        description="Run SCRIPT for a bounded number of steps under each strategy and number "
        "of processes, and measure each step: compute, communication (exposed and "
        "overlapped), input, optimizer, checkpoint; samples/s; peak memory per rank. The "
        "settings run in interleaved rounds; one process is measured at its default threads "
        "and at one thread, and the faster is the baseline. Writes OUT/report.md, "
        "OUT/results.json and, with matplotlib (pip install \"replicator[examples]\"), PNG "
        "plots. The script picks its strategy with "
        "rp.get_strategy(os.environ['REPLICATOR_STRATEGY']) (or takes {strategy} in its "
        "arguments) and trains through strategy.run. Script arguments go after --.")
    bench.add_argument("script", help="the training script")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    bench.add_argument("--nproc", default="1,2",
                       help="process counts to run, comma-separated (default 1,2)")
    bench.add_argument("--strategies", default="one_device,mirrored",
                       help="strategies, comma-separated (default one_device,mirrored; "
                       f"available: {','.join(BENCH_STRATEGIES)})")
    bench.add_argument("--steps", type=int, default=30, help="measured steps per setting "
                       "(default 30)")
    bench.add_argument("--warmup", type=int, default=3,
                       help="steps run before measuring, in each round (default 3)")
    bench.add_argument("--rounds", type=int, default=3,
                       help="run every setting this many times in turn, the steps split "
                       "over them; each setting's figure is its median round (default 3)")
    bench.add_argument("--out", default="bench", help="output folder (default ./bench)")
    _PARSERS["bench"] = bench
    _add_plan(sub, STRATEGIES, DEVICES)


def _add_plan(sub: Any, strategies: tuple[str, ...], devices: Any) -> None:
    """The ``plan`` subcommand's options."""
    plan = sub.add_parser(
        "plan", help="predict each strategy's step time and memory; recommend one",
        description="An alpha-beta cost model of each strategy, fed by the script's step "
        "measured in one process and by this machine's measured collectives (both cached "
        "in OUT), predicts step time, throughput and memory per rank at each worker count, "
        "and recommends one setting (one process included). --validate runs the settings "
        "this machine can run and prints predicted against measured.")
    plan.add_argument("script", nargs="?", default=None,
                      help="the training script (or give --model-params)")
    plan.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    plan.add_argument("--workers", default="2,8,64,1024",
                      help="worker counts, comma-separated (default 2,8,64,1024)")
    plan.add_argument("--device", default="cpu",
                      help=f"device of every worker: {', '.join(devices)} (cpu: hosts like "
                      "this one, measured; the others: nominal datasheet figures)")
    plan.add_argument("--link", default="25gbit",
                      help="network between hosts, e.g. 25gbit, 100gbit, 200mbit, 10GB/s")
    plan.add_argument("--latency", default=None,
                      help="latency of one message between hosts (default 25us)")
    plan.add_argument("--per-host", type=int, default=None, dest="per_host",
                      help="processes per host (default: 8 per GPU host, one per core for cpu)")
    plan.add_argument("--model-params", type=float, default=None, dest="model_params",
                      help="plan a dense model of this many parameters instead of a script")
    plan.add_argument("--global-batch", type=int, default=1024, dest="global_batch",
                      help="with --model-params: samples per step (default 1024)")
    plan.add_argument("--seq-len", type=int, default=1, dest="seq_len",
                      help="with --model-params: tokens per sample (default 1)")
    plan.add_argument("--optimizer", default="adam",
                      help="with --model-params: adam, adamw, momentum or sgd (default adam)")
    plan.add_argument("--strategies", default=",".join(strategies),
                      help=f"strategies to predict (default all: {','.join(strategies)})")
    plan.add_argument("--num-ps", type=int, default=1, dest="num_ps",
                      help="parameter servers of the parameter_server settings (default 1)")
    plan.add_argument("--validate", action="store_true",
                      help="run the settings this machine can run; print predicted against "
                      "measured")
    plan.add_argument("--steps", type=int, default=20,
                      help="measured steps per setting with --validate (default 20)")
    plan.add_argument("--repeat", type=int, default=1,
                      help="with --validate: profile (with --remeasure, measure this machine "
                      "too) and run every setting this many times in turn; compare the plan "
                      "of the medians with each setting's median (default 1; 3 on a shared "
                      "machine, 5 for steps of a few milliseconds)")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON line per setting, nothing else")
    plan.add_argument("--remeasure", action="store_true",
                      help="measure this machine again (else OUT/machine.json is reused)")
    plan.add_argument("--reprofile", action="store_true",
                      help="profile the script again (else its cached profile is reused)")
    plan.add_argument("--out", default="bench",
                      help="folder of caches, plot and validation runs (default ./bench)")
    _PARSERS["plan"] = plan


def _split_rest(args: argparse.Namespace) -> list[str]:
    """Options after the script are ours; the script's arguments follow ``--``."""
    rest = list(args.rest or [])
    script_args: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, script_args = rest[:cut], rest[cut + 1:]
    if rest:
        _PARSERS[args.command].parse_args(
            [*rest, *([args.script] if args.script else [])], namespace=args)
    return script_args


def run(args: argparse.Namespace) -> int:
    """Run ``bench`` or ``plan`` with the parsed ``args``; return the exit code."""
    try:
        script_args = _split_rest(args)
        if args.command == "bench":
            from replicator.plan.benchmark import bench_script

            report = bench_script(args.script, script_args, nproc=args.nproc,
                                  strategies=args.strategies, steps=args.steps,
                                  warmup=args.warmup, out_dir=args.out, rounds=args.rounds)
            return 0 if all(r.ok for r in report.results) else 1
        return _plan(args, script_args)
    except (ValueError, TypeError) as exc:
        print(f"replicator {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _plan(args: argparse.Namespace, script_args: list[str]) -> int:
    from replicator.plan import planner
    from replicator.plan.devices import get_device, parse_link
    from replicator.plan.profiles import MachineProfile, ModelProfile, save_json
    from replicator.plan.settings import positive_ints

    workers = positive_ints(args.workers, "--workers")
    device = get_device(args.device)  # errors early, before anything is measured
    parse_link(args.link)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    if (args.script is None) == (args.model_params is None):
        raise ValueError("give a training script or --model-params, not "
                         f"{'both' if args.script else 'neither'}. HINT: replicator plan "
                         "train.py --workers 2,8 or replicator plan --model-params 7e9")
    if args.validate and args.script is None:
        raise ValueError("--validate runs the script: give one (not --model-params)")
    if args.repeat != 1 and not args.validate:
        raise ValueError("--repeat repeats --validate's profile and runs: add --validate")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be 1 or more, got {args.repeat}")
    log = (lambda text: print(text, file=sys.stderr)) if args.json else print

    def profiled(refresh: bool) -> ModelProfile:
        return planner.profile_script(args.script, script_args, out_dir=args.out,
                                      refresh=refresh, log=log)

    def make_plan(profile: ModelProfile, figures: MachineProfile) -> planner.Plan:
        return planner.plan_model(profile, workers, device=args.device, link=args.link,
                                  latency=args.latency, machine=figures, strategies=strategies,
                                  num_ps=args.num_ps, ranks_per_host=args.per_host)

    model = profiled(args.reprofile) if args.model_params is None else \
        ModelProfile.from_parameter_count(args.model_params, global_batch=args.global_batch,
                                          seq_len=args.seq_len, optimizer=args.optimizer.lower())
    machine = planner.load_machine(args.out, remeasure=args.remeasure, log=log) \
        if device.is_cpu else MachineProfile.nominal()

    text = None
    if args.validate:
        from replicator.plan.validate import summary, validate_interleaved

        remeasuring = args.remeasure and device.is_cpu  # each pass measures this machine
        plan, report = validate_interleaved(
            model, machine, make_plan, lambda: profiled(True),
            (lambda: planner.load_machine(args.out, remeasure=True, log=log))
            if remeasuring else None,
            args.repeat, args.script, tuple(script_args), out_dir=args.out, steps=args.steps,
            quiet=args.json, log=log)
        text = summary(plan, report)
        if args.repeat > 1:  # later plans start from the medians, not the last pass
            planner.save_profile(args.script, script_args, args.out, plan.model)
            if remeasuring:
                save_json(Path(args.out) / "machine.json", plan.cluster.machine.to_json())
    else:
        plan = make_plan(model, machine)
    planner.print_plan(plan, as_json=args.json, plot_path=Path(args.out) / "plan.png", summary=text)
    return 0
