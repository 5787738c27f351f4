"""Actor throughput: environment steps per second with 1, 2 and 4 actors feeding one learner.

    python benchmarks/actors.py [--rounds 3] [--seconds 5] [--env CartPole-v1]

Beside each figure: the same stepping code in one process (no actors), and the no-communication
ceiling (A processes stepping the same code at the same time, sending nothing), so that
``vs_ceiling`` is what the actor transport costs. The learner here trains nothing: it publishes
weights once and counts the env steps it receives over ``--seconds``. Rounds are interleaved;
medians and ranges are printed, then one JSON line per figure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402

NUM_ENVS = 8


def _policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def _act(policy: torch.nn.Module, obs: torch.Tensor) -> torch.Tensor:
    return policy(obs).argmax(-1)


def step_alone(env_id: str, seconds: float, out: mp.Queue | None = None) -> float:
    """Env steps per second of one process stepping ``NUM_ENVS`` envs with the policy."""
    import numpy as np

    from replicator.rl.environments import make_vector_env

    torch.set_num_threads(1)
    envs = make_vector_env(env_id, NUM_ENVS)
    policy = _policy()
    obs, _ = envs.reset(seed=0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        with torch.no_grad():
            action = _act(policy, torch.as_tensor(np.asarray(obs), dtype=torch.float32))
        obs, *_ = envs.step(action.numpy())
        steps += NUM_ENVS
    rate = steps / (time.perf_counter() - start)
    if out is not None:
        out.put(rate)
    return rate


def ceiling(env_id: str, actors: int, seconds: float) -> float:
    """``actors`` processes stepping at once, sending nothing: the sum of their rates."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=step_alone, args=(env_id, seconds, out)) for _ in range(actors)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    return sum(rates)


def learner(env_id: str, seconds: float) -> float:
    """The learner of the actor runs: env steps received per second over ``seconds``."""
    replay = rp.rl.ReplayBuffer(100_000, timeout_seconds=120)
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, env_id, _policy, replay=replay,
                            act_fn=_act, num_envs=NUM_ENVS, send_every=256)
    if al.is_actor:
        al.run_actor()
        return 0.0
    with al:
        al.publish_weights(_policy())
        deadline = time.monotonic() + 120
        while al.stats()["env_steps"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # every actor stepping
        first, t0 = al.stats()["env_steps"], time.perf_counter()
        time.sleep(seconds)
        last, t1 = al.stats()["env_steps"], time.perf_counter()
    return (last - first) / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    alone: list[float] = []
    ours: dict[int, list[float]] = {a: [] for a in args.actors}
    ceil: dict[int, list[float]] = {a: [] for a in args.actors}
    for _ in range(args.rounds):
        alone.append(step_alone(args.env, args.seconds))
        for a in args.actors:
            ceil[a].append(ceiling(args.env, a, args.seconds))
            ours[a].append(rp.launch(learner, num_replicas=1, num_actors=a,
                                     args=(args.env, args.seconds))[0])
    print(f"env {args.env}, {NUM_ENVS} envs per actor, {args.rounds} rounds of "
          f"{args.seconds:g} s, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows = [["one process", median(alone), f"{min(alone):.0f}-{max(alone):.0f}", "", ""]]
    for a in args.actors:
        ratio = median(ours[a]) / median(ceil[a])
        rows.append([f"{a} actor(s)", median(ours[a]), f"{min(ours[a]):.0f}-{max(ours[a]):.0f}",
                     median(ceil[a]), ratio])
    print_table(["run", "env_steps_per_s", "range", "ceiling", "vs_ceiling"], rows)
    try:
        import torchrl  # noqa: F401
        print("torchrl is installed but not compared here yet")
    except ImportError:
        print("vs_torchrl: not measured (torchrl is not installed)")
    emit("actors", "one_process", 1.0, "reference", env_steps_per_s=round(median(alone)))
    for a in args.actors:
        emit("actors", f"actors_{a}", median(ours[a]) / median(ceil[a]), ">= 0.9 vs ceiling",
             env_steps_per_s=round(median(ours[a])), ceiling=round(median(ceil[a])),
             vs_one_process=round(median(ours[a]) / median(alone), 3))


if __name__ == "__main__":
    main()
