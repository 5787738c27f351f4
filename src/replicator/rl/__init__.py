"""Reinforcement learning as TF-Replicator ran it: many actors feeding a replicated learner.

Actors are processes of their own (``replicator run --nproc L --num-actors A``) that step
Gymnasium environments with the newest weights they hold; experience goes to a replay buffer
sharded over the learner replicas (:class:`ReplayBuffer`, D4PG) or a queue of fixed-length
trajectories (:class:`TrajectoryQueue`, IMPALA); the learner is any synchronous strategy whose
input is that replay. :class:`ActorLearner` ties them together (its ``run_actor()``, or a loop
of the script's own with ``latest_weights()`` and ``send()``; ``rp.rl.publish_weights(model)``
and ``rp.rl.latest_weights()`` call those of the process's open ActorLearner).
"""

from replicator.rl.actor import EnvironmentStepError
from replicator.rl.actor_learner import (
    LOCKSTEP,
    ActorLearner,
    actor_index,
    current,
    is_actor,
    latest_weights,
    num_actors,
    publish_weights,
)
from replicator.rl.n_step import NStepAccumulator
from replicator.rl.rate_limiter import RateLimiterTimeoutError, SampleToInsertRatio
from replicator.rl.replay import ReplayBuffer
from replicator.rl.trajectory_queue import TrajectoryQueue
from replicator.rl.vtrace import vtrace

__all__ = ["ActorLearner", "LOCKSTEP", "is_actor", "actor_index", "num_actors", "current",
           "publish_weights", "latest_weights",
           "ReplayBuffer", "TrajectoryQueue", "SampleToInsertRatio", "NStepAccumulator",
           "RateLimiterTimeoutError", "EnvironmentStepError", "vtrace"]
