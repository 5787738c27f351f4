"""Small actor-learner jobs the rl tests launch (module level, so spawned workers import them)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

import replicator as rp


class Policy(torch.nn.Module):
    """A linear softmax policy for CartPole: action and its log-probability."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(obs)
        action = torch.distributions.Categorical(logits=logits).sample()
        return action, torch.log_softmax(logits, -1).gather(-1, action[:, None])[:, 0]


def _al(replay, lockstep=False, env="CartPole-v1", publish_every=2, seed=0):
    torch.manual_seed(seed)
    return rp.rl.ActorLearner(rp.OneDeviceStrategy, env, Policy, replay=replay,
                              num_envs=2, publish_every=publish_every, seed=seed,
                              lockstep=lockstep, round_steps=4, send_every=8,
                              timeout_seconds=60)


def train(steps: int, lockstep: bool = False, ckpt: str | None = None, kill_at: int = -1,
          save_every: int = 5, sleep: float = 0.0, env: str = "CartPole-v1"):
    """A policy-gradient-free regression step on replayed transitions: enough to move the
    weights deterministically. Returns the final weights, the step trace and the stats."""
    replay = rp.rl.ReplayBuffer(1000, n_step=2, samples_per_insert=None if lockstep else 2.0,
                                min_size_to_sample=16, error_buffer=64, seed=3,
                                timeout_seconds=60)
    al = _al(replay, lockstep=lockstep, env=env)
    if al.is_actor:
        al.run_actor()
        return None
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        policy.load_state_dict(state["policy"])
        opt.load_state_dict(state["opt"])
        al.load_state_dict(state["al"])
    trace = []
    with al:
        for batch in al.batches(16, steps - al.step, policy=policy):
            logits = policy.linear(batch["obs"])
            loss = F.cross_entropy(logits, batch["action"].long()) - 0.01 * batch["reward"].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            trace.append(al.step)
            if ckpt and (al.step + 1) % save_every == 0:
                torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(),
                            "al": {**al.state_dict(), "step": al.step + 1}}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            if al.step == kill_at and int(os.environ.get("REPLICATOR_RESTART_COUNT", "0")) == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if sleep:
                time.sleep(sleep)
        stats = al.stats()
    return {"weights": {k: v.clone() for k, v in policy.state_dict().items()},
            "trace": trace, "stats": stats}


class _Raising:
    """CartPole that raises at its 5th step (an environment bug inside an actor)."""

    def __new__(cls):  # noqa: D102 - a gymnasium wrapper made on demand
        import gymnasium as gym

        class Raising(gym.Wrapper):
            count = 0

            def step(self, action):
                Raising.count += 1
                if Raising.count == 5:
                    raise ValueError("the physics diverged")
                return self.env.step(action)

        return Raising(gym.make("CartPole-v1"))


def raising_env():
    return _Raising()


def mixed_env():
    """Actor 0 runs CartPole (4 observations), the others Acrobot (6): refused."""
    import gymnasium as gym

    return gym.make("CartPole-v1" if rp.rl.actor_index() == 0 else "Acrobot-v1")


def train_env_fn(env_fn, steps: int = 20):
    replay = rp.rl.ReplayBuffer(1000, min_size_to_sample=8, timeout_seconds=30)
    al = _al(replay, env=env_fn)
    if al.is_actor:
        al.run_actor()
        return None
    policy = Policy()
    with al:
        for _ in al.batches(8, steps, policy=policy):
            time.sleep(0.2)
    return al.stats()


def _suicidal_act(policy, obs):
    """The actor's act_fn: the first incarnation of actor 0 SIGKILLs itself after 30 steps."""
    _suicidal_act.calls = getattr(_suicidal_act, "calls", 0) + 1
    if _suicidal_act.calls == 30 and os.environ.get("REPLICATOR_REJOIN") == "0" \
            and rp.rl.actor_index() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return policy(obs)


def train_with_actor_killed(steps: int):
    replay = rp.rl.ReplayBuffer(2000, samples_per_insert=1.0, min_size_to_sample=16,
                                error_buffer=16, seed=1, timeout_seconds=60)
    torch.manual_seed(0)
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", Policy, replay=replay,
                            act_fn=_suicidal_act, num_envs=2, publish_every=2, send_every=8,
                            timeout_seconds=60)
    if al.is_actor:
        al.run_actor()
        return None
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    trace = []
    with al:
        for batch in al.batches(16, steps, policy=policy):
            loss = F.cross_entropy(policy.linear(batch["obs"]), batch["action"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            trace.append(al.step)
            # on until the restarted actor's first experience arrived (-2: none yet), which a
            # busy machine can delay past any fixed step
            rejoined = [j for j in al.stats()["joins"] if j["restart"] == 1]
            if al.step > 60 and rejoined and rejoined[0]["first_version"] != -2:
                break
        stats = al.stats()
    return {"trace": trace, "stats": stats}
