"""Live recovery against today's whole-job restart, with the same model, data and kills.

Three runs of one MLP on the same data and global batch, each timed over a window of
``--window`` seconds from its first committed step:

- ``none``: 3 replica groups of one process through torchft (``replicator run
  --replica-groups 3``'s engine), no failure;
- ``live``: the same, a group killed with SIGKILL every ``--kill-every`` seconds (groups 1 and
  2 in turn, never group 0, which reports) and restarted at once; it heals from a live peer;
- ``restart``: ``MirroredStrategy`` on 3 processes under ``replicator run --nproc 3
  --max-restarts``, ``BackupAndRestore(save_freq=100)``; the same kills of one worker make the
  launcher restart the whole job, which resumes from the last backup.

Per failure of ``live``: ``steps_redone`` (steps group 0 ran again), ``stall_s`` (how much
longer than a median step group 0's redone step took), the rejoin stall (the step in which
the restarted group healed), and ``goodput`` (committed samples per second over the window,
relative to ``none``). ``heal_s_100mb``: a second group joins a group training a 100 MB model
(25M float32 parameters, plain SGD) and heals from it on loopback: the state's transfer plus
loading it. Goals: steps_redone <= 1 per failure; stall_s <= the collective timeout + 1 s;
heal_s_100mb <= 3 s; goodput_live >= 0.9; live_vs_restart >= 1.3 (with it, the cost of one
whole-job restart at which live recovery breaks even at this failure rate);
``live_vs_restart_120s``: the same ratio with a kill every 120 s, estimated from each path's
failure-free rate and the training time it lost per failure in this run (a window long enough
for two kills 120 s apart would take each run past 5 minutes).

``live_step_vs_mirrored``: the median failure-free step of ``none`` over that of
``MirroredStrategy`` on as many processes (``replicator run --nproc 3``, same model and global
batch, no backups), goal <= 1.10; beside it where each step's time goes: the live engine's
quorum, cross-group all-reduce, commit vote and bookkeeping (``LiveEngine.seconds``), Mirrored's
all-reduce (``REPLICATOR_COMM_TIMING``), the rest being forward, backward and the update.

Run: ``python benchmarks/recovery.py [--window 65] [--kill-every 30] [--keep]`` (about 5
minutes; ``--keep`` keeps the runs' logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import emit, median, print_table  # noqa: E402
from replicator.testing.live_groups import (  # noqa: E402
    free_port,
    start_group,
    start_lighthouse,
)

BENCH = "recovery"
GROUPS = 3
BATCH = 96          # the global batch, 32 per group with 3 groups
SAVE_FREQ = 100     # the restart path's backups
WARMUP = 20         # steps before the per-step breakdown starts counting
COLLECTIVE_TIMEOUT = 10.0


def build(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(samples, 64, generator=g),
                         torch.randint(0, 10, (samples,), generator=g))


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


# -- workers ---------------------------------------------------------------------------------------
def live_worker(out: Path, width: int, depth: int, samples: int, lr: float) -> None:
    import replicator as rp

    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = build(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    live = strategy.live
    assert live is not None
    group = os.environ["REPLICATOR_REPLICA_GROUP"]

    def step_fn(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    periods: list[float] = []
    stalls: list[float] = []
    rejoins: list[float] = []
    redone, participants = 0, 0
    base: tuple[int, dict[str, float]] | None = None
    last = time.monotonic()
    for batch in strategy.distribute_dataset(data(samples), batch_size=BATCH, shuffle=True,
                                             epochs=10_000):
        strategy.run(step_fn, (batch,))
        now = time.monotonic()
        period, last = now - last, now
        typical = median(periods[-50:]) if periods else period
        if live.redone_steps > redone:
            stalls.append(period - typical)
        elif participants and live.participants > participants:
            rejoins.append(period - typical)
        else:
            periods.append(period)
        redone, participants = live.redone_steps, live.participants
        if base is None and len(periods) == WARMUP:
            base = (live.committed_steps + redone, dict(live.seconds))
        _write(out / f"progress_g{group}.json",
               {"step": live.committed_steps, "redone": redone, "stalls": stalls,
                "rejoins": rejoins, "median_step_s": median(periods[-200:]) if periods else 0,
                "heal_s": live.last_heal_seconds, "pid": os.getpid(), "time": time.time(),
                "per_step_s": _per_step(base, live.committed_steps + redone, live.seconds),
                "transport": "shared memory" if live.process_group.uses_shared_memory
                else "gloo"})


def _per_step(base: tuple[int, dict[str, float]] | None, steps: int,
              seconds: dict[str, float]) -> dict[str, float]:
    """Mean seconds per step of each timed part since ``base`` (steps and seconds then)."""
    if base is None or steps <= base[0]:
        return {}
    return {k: (v - base[1].get(k, 0.0)) / (steps - base[0]) for k, v in seconds.items()}


def heal_worker(out: Path) -> None:
    import replicator as rp

    strategy = rp.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(5000, 5000)  # 25,005,000 float32 parameters: 100 MB
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    live = strategy.live
    assert live is not None
    group = os.environ["REPLICATOR_REPLICA_GROUP"]
    ds = TensorDataset(torch.randn(64, 5000), torch.randn(64, 5000))
    for x, y in strategy.distribute_dataset(ds, batch_size=8, epochs=10_000):
        strategy.run(lambda x, y: (F.mse_loss(model(x), y).backward(), opt.step(),
                                   opt.zero_grad()), (x, y))
        _write(out / f"heal_g{group}.json", {"step": live.committed_steps,
                                             "heal_s": live.last_heal_seconds})


def _mirrored_training(width: int, depth: int, lr: float) -> tuple[Any, Any, Any, Any]:
    """MirroredStrategy, the model, its optimizer and the step: what the restart run and the
    live engine's reference step both train."""
    import replicator as rp

    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = build(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step_fn(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return strategy, model, opt, step_fn


def restart_worker(out: Path, width: int, depth: int, samples: int, lr: float) -> None:
    import replicator as rp

    strategy, model, opt, step_fn = _mirrored_training(width, depth, lr)
    backup = rp.BackupAndRestore(str(out / "backup"), save_freq=SAVE_FREQ)
    backup.track(model=model, optimizer=opt)
    rank = int(os.environ.get("RANK", "0"))

    dist = strategy.distribute_dataset(data(samples), batch_size=BATCH, shuffle=True)
    for _, batch in backup.steps(dist, epochs=10_000):
        strategy.run(step_fn, (batch,))
        _write(out / f"progress_r{rank}.json", {"step": backup.step, "pid": os.getpid(),
                                                "time": time.time()})


def mirrored_worker(out: Path, width: int, depth: int, samples: int, lr: float) -> None:
    """The same model, data and global batch on ``MirroredStrategy`` alone: the step that the
    live engine's failure-free step is measured against."""
    from replicator.comm import timing

    strategy, _, _, step_fn = _mirrored_training(width, depth, lr)
    rank = int(os.environ.get("RANK", "0"))

    periods: list[float] = []
    base: tuple[int, float] | None = None
    last = time.monotonic()
    for step, batch in enumerate(strategy.distribute_dataset(data(samples), batch_size=BATCH,
                                                             shuffle=True, epochs=10_000)):
        strategy.run(step_fn, (batch,))
        now = time.monotonic()
        periods.append(now - last)
        last = now
        if base is None and len(periods) == WARMUP:
            base = (step, timing.snapshot().exposed)
        per_step = {} if base is None or step <= base[0] else {
            "allreduce": (timing.snapshot().exposed - base[1]) / (step - base[0])}
        _write(out / f"mirrored_r{rank}.json",
               {"step": step + 1, "median_step_s": median(periods[1:][-200:] or periods),
                "per_step_s": per_step})


# -- the driver ------------------------------------------------------------------------------------
def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_step(path: Path, step: int, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = _read(path)
        if rec is not None and rec["step"] >= step:
            return rec
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not reach step {step} within {timeout:.0f} s")


def _worker_args(args: argparse.Namespace, mode: str, out: Path) -> list[str]:
    return ["--worker", mode, "--out", str(out), "--width", str(args.width), "--depth",
            str(args.depth), "--samples", str(args.samples)]


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PYTHONPATH": os.path.join(root, "src") + os.pathsep + root,
            "REPLICATOR_LIVE_TIMEOUT_SECONDS": str(int(COLLECTIVE_TIMEOUT)),
            "OMP_NUM_THREADS": "1"}


def run_live(args: argparse.Namespace, out: Path, kills: bool) -> dict:
    out.mkdir(parents=True)
    lighthouse = start_lighthouse(1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
    script = os.path.abspath(__file__)
    groups = {g: start_group(script, g, GROUPS, lighthouse.address, env=_env(), log_dir=out,
                             args=_worker_args(args, "live", out)) for g in range(GROUPS)}
    failures = 0
    try:
        start = _wait_step(out / "progress_g0.json", 1, 120, "group 0")
        t0, s0 = time.monotonic(), start["step"]
        next_kill, victim = t0 + args.kill_every * 0.6, 1
        while time.monotonic() < t0 + args.window:
            if kills and time.monotonic() >= next_kill:
                groups[victim].kill()
                failures += 1
                groups[victim] = start_group(script, victim, GROUPS, lighthouse.address,
                                             env=_env(), log_dir=out,
                                             args=_worker_args(args, "live", out))
                next_kill += args.kill_every
                victim = 2 if victim == 1 else 1
            for g, grp in groups.items():
                code = grp.poll()[0]
                if code is not None:
                    raise RuntimeError(f"group {g} exited with {code}; see {out}")
            time.sleep(0.05)
        end = _read(out / "progress_g0.json")
        assert end is not None
        steps = end["step"] - s0
    finally:
        for grp in groups.values():
            grp.kill()
        lighthouse.stop()
    return {"steps": steps, "samples_per_s": steps * BATCH / args.window,
            "failures": failures, "redone": end["redone"], "stalls": end["stalls"],
            "rejoins": end["rejoins"], "median_step_s": end["median_step_s"],
            "per_step_s": end.get("per_step_s", {}), "transport": end.get("transport", "?")}


def run_restart(args: argparse.Namespace, out: Path) -> dict:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "replicator.cli", "run", "--nproc", str(GROUPS),
           "--max-restarts", "20", "--master-port", str(free_port()),
           os.path.abspath(__file__), *_worker_args(args, "restart", out)]
    log = open(out / "launcher.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=dict(os.environ, **_env()), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    failures = 0
    try:
        start = _wait_step(out / "progress_r0.json", 1, 120, "the restart job")
        t0, s0 = time.monotonic(), start["step"]
        next_kill, victim = t0 + args.kill_every * 0.6, 1
        while time.monotonic() < t0 + args.window:
            if time.monotonic() >= next_kill:
                rec = _read(out / f"progress_r{victim}.json")
                if rec is not None:
                    try:
                        os.kill(rec["pid"], signal.SIGKILL)
                        failures += 1
                    except ProcessLookupError:
                        pass
                next_kill += args.kill_every
                victim = 2 if victim == 1 else 1
            if proc.poll() is not None:
                raise RuntimeError(f"the restart job exited with {proc.returncode}; see {out}")
            time.sleep(0.05)
        end = _read(out / "progress_r0.json")
        assert end is not None
        steps = end["step"] - s0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
    return {"steps": steps, "samples_per_s": steps * BATCH / args.window,
            "failures": failures}


def run_mirrored(args: argparse.Namespace, out: Path) -> dict:
    """``MirroredStrategy`` on ``GROUPS`` processes for ``--mirrored-window`` seconds."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "replicator.cli", "run", "--nproc", str(GROUPS),
           "--master-port", str(free_port()), os.path.abspath(__file__),
           *_worker_args(args, "mirrored", out)]
    log = open(out / "launcher.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=dict(os.environ, **_env(), REPLICATOR_COMM_TIMING="1"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_step(out / "mirrored_r0.json", WARMUP + 1, 120, "the Mirrored job")
        deadline = time.monotonic() + args.mirrored_window
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the Mirrored job exited with {proc.returncode}; see {out}")
            time.sleep(0.05)
        end = _read(out / "mirrored_r0.json")
        assert end is not None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
    return end


def run_heal(out: Path) -> float:
    out.mkdir(parents=True)
    lighthouse = start_lighthouse(1, join_timeout_ms=5000)
    script = os.path.abspath(__file__)
    groups = []
    try:
        groups.append(start_group(script, 0, 2, lighthouse.address, env=_env(), log_dir=out,
                                  args=["--worker", "heal", "--out", str(out)]))
        _wait_step(out / "heal_g0.json", 2, 180, "the 100 MB group")
        groups.append(start_group(script, 1, 2, lighthouse.address, env=_env(), log_dir=out,
                                  args=["--worker", "heal", "--out", str(out)]))
        rec = _wait_step(out / "heal_g1.json", 1, 180, "the healing group")
        deadline = time.monotonic() + 60
        while rec.get("heal_s") is None and time.monotonic() < deadline:
            time.sleep(0.05)
            rec = _read(out / "heal_g1.json") or rec
        return float(rec["heal_s"])
    finally:
        for grp in groups:
            grp.kill()
        lighthouse.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=65.0)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--samples", type=int, default=96 * 200)
    parser.add_argument("--mirrored-window", type=float, default=30.0)
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "live":
        return live_worker(Path(args.out), args.width, args.depth, args.samples, 0.01)
    if args.worker == "restart":
        return restart_worker(Path(args.out), args.width, args.depth, args.samples, 0.01)
    if args.worker == "heal":
        return heal_worker(Path(args.out))
    if args.worker == "mirrored":
        return mirrored_worker(Path(args.out), args.width, args.depth, args.samples, 0.01)
    root = Path(tempfile.mkdtemp(prefix="replicator-recovery-"))
    try:
        heal = run_heal(root / "heal")
        none = run_live(args, root / "none", kills=False)
        live = run_live(args, root / "live", kills=True)
        restart = run_restart(args, root / "restart")
        mirrored = run_mirrored(args, root / "mirrored")
    finally:
        if args.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    per_failure = max(live["failures"], 1)
    breakeven = _breakeven_restart_s(args.kill_every, none, mirrored, live, per_failure)
    stall = max(live["stalls"], default=0.0)
    rejoin = max(live["rejoins"], default=0.0)
    goodput_live = live["samples_per_s"] / none["samples_per_s"]
    goodput_restart = restart["samples_per_s"] / none["samples_per_s"]
    print(f"recovery: {GROUPS} groups, MLP {args.depth} x {args.width}, global batch {BATCH}, "
          f"window {args.window:.0f} s, a kill every {args.kill_every:.0f} s, collective "
          f"timeout {COLLECTIVE_TIMEOUT:.0f} s (median step {none['median_step_s'] * 1e3:.0f} "
          "ms without failures)")
    print_table(["run", "failures", "committed steps", "samples/s", "goodput"], [
        ["no failures (live engine)", 0, none["steps"], none["samples_per_s"], 1.0],
        ["live recovery", live["failures"], live["steps"], live["samples_per_s"],
         goodput_live],
        ["whole-job restart (save_freq=100)", restart["failures"], restart["steps"],
         restart["samples_per_s"], goodput_restart]])
    print()
    print_table(["per failure (live)", "value"], [
        ["steps redone by survivors", live["redone"] / per_failure],
        ["survivor stall at the failure (s)", stall],
        ["survivor stall when the group rejoins (s)", rejoin],
        ["heal of a 100 MB state (s)", heal],
        ["restart cost at which live recovery breaks even (s)", breakeven]])
    print()
    step_ratio = _step_table(none, mirrored)
    emit(BENCH, "live_step_vs_mirrored", step_ratio, "<= 1.10",
         live_step_ms=round(none["median_step_s"] * 1e3, 2),
         mirrored_step_ms=round(mirrored["median_step_s"] * 1e3, 2), transport=none["transport"])
    emit(BENCH, "steps_redone", live["redone"] / per_failure, "<= 1",
         failures=live["failures"])
    emit(BENCH, "stall_s", stall, f"<= {COLLECTIVE_TIMEOUT + 1:.0f}", rejoin_s=round(rejoin, 3))
    emit(BENCH, "heal_s_100mb", heal, "<= 3")
    emit(BENCH, "goodput_live", goodput_live, ">= 0.9")
    emit(BENCH, "live_vs_restart", live["samples_per_s"] / max(restart["samples_per_s"], 1e-9),
         ">= 1.3", goodput_restart=round(goodput_restart, 4),
         breakeven_restart_s=round(breakeven, 2))
    every = 120.0
    emit(BENCH, f"live_vs_restart_{every:.0f}s", _ratio_at(every, args.window, none, live,
                                                           restart, mirrored, per_failure),
         ">= 1.3", estimated="from this run's losses per failure, not a run with kills "
         f"{every:.0f} s apart")


def _ratio_at(every: float, window: float, none: dict, live: dict, restart: dict,
              mirrored: dict, failures: int) -> float:
    """Live recovery / whole-job restart (samples/s) with failures ``every`` seconds apart,
    estimated from this run: each path's failure-free rate (the live engine's, Mirrored's)
    less the training time it lost per failure here."""
    live_rate, restart_rate = none["samples_per_s"], BATCH / max(mirrored["median_step_s"], 1e-9)
    live_lost = max(0.0, window * (1 - live["samples_per_s"] / live_rate)) / failures
    restart_lost = max(0.0, window * (1 - restart["samples_per_s"] / restart_rate)) / failures
    return (live_rate * max(0.0, 1 - live_lost / every)) / \
        max(restart_rate * max(0.0, 1 - restart_lost / every), 1e-9)


def _breakeven_restart_s(every: float, none: dict, mirrored: dict, live: dict,
                         failures: int) -> float:
    """The cost of one whole-job restart (launch to first step) at which both paths train
    as much between failures ``every`` seconds apart: live recovery loses its slower steps
    over the interval plus the stalls of a failure; a restart loses itself plus the replay
    of half a backup interval of Mirrored steps."""
    live_step, mirrored_step = none["median_step_s"], mirrored["median_step_s"]
    slower = every * max(0.0, 1.0 - mirrored_step / max(live_step, 1e-9))
    stalls = (sum(live["stalls"]) + sum(live["rejoins"])) / failures
    return max(0.0, slower + stalls - SAVE_FREQ / 2 * mirrored_step)


def _step_table(none: dict, mirrored: dict) -> float:
    """Print where a failure-free step's time goes, live beside Mirrored; returns the ratio
    of their median steps."""
    live_ms, mirrored_ms = none["median_step_s"] * 1e3, mirrored["median_step_s"] * 1e3
    live_parts = {k: v * 1e3 for k, v in none["per_step_s"].items()}
    mirrored_parts = {k: v * 1e3 for k, v in mirrored["per_step_s"].items()}
    names = {"allreduce": f"allreduce (live: {none['transport']})"}
    rows = [[names.get(part, part), live_parts.get(part, float("nan")),
             mirrored_parts.get(part, 0.0)]
            for part in ("quorum", "allreduce", "commit", "bookkeeping")]
    rows.append(["forward, backward, update (the rest)",
                 live_ms - sum(live_parts.values()),
                 mirrored_ms - sum(mirrored_parts.values())])
    rows.append(["median step", live_ms, mirrored_ms])
    print_table(["failure-free step (ms; parts: means, step: median)", "live engine",
                 "MirroredStrategy"], rows)
    return live_ms / max(mirrored_ms, 1e-9)


if __name__ == "__main__":
    main()
