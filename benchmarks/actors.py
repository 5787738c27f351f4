"""Actor throughput: environment steps per second with 1, 2 and 4 actors feeding one learner.

    python benchmarks/actors.py [--rounds 3] [--seconds 5] [--env CartPole-v1]

Beside each figure: the same stepping code in one process (no actors: an actor's ``Stepper``
and ``ExperienceBuilder``, each batch dropped where an actor sends it), the no-communication
ceiling (A processes stepping that code at the same time, sending nothing), so that
``vs_ceiling`` is what the actor transport costs, and the bare loop (environments and policy
only, no experience built) for reference, and TorchRL's multi-process collector
(``MultiAsyncCollector``, A worker processes, ``benchmarks/_torchrl_peer.py``) on the same
environments (``NUM_ENVS`` CartPole copies per process) with the same policy network, handing
over ``SEND_EVERY`` frames per batch as an actor ships ``SEND_EVERY`` env steps per batch:
``vs_torchrl`` = ours / TorchRL's (goal >= 1.0). The learner here trains nothing: it publishes
weights once and counts the env steps it receives; TorchRL's main process counts the frames it
receives. Both count over ``--seconds``, from one second after the first experience arrived
(start-up excluded alike). Rounds are interleaved (ceiling, ours, TorchRL for each A); medians
and ranges are printed, then one JSON line per figure. Without TorchRL (``pip install -e
'.[rl,bench]'``) ``vs_torchrl`` is skipped and the install is named. On a loaded 2-core machine
``--rounds 1 --seconds 3`` keeps a run near 3.5 minutes; docs/reinforcement_learning.md has the
figures.
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
from benchmarks import _torchrl_peer  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402

NUM_ENVS = 8
SEND_EVERY = 256  # env steps per batch an actor ships (TorchRL: frames_per_batch per worker)
#: Seconds of stepping before counting, in every variant alike (the learner skips the actors'
#: first second; the ceiling's spawned processes counted theirs, and one run read them 13%
#: below the same code in this process).
WARMUP_S = 1.0


def _policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def _act(policy: torch.nn.Module, obs: torch.Tensor) -> torch.Tensor:
    return policy(obs).argmax(-1)


def step_alone(env_id: str, seconds: float, out: mp.Queue | None = None,
               bare: bool = False) -> float:
    """Env steps per second of one process running an actor's stepping code (its ``Stepper``
    and ``ExperienceBuilder``; each batch of ``SEND_EVERY`` steps taken and dropped where an
    actor queues it for sending); ``bare``: only the environments and the policy. Counted
    after :data:`WARMUP_S` of stepping, as the learner counts the actors' steps."""
    import numpy as np

    from replicator.rl.actor import ActorConfig, Stepper
    from replicator.rl.environments import make_vector_env
    from replicator.rl.experience import ExperienceBuilder

    torch.set_num_threads(1)
    steps = 0
    if bare:
        envs = make_vector_env(env_id, NUM_ENVS)
        policy = _policy()
        obs, _ = envs.reset(seed=0)
        start = time.perf_counter() + WARMUP_S
        while time.perf_counter() - start < seconds:
            with torch.no_grad():
                action = _act(policy, torch.as_tensor(np.asarray(obs), dtype=torch.float32))
            obs, *_ = envs.step(action.numpy())
            steps += NUM_ENVS if time.perf_counter() > start else 0
    else:
        cfg = ActorConfig(index=0, num_learners=1, num_envs=NUM_ENVS, seed=0,
                          kind="transitions", send_every=SEND_EVERY)
        stepper = Stepper(cfg, env_id, _policy, _act)
        builder = ExperienceBuilder(cfg.kind, cfg.n_step, cfg.discount, cfg.unroll_length)
        stepper.reset(0)
        start = time.perf_counter() + WARMUP_S
        while time.perf_counter() - start < seconds:
            stepper.step(builder, 0)
            if builder.count >= cfg.send_every:
                builder.take()
            steps += NUM_ENVS if time.perf_counter() > start else 0
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
                            act_fn=_act, num_envs=NUM_ENVS, send_every=SEND_EVERY)
    if al.is_actor:
        al.run_actor()
        return 0.0
    with al:
        al.publish_weights(_policy())
        deadline = time.monotonic() + 120
        while al.stats()["env_steps"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(WARMUP_S)  # every actor stepping
        first, t0 = al.stats()["env_steps"], time.perf_counter()
        time.sleep(seconds)
        last, t1 = al.stats()["env_steps"], time.perf_counter()
    return (last - first) / (t1 - t0)


def torchrl_peer(env_id: str, actors: int, seconds: float) -> float:
    """TorchRL's multi-process collector with ``actors`` workers on the same env and policy."""
    return _torchrl_peer.env_steps_per_s(env_id, actors, NUM_ENVS, SEND_EVERY, _policy,
                                         seconds)


def _range(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    with_peer = _torchrl_peer.available()
    alone: list[float] = []
    bare: list[float] = []
    ours: dict[int, list[float]] = {a: [] for a in args.actors}
    ceil: dict[int, list[float]] = {a: [] for a in args.actors}
    peer: dict[int, list[float]] = {a: [] for a in args.actors}
    for _ in range(args.rounds):
        alone.append(step_alone(args.env, args.seconds))
        bare.append(step_alone(args.env, args.seconds, bare=True))
        for a in args.actors:
            ceil[a].append(ceiling(args.env, a, args.seconds))
            ours[a].append(rp.launch(learner, num_replicas=1, num_actors=a,
                                     args=(args.env, args.seconds))[0])
            if with_peer:
                peer[a].append(torchrl_peer(args.env, a, args.seconds))
    print(f"env {args.env}, {NUM_ENVS} envs per actor, {SEND_EVERY} steps per batch, "
          f"{args.rounds} rounds of {args.seconds:g} s, load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    rows = [["one process", median(alone), _range(alone), "", "", "", ""],
            ["bare env + policy loop", median(bare), _range(bare), "", "", "", ""]]
    for a in args.actors:
        rows.append([f"{a} actor(s)", median(ours[a]), _range(ours[a]), median(ceil[a]),
                     median(ours[a]) / median(ceil[a]),
                     median(peer[a]) if with_peer else "-",
                     median(ours[a]) / median(peer[a]) if with_peer else "-"])
    print_table(["run", "env_steps_per_s", "range", "ceiling", "vs_ceiling", "torchrl",
                 "vs_torchrl"], rows)
    emit("actors", "one_process", 1.0, "reference", env_steps_per_s=round(median(alone)),
         bare_loop_env_steps_per_s=round(median(bare)))
    for a in args.actors:
        emit("actors", f"actors_{a}", median(ours[a]) / median(ceil[a]), ">= 0.9 vs ceiling",
             env_steps_per_s=round(median(ours[a])), ceiling=round(median(ceil[a])),
             vs_one_process=round(median(ours[a]) / median(alone), 3))
    if not with_peer:
        print(f"vs_torchrl: not measured (torchrl is not installed). HINT: "
              f"{_torchrl_peer.INSTALL_HINT}")
        return
    top = max(args.actors)
    print(f"torchrl {_torchrl_peer.version()}: MultiAsyncCollector, {top} workers, range "
          f"{_range(peer[top])}")
    emit("actors", "vs_torchrl", median(ours[top]) / median(peer[top]), ">= 1.0",
         actors=top, env_steps_per_s=round(median(ours[top])),
         torchrl_env_steps_per_s=round(median(peer[top])),
         by_actors={a: round(median(ours[a]) / median(peer[a]), 3) for a in args.actors})

if __name__ == "__main__":
    main()
