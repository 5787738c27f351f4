"""Actors beside a learner: restarts, exact lockstep resume and refusals, with real processes."""

from __future__ import annotations

import pytest
import torch

from replicator.errors import WorkerFailedError
from tests.distributed import rl_jobs
from tests.helpers import launch

pytest.importorskip("gymnasium")
pytestmark = pytest.mark.timeout(300)


def test_actor_killed_is_restarted_with_current_weights_and_learner_goes_on():
    out = launch(rl_jobs.train_with_actor_killed, 1, args=(200,), num_actors=2,
                 max_restarts=1, timeout_seconds=60)[0]
    trace = out["trace"]
    assert trace == list(range(len(trace)))  # the learner's step never goes back
    joins = out["stats"]["joins"]
    rejoined = [j for j in joins if j["actor"] == 0 and j["restart"] == 1]
    assert rejoined, joins
    # the restarted actor's first experience carries the weights current when it joined
    assert rejoined[0]["published"] > 0
    assert rejoined[0]["first_version"] >= rejoined[0]["published"]
    # the rate limiter held samples per insert at 1.0 through the kill
    stats = out["stats"]
    assert abs(stats["sampled"] / stats["inserted"] - 1.0) < 0.05, stats


def test_policy_lag_stays_bounded_while_the_rate_limiter_holds_the_actor_back():
    # the learner samples slowly and its rate limiter holds inserts back, so the actor is
    # far faster than the learner takes its experience: batches it sent regardless would
    # queue up in the sockets' buffers (thousands of these small ones), each made with
    # weights the learner has long replaced, and the lag would grow with the run
    out = launch(rl_jobs.train, 1, args=(40,), kwargs={"sleep": 0.05}, num_actors=1,
                 timeout_seconds=60)[0]
    stats = out["stats"]
    assert stats["max_policy_lag"] <= 12, stats  # publish_every=2, a few batches held


def test_lockstep_resume_after_learner_killed_equals_uninterrupted(tmp_path):
    whole = launch(rl_jobs.train, 1, args=(42, True), num_actors=1, timeout_seconds=60)[0]
    again = launch(rl_jobs.train, 1, args=(42, True), num_actors=1, timeout_seconds=60)[0]
    for k in whole["weights"]:
        assert torch.equal(whole["weights"][k], again["weights"][k])
    ckpt = str(tmp_path / "learner.pt")
    resumed = launch(rl_jobs.train, 1, args=(42, True, ckpt, 37), num_actors=1,
                     max_restarts=1, timeout_seconds=60)[0]
    assert resumed["trace"][0] == 35  # resumed from the backup of step 35, not from 0
    for k in whole["weights"]:
        assert torch.equal(whole["weights"][k], resumed["weights"][k]), k


def test_environment_that_raises_names_the_actor_and_the_step():
    with pytest.raises(WorkerFailedError) as info:
        launch(rl_jobs.train_env_fn, 1, args=(rl_jobs.raising_env,), num_actors=1,
               timeout_seconds=60)
    text = str(info.value) + getattr(info.value, "traceback_text", "")
    assert "actor 0" in text and "env step" in text and "physics diverged" in text


def test_actors_with_different_observation_shapes_are_refused():
    with pytest.raises(WorkerFailedError) as info:
        launch(rl_jobs.train_env_fn, 1, args=(rl_jobs.mixed_env,), num_actors=2,
               timeout_seconds=60)
    text = str(info.value) + getattr(info.value, "traceback_text", "")
    assert "observations of shape" in text and "actor 1" in text
