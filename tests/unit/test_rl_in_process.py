"""``ActorLearner(..., in_process=True)``: the learner steps the environments itself, with the
weights it published, as much as the replay needs for each batch (the one-process baseline of
the rl benchmarks); what it cannot do is refused with a clear message."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.errors import ClusterConfigError
from tests.distributed.rl_jobs import Policy  # CartPole's linear softmax policy

pytest.importorskip("gymnasium")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in ("REPLICATOR_NUM_ACTORS", "REPLICATOR_ACTOR_INDEX"):
        monkeypatch.delenv(name, raising=False)


def _learner(replay, **kwargs) -> rp.rl.ActorLearner:
    return rp.rl.ActorLearner(rp.OneDeviceStrategy("cpu"), "CartPole-v1", Policy,
                              replay=replay, num_envs=4, in_process=True, **kwargs)


def test_unrolls_are_made_with_the_published_weights():
    torch.manual_seed(0)
    model = Policy()
    al = _learner(rp.rl.TrajectoryQueue(8, capacity=16), publish_every=1)
    with al:
        batches = al.batches(4, 6, policy=model)
        first = next(batches)
        assert first["obs"].shape == (4, 9, 4) and first["action"].shape == (4, 8)
        with torch.no_grad():  # the behaviour's log-probabilities are the model's own
            logp = torch.log_softmax(model.linear(first["obs"][:, :-1]), -1)
        taken = logp.gather(-1, first["action"].long()[..., None])[..., 0]
        torch.testing.assert_close(first["behaviour_logp"], taken)
        with torch.no_grad():  # a policy that always pushes left, published at the next step
            model.linear.weight.zero_()
            model.linear.bias.copy_(torch.tensor([50.0, -50.0]))
        later = [next(batches) for _ in range(5)]
        stats = al.stats()
    assert all((b["action"] == 0).all() for b in later[1:])  # later[0] may be queued already
    assert stats["learner_steps"] == 5 and stats["max_policy_lag"] <= 1
    assert stats["env_steps"] == stats["inserted"] * 8  # 4 envs x 8 steps make 4 unrolls
    assert stats["episodes"] == len(al.episodes()) > 2
    assert al.episodes(2) == al.episodes()[2:]  # a loop checking every step reads the new ones


def test_the_rate_limiter_sets_how_many_steps_a_batch_costs():
    torch.manual_seed(0)
    replay = rp.rl.ReplayBuffer(10_000, n_step=3, samples_per_insert=8.0,
                                min_size_to_sample=200, error_buffer=64)
    al = _learner(replay, publish_every=5, act_fn=lambda p, obs: p(obs)[0])
    with al:
        for batch in al.batches(32, 20, policy=Policy()):
            assert batch["obs"].shape == (32, 4)
        stats = al.stats()
    assert stats["sampled"] == 20 * 32 and stats["inserted"] >= 200
    # no more inserts than the ratio needs: 20 batches of 32 at 8 samples per insert, past
    # the minimum size, within one vector step of 4 envs and the limiter's window
    assert stats["inserted"] * 8.0 - stats["sampled"] <= 200 * 8.0 + 64 + 4 * 8.0
    assert stats["max_policy_lag"] <= 4


def test_what_in_process_cannot_do_is_refused(monkeypatch):
    with pytest.raises(RuntimeError, match="none were published"):
        with _learner(rp.rl.TrajectoryQueue(8)) as al:
            next(al.batches(2, 1))
    with pytest.raises(ClusterConfigError, match="inside batches"):
        with _learner(rp.rl.TrajectoryQueue(8)) as al:
            al.input_fn(8)
    with pytest.raises(ValueError, match="capacity 4"):
        with _learner(rp.rl.TrajectoryQueue(8, capacity=4)) as al:
            next(al.batches(8, 1, policy=Policy()))
    monkeypatch.setenv("REPLICATOR_NUM_ACTORS", "2")
    with pytest.raises(ClusterConfigError, match="has 2 actor"):
        _learner(rp.rl.TrajectoryQueue(8))
