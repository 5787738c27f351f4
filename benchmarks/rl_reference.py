"""Time to the reference return: the rl examples with actor processes against one process.

For each example (``examples/rl_impala.py``: CartPole-v1, mean return of the last 100 episodes
>= 475; ``examples/rl_d4pg.py``: Pendulum-v1, >= -200) the benchmark runs, alternately, the
distributed shape (1 learner and ``--actors`` actor processes, as ``python examples/...``
launches it) and the same script with ``--in-process`` (the learner steps the same environments
itself before each batch, with the same replay, rate limiter, networks and seeds: the
one-process baseline, run with one intra-op thread and with torch's default, the faster
counting, as ``replicator bench`` takes its one-process baseline). Each run stops at the
reference or after ``--seconds``; its wall time to the reference is read from the script's own
result line: from the learner's first request for a batch (the interpreter's and the learner's
start-up excluded alike; the actors' start-up, which overlaps the learner's wait for its first
batch, is counted).

``time_to_reference`` = distributed seconds / one-process seconds (goal <= 1.0); a run that
did not reach the reference counts as its time limit and is shown as such. ``policy_lag``:
the distributed runs' median and max (learner steps between the weights an actor used and the
step that sampled its experience). Runs are long (up to ``--seconds`` each): pick one example
per call to stay within a few minutes, e.g.

    python benchmarks/rl_reference.py --example impala --rounds 1
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import emit, median, print_table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"impala": "rl_impala.py", "d4pg": "rl_d4pg.py"}


def run_example(example: str, in_process: bool, seconds: float, actors: int,
                threads: int | None = None) -> dict:
    """One run of ``example`` (``threads``: torch's intra-op threads of the one process,
    ``None`` for torch's default); its result dict (the line the script prints on the
    chief)."""
    plot = os.path.join(tempfile.mkdtemp(prefix="rl-ref-"), f"{example}.png")
    script = str(ROOT / "examples" / EXAMPLES[example])
    if in_process:
        cmd = [sys.executable, script, "--in-process", "--seconds", str(seconds),
               "--plot", plot]
    else:
        cli = "import sys; from replicator.cli import main; sys.exit(main())"
        cmd = [sys.executable, "-c", cli, "run", "--nproc", "1", "--num-actors", str(actors),
               script, "--seconds", str(seconds), "--plot", plot]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "examples"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=seconds + 120, check=False)
    for line in reversed(done.stdout.splitlines()):
        line = re.sub(r"^\[rank \d+\] ", "", line)  # the launcher's relay prefix
        if line.startswith("{") and "mean_return_last_100" in line:
            return ast.literal_eval(line)  # the script prints a dict of plain values
    raise RuntimeError(f"{' '.join(cmd)} printed no result (exit code {done.returncode}):\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def seconds_to_reference(result: dict, limit: float) -> float:
    return float(result["seconds"]) if result["reached"] else limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", choices=sorted(EXAMPLES), nargs="+",
                        default=sorted(EXAMPLES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=280.0,
                        help="time limit of each run (the examples' own default)")
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    rows, lines = [], []
    for example in args.example:
        baseline_threads: list[list[float]] = []
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(args.rounds):
            for in_process in ((True, False) if r % 2 == 0 else (False, True)):
                if not in_process:
                    runs[False].append(run_example(example, False, args.seconds, args.actors))
                    continue
                tries = [run_example(example, True, args.seconds, args.actors, threads)
                         for threads in (1, None)]  # the faster of one thread and the default
                runs[True].append(min(tries, key=lambda x: seconds_to_reference(
                    x, args.seconds)))
                baseline_threads.append([seconds_to_reference(x, args.seconds)
                                         for x in tries])
        times = {k: [seconds_to_reference(x, args.seconds) for x in v] for k, v in runs.items()}
        reached = {k: sum(bool(x["reached"]) for x in v) for k, v in runs.items()}
        lags = [x["median_policy_lag"] for x in runs[False]]
        ratio = median(times[False]) / median(times[True])
        for label, key in (("one process", True), (f"1 learner, {args.actors} actors", False)):
            rows.append([example, label, median(times[key]),
                         f"{min(times[key]):.0f}-{max(times[key]):.0f}",
                         f"{reached[key]}/{args.rounds}",
                         median([x["env_steps"] for x in runs[key]]),
                         "-" if key else f"{median(lags):g} / "
                         f"{max(x['max_policy_lag'] for x in runs[False])}"])
        lines.append((example, ratio, times, reached, lags, runs))
        print(f"{example}, one process: seconds to reference with 1 thread / torch's default "
              f"threads, per round: {baseline_threads}")
    print(f"{args.rounds} round(s), time limit {args.seconds:g} s a run, load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print_table(["example", "run", "seconds to reference", "range", "reached", "env steps",
                 "policy lag median / max"], rows)
    for example, ratio, times, reached, lags, runs in lines:
        emit("rl_reference", f"time_to_reference_{example}", ratio, "<= 1.0",
             distributed_s=median(times[False]), one_process_s=median(times[True]),
             reached_distributed=reached[False], reached_one_process=reached[True],
             rounds=args.rounds, median_policy_lag=median(lags),
             max_policy_lag=max(x["max_policy_lag"] for x in runs[False]))


if __name__ == "__main__":
    main()
