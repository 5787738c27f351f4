"""D4PG's shape on Pendulum-v1: actors feed an n-step replay, a replicated learner samples it.

    replicator run --nproc 1 --num-actors 2 examples/rl_d4pg.py     # 1 learner, 2 actors
    python examples/rl_d4pg.py                                      # the same, self-launched
    python examples/rl_d4pg.py --in-process                         # no actors: the baseline

Actors step vectorised Pendulum environments with the newest deterministic policy they hold
plus Gaussian exploration noise; transitions are 3-step returns. The learner is a synchronous
strategy (``--nproc 2`` gives two replicas, each sampling its own replay shard) training a
deterministic actor-critic (D4PG without its distributional critic: the critic is a plain
expected-value Q) with target networks. It stops at the reference (mean return of the last
100 episodes >= -200) or after ``--seconds``, and plots return against env steps and time.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from rl_plot import train_to_reference

import replicator as rp

REFERENCE = -200.0
MAX_ACTION = 2.0


class Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 1), nn.Tanh())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return MAX_ACTION * self.net(obs)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 1))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, action / MAX_ACTION], -1)).squeeze(-1)


def explore(policy: nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """The actors' behaviour: the policy plus Gaussian noise, clipped to the action range."""
    action = policy(obs)
    return (action + 0.3 * torch.randn_like(action)).clamp(-MAX_ACTION, MAX_ACTION)


def main(seconds: float = 280.0, batch_size: int = 128, plot: str = "rl_d4pg.png",
         steps: int = 10**9, in_process: bool = False) -> dict:
    replay = rp.rl.ReplayBuffer(100_000, n_step=3, discount=0.99, samples_per_insert=32.0,
                                min_size_to_sample=1000, error_buffer=32 * 1000, seed=0)
    al = rp.rl.ActorLearner(rp.MirroredStrategy, "Pendulum-v1", Actor, replay=replay,
                            act_fn=explore, num_envs=4, publish_every=20, send_every=16,
                            in_process=in_process)
    if al.is_actor:
        al.run_actor()
        return {}
    torch.manual_seed(0)
    with al.strategy.scope():
        actor, critic = Actor(), Critic()
        actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
        critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    actor_target, critic_target = copy.deepcopy(actor), copy.deepcopy(critic)

    def step_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            target = batch["reward"] + batch["discount"] * critic_target(
                batch["next_obs"], actor_target(batch["next_obs"]))
        critic_loss = F.mse_loss(critic(batch["obs"], batch["action"]), target)
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        actor_loss = -critic(batch["obs"], actor(batch["obs"])).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()
        with torch.no_grad():
            for net, tgt in ((actor, actor_target), (critic, critic_target)):
                for p, q in zip(net.parameters(), tgt.parameters()):
                    q.lerp_(p, 0.005)
        return critic_loss.detach()

    return train_to_reference(al, step_fn, al.batches(batch_size, steps, policy=actor),
                              reference=REFERENCE, seconds=seconds, plot=plot,
                              title="D4PG shape on Pendulum-v1")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=280.0)
    parser.add_argument("--plot", default="rl_d4pg.png")
    parser.add_argument("--steps", type=int, default=10**9, help="learner steps at most")
    parser.add_argument("--in-process", action="store_true",
                        help="no actor processes: step the environments in the learner (the "
                             "one-process baseline)")
    args = parser.parse_args()
    if args.in_process:
        main(args.seconds, plot=args.plot, steps=args.steps, in_process=True)
    elif rp.rl.num_actors() == 0 and not rp.rl.is_actor():  # plain python: launch ourselves
        rp.launch(main, num_replicas=1, num_actors=2,
                  kwargs={"seconds": args.seconds, "plot": args.plot, "steps": args.steps})
    else:
        main(args.seconds, plot=args.plot, steps=args.steps)
