"""Bad input to the actor-learner API is refused with a clear message."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.launch.launcher import check_num_actors

pytest.importorskip("gymnasium")
pytestmark = pytest.mark.timeout(60)


def _policy() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def test_an_rl_script_without_actors_is_refused(monkeypatch):
    monkeypatch.delenv("REPLICATOR_NUM_ACTORS", raising=False)
    monkeypatch.delenv("REPLICATOR_ACTOR_INDEX", raising=False)
    with pytest.raises(ClusterConfigError, match="--num-actors"):
        rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPole-v1", _policy,
                           replay=rp.rl.ReplayBuffer(10))


def test_an_unknown_environment_id_is_refused():
    with pytest.raises(ClusterConfigError, match="unknown environment id 'CartPol-v1'"):
        rp.rl.ActorLearner(rp.OneDeviceStrategy, "CartPol-v1", _policy,
                           replay=rp.rl.ReplayBuffer(10))


def test_bad_numbers_of_actors_are_refused():
    with pytest.raises(ClusterConfigError, match="integer >= 0"):
        check_num_actors(-1)
    with pytest.raises(ClusterConfigError, match="--num-ps"):
        check_num_actors(2, num_ps=1)
    assert check_num_actors(0) == 0


def test_the_cli_refuses_negative_actors(capsys):
    from replicator.cli import main

    assert main(["run", "--nproc", "1", "--num-actors", "-1", __file__]) != 0
    assert "num_actors" in capsys.readouterr().err


def test_is_actor_reads_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("REPLICATOR_ACTOR_INDEX", "3")
    monkeypatch.setenv("REPLICATOR_NUM_ACTORS", "4")
    assert rp.rl.is_actor() and rp.rl.actor_index() == 3 and rp.rl.num_actors() == 4
    al = rp.rl.ActorLearner(lambda: pytest.fail("an actor builds no strategy"), "CartPole-v1",
                            _policy, replay=rp.rl.ReplayBuffer(10))
    assert al.is_actor and al.strategy is None


def test_an_actor_gets_no_learner_rendezvous_variables():
    from replicator.launch.launcher import actor_env

    learner = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
               "LOCAL_RANK": "0", "GROUP_RANK": "0", "PATH": "/bin"}
    env = actor_env(learner, index=1, world=2, num_actors=3, store="127.0.0.1:1234", restarts=2)
    assert not {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"} & set(env)
    assert env["RANK"] == "3" and env["REPLICATOR_ACTOR_INDEX"] == "1"
    assert env["REPLICATOR_NUM_LEARNERS"] == "2" and env["REPLICATOR_REJOIN"] == "2"
    assert env["REPLICATOR_RL_STORE"] == "127.0.0.1:1234" and env["PATH"] == "/bin"
