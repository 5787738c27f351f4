"""A hand-written actor loop (``latest_weights()`` / ``send()``) beside a training learner, with
real processes: the learner's replay holds the actor's CartPole transitions, each made with the
weights of the version it carries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from tests.helpers import launch

pytest.importorskip("gymnasium")
pytestmark = pytest.mark.timeout(300)

PUBLISH_EVERY = 2
#: The learner trains until its samples hold experience made with at least this version.
TARGET_VERSION = 6


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs)


def _checksum(state: dict[str, torch.Tensor]) -> float:
    return sum(float(t.double().sum()) for t in state.values())


def _actor_loop(al: rp.rl.ActorLearner) -> None:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    policy = Linear()
    obs, _ = env.reset(seed=rp.rl.actor_index())
    version, checksum = -1, 0.0
    while not al.learners_done:
        got = rp.rl.latest_weights()  # the module-level call: this process's ActorLearner
        if got is not None:
            if got[0] <= version:
                raise RuntimeError(f"weights version went from {version} to {got[0]}")
            version, state = got
            policy.load_state_dict(state)
            checksum = _checksum(state)
        if version < 0:
            break  # the learners ended before publishing anything
        with torch.no_grad():
            logits = policy(torch.as_tensor(obs, dtype=torch.float32))
        action = int(torch.distributions.Categorical(logits=logits).sample())
        next_obs, reward, term, trunc, _ = env.step(action)
        final = next_obs
        if term or trunc:
            next_obs, _ = env.reset()
        extras = {"made_with": torch.tensor(version),
                  "checksum": torch.tensor(checksum, dtype=torch.float64)}
        if not al.send(obs, action, reward, next_obs, term, trunc, final_obs=final,
                       extras=extras):
            break
        obs = next_obs
    env.close()
    al.close()


def hand_written_job(max_steps: int):
    replay = rp.rl.ReplayBuffer(2000, samples_per_insert=2.0, min_size_to_sample=16,
                                error_buffer=32, seed=1, timeout_seconds=60)
    torch.manual_seed(0)
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", Linear, replay=replay,
                            publish_every=PUBLISH_EVERY, send_every=8, timeout_seconds=60)
    if al.is_actor:
        _actor_loop(al)
        return None
    refused = ""
    try:
        al.latest_weights()
    except RuntimeError as exc:
        refused = str(exc)
    policy = Linear()
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    published: dict[int, float] = {}
    seen: set[int] = set()
    mismatched = 0
    with al:
        for batch in al.batches(16, max_steps, policy=policy):
            if al.step % PUBLISH_EVERY == 0:  # batches() published these weights just now
                published[al.step] = _checksum(policy.state_dict())
            for v, c in zip(batch["made_with"].tolist(), batch["checksum"].tolist()):
                seen.add(v)
                mismatched += v not in published or published[v] != c
            loss = F.cross_entropy(policy(batch["obs"]), batch["action"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if max(seen) >= TARGET_VERSION:
                break
        stats = al.stats()
    return {"seen": sorted(seen), "mismatched": mismatched, "stats": stats,
            "refused": refused, "steps": al.step}


def test_hand_written_actor_loop_feeds_the_learner_with_versioned_experience():
    out = launch(hand_written_job, 1, args=(2000,), num_actors=1, timeout_seconds=120)[0]
    seen, stats = out["seen"], out["stats"]
    # the actor picked up newer weights while the learner trained, version by version
    assert max(seen) >= TARGET_VERSION and 0 in seen, seen
    assert all(v % PUBLISH_EVERY == 0 for v in seen), seen
    # every sampled transition was made with exactly the weights of the version it carries
    assert out["mismatched"] == 0
    # the learner's policy-lag accounting read the versions the loop sent
    assert stats["joins"][0]["first_version"] == 0, stats["joins"]
    assert stats["env_steps"] >= stats["items"] > 0
    assert 0 <= stats["max_policy_lag"] <= out["steps"]
    assert "actor processes" in out["refused"] and "learner replica 0" in out["refused"]
