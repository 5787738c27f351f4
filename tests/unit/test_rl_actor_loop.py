"""A loop of the script's own on an actor: ``latest_weights()`` and ``send()`` against a real
learner-side server (its threads and sockets) in this process."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.rl.learner_server import ExperienceServer
from replicator.rl.transport import rl_store

gym = pytest.importorskip("gymnasium")
pytestmark = pytest.mark.timeout(60)


def _policy() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


@pytest.fixture
def actor_env(monkeypatch):
    """This process as actor 0 of a job with one learner, and a store to find the learner."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    monkeypatch.setenv("REPLICATOR_RL_STORE", f"127.0.0.1:{master.port}")
    monkeypatch.setenv("REPLICATOR_RESTART_COUNT", "0")
    monkeypatch.setenv("REPLICATOR_ACTOR_INDEX", "0")
    monkeypatch.setenv("REPLICATOR_NUM_ACTORS", "1")
    monkeypatch.setenv("REPLICATOR_NUM_LEARNERS", "1")
    monkeypatch.delenv("REPLICATOR_REJOIN", raising=False)
    yield master


def _newer(al: rp.rl.ActorLearner, deadline_s: float = 20.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = al.latest_weights()
        if got is not None or al.learners_done:
            return got
        time.sleep(0.02)
    raise AssertionError("no newer weights came")


def test_latest_weights_by_version_and_experience_carries_it(actor_env):
    replay = rp.rl.ReplayBuffer(100)
    server = ExperienceServer(replay, 0, 1, lockstep=False, publish_every=2,
                              timeout_seconds=20)
    server.start(rl_store(20))
    learner_policy = _policy()
    server.publish(0, list(learner_policy.state_dict().values()))
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", _policy,
                            replay=rp.rl.ReplayBuffer(100), send_every=4, timeout_seconds=20)
    assert al.is_actor
    version, state = al.latest_weights()  # the first call waits for the first weights
    assert version == 0 and list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], learner_policy.weight.detach())
    time.sleep(0.1)  # past the poll interval: the learner is asked, and sends nothing again
    assert al.latest_weights() is None  # nothing newer than version 0

    with torch.no_grad():
        learner_policy.weight.add_(1.0)
    server.publish(4, list(learner_policy.state_dict().values()))
    version, state = _newer(al)
    assert version == 4 and torch.equal(state["weight"], learner_policy.weight.detach())

    server.step = 10  # the learner moved on: experience made with version 4 lags 6 steps
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    for _ in range(4):
        action = 0
        next_obs, reward, term, trunc, _ = env.step(action)
        assert al.send(obs, action, reward, next_obs, term, trunc)
        obs = next_obs
    deadline = time.monotonic() + 20
    while len(replay) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(replay) == 4
    stats = server.stats()
    assert stats["max_policy_lag"] == 6 and stats["env_steps"] == 4
    assert stats["joins"][0]["first_version"] == 4
    batch = replay.sample(4)
    assert batch["obs"].shape == (4, 4) and set(batch["action"].tolist()) == {0}

    server.close()  # the learner ends: the loop is told so
    assert _newer(al) is None and al.learners_done
    assert al.send(obs, 0, 1.0, obs, False, False) is False
    al.close()
    replay.close()


def test_experience_before_any_weights_is_refused(actor_env):
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", _policy,
                            replay=rp.rl.ReplayBuffer(100))
    obs = [0.0] * 4
    with pytest.raises(ClusterConfigError, match="latest_weights"):
        al.send(obs, 0, 1.0, obs, False, False)


def test_latest_weights_on_a_learner_is_refused(monkeypatch):
    monkeypatch.setenv("REPLICATOR_NUM_ACTORS", "1")
    monkeypatch.delenv("REPLICATOR_ACTOR_INDEX", raising=False)
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", _policy,
                            replay=rp.rl.ReplayBuffer(100))
    assert not al.is_actor
    with pytest.raises(RuntimeError, match="actor processes.*learner replica 0.*publish_weights"):
        al.latest_weights()
    with pytest.raises(RuntimeError, match="actor processes"):
        al.send([0.0] * 4, 0, 1.0, [0.0] * 4, False, False)


def test_the_module_level_calls_use_the_open_actor_learner_and_say_when_there_is_none(
        monkeypatch):
    monkeypatch.setenv("REPLICATOR_NUM_ACTORS", "1")
    monkeypatch.delenv("REPLICATOR_ACTOR_INDEX", raising=False)
    al = rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", _policy,
                            replay=rp.rl.ReplayBuffer(100))
    assert rp.rl.current() is al
    with pytest.raises(RuntimeError, match="actor processes"):  # al's own refusal
        rp.rl.latest_weights()
    al.close()
    with pytest.raises(RuntimeError, match="no rp.rl.ActorLearner is open.*HINT"):
        rp.rl.publish_weights(_policy())
    with pytest.raises(RuntimeError, match="no rp.rl.ActorLearner is open"):
        rp.rl.latest_weights()
