"""``rp.rl.ActorLearner``: actors feeding a replicated learner, in one script for every role.

Every process runs the same script. On an actor (``rp.rl.is_actor()``) ``run_actor()`` steps
environments until the learners end, or a loop of the script's own takes weights with
``latest_weights()`` and sends experience with ``send()``. On a learner replica the strategy
is built (pass the class, e.g. ``rp.MirroredStrategy``, so actors never build one), the
replay becomes this replica's shard, and ``batches()`` is the replay read as the per-replica
``input_fn`` of a synchronous strategy; weights go to the actors every ``publish_every`` steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replicator.cluster.env_names import (
    ACTOR_INDEX_ENV,
    NUM_ACTORS_ENV,
    NUM_LEARNERS_ENV,
    REJOIN_ENV,
)
from replicator.cluster.timeouts import resolve_timeout
from replicator.data import InputContext
from replicator.errors import ClusterConfigError
from replicator.rl.actor import ActorConfig, run_actor
from replicator.rl.actor_loop import ActorSession
from replicator.rl.environments import check_env
from replicator.rl.in_process import InProcessActor
from replicator.rl.learner_server import ExperienceServer
from replicator.rl.replay import ReplayBuffer
from replicator.rl.trajectory_queue import TrajectoryQueue
from replicator.rl.transport import rl_store
from replicator.strategies.base import Strategy

__all__ = ["ActorLearner", "LOCKSTEP", "is_actor", "actor_index", "num_actors"]

#: ``ActorLearner(..., lockstep=rp.rl.LOCKSTEP)``: actors step deterministically, for tests.
LOCKSTEP = "lockstep"


def _int_env(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ClusterConfigError(f"{name}={raw!r} is not an integer") from None


def is_actor() -> bool:
    """True in a process the launcher started as an actor (``--num-actors``)."""
    return bool(os.environ.get(ACTOR_INDEX_ENV, "").strip())


def actor_index() -> int:
    """This actor's index, 0..A-1 (-1 on a learner)."""
    return _int_env(ACTOR_INDEX_ENV) if is_actor() else -1


def num_actors() -> int:
    """How many actors the job was launched with (0 without ``--num-actors``)."""
    return _int_env(NUM_ACTORS_ENV)


#: The ActorLearner this process created last (what the module-level calls use).
_current: ActorLearner | None = None


def current() -> ActorLearner:
    """The :class:`ActorLearner` this process created last (until its ``close()``)."""
    if _current is None:
        raise RuntimeError(
            "no rp.rl.ActorLearner is open in this process. HINT: create one first, al = "
            "rp.rl.ActorLearner(strategy, env_fn, policy_fn, replay=...); "
            "rp.rl.publish_weights(model) and rp.rl.latest_weights() call its methods.")
    return _current


def publish_weights(model: torch.nn.Module) -> None:
    """``current().publish_weights(model)``: on a learner, give the actors ``model``'s
    weights."""
    current().publish_weights(model)


def latest_weights() -> tuple[int, dict[str, torch.Tensor]] | None:
    """``current().latest_weights()``: on an actor, ``(version, state_dict)`` newer than the
    last returned, else ``None``."""
    return current().latest_weights()


class ActorLearner:
    """Actors running ``env_fn`` with ``policy_fn()``'s module; a learner reading ``replay``.

    ``replay``: an :class:`~replicator.rl.ReplayBuffer` (actors send ``n_step`` transitions)
    or a :class:`~replicator.rl.TrajectoryQueue` (actors send unrolls of its length).
    ``act_fn(policy, obs) -> action`` or ``(action, extras)`` (default ``policy(obs)``);
    extras travel with the experience (a tensor becomes ``behaviour_logp``). ``num_envs``
    environments per actor; ``publish_every`` learner steps between weight publications;
    ``lockstep=True`` (or :data:`LOCKSTEP`): deterministic rounds of ``round_steps`` steps.
    ``max_policy_lag``: experience made with weights more than that many learner steps old is
    dropped on arrival (counted in ``stats()["stale_dropped"]``); the lag is measured always.
    ``in_process=True``: no actor processes; each learner replica steps ``num_envs``
    environments itself before each batch (``rl/in_process.py``): the one-process baseline.
    """

    def __init__(self, strategy: Strategy | Callable[[], Strategy], env_fn: Any,
                 policy_fn: Callable[[], torch.nn.Module], *,
                 replay: ReplayBuffer | TrajectoryQueue,
                 act_fn: Callable[..., Any] | None = None, num_envs: int = 4,
                 publish_every: int = 10, seed: int = 0, lockstep: bool | str = False,
                 round_steps: int = 8, send_every: int = 64,
                 max_policy_lag: int | None = None,
                 timeout_seconds: float | None = None, in_process: bool = False) -> None:
        check_env(env_fn)
        if not isinstance(replay, (ReplayBuffer, TrajectoryQueue)):
            raise TypeError("replay must be rp.rl.ReplayBuffer(...) or rp.rl.TrajectoryQueue"
                            f"(...), got {type(replay).__name__}")
        for name, value in (("num_envs", num_envs), ("publish_every", publish_every),
                            ("round_steps", round_steps), ("send_every", send_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.env_fn, self.policy_fn, self.act_fn = env_fn, policy_fn, act_fn
        self.replay = replay
        self.num_envs, self.publish_every, self.seed = num_envs, publish_every, int(seed)
        self.lockstep = lockstep in (True, LOCKSTEP)
        self.round_steps = replay.length if isinstance(replay, TrajectoryQueue) else round_steps
        self.send_every = send_every
        self.max_policy_lag = max_policy_lag
        self.timeout_seconds = resolve_timeout(timeout_seconds)
        self.num_actors = num_actors()
        self.step = 0
        self._server: ExperienceServer | InProcessActor | None = None
        self._published: tuple[int, list[torch.Tensor]] | None = None
        self._actor_session: ActorSession | None = None
        self.strategy: Strategy | None = None
        self.rank = -1
        global _current
        _current = self
        if is_actor():
            return
        if in_process:
            self._refuse_in_process_with_actors()
        elif self.num_actors < 1:
            raise ClusterConfigError(
                "rp.rl.ActorLearner needs actor processes, and this job has none "
                "(--num-actors 0 or not given). HINT: replicator run --nproc L --num-actors A "
                "script.py, or rp.launch(main, num_replicas=L, num_actors=A), with A >= 1.")
        self.strategy = strategy if isinstance(strategy, Strategy) else strategy()
        if not isinstance(self.strategy, Strategy):
            raise TypeError("strategy must be an rp strategy or a function returning one, got "
                            f"{type(self.strategy).__name__}")
        self.rank = self.strategy.replica_id
        self.num_learners = self.strategy.num_replicas_in_sync
        if self.lockstep and self.num_actors < self.num_learners:
            raise ClusterConfigError(
                f"lockstep mode gives each learner replica its own actors: {self.num_actors} "
                f"actor(s) for {self.num_learners} learners. HINT: --num-actors "
                f"{self.num_learners} or more.")
        replay.shard(self.rank, self.num_learners)
        replay.lockstep = self.lockstep
        if in_process:
            self._server = InProcessActor(self._config(self.rank, 0), env_fn, policy_fn,
                                          act_fn, replay)

    def _refuse_in_process_with_actors(self) -> None:
        if self.num_actors > 0 or self.lockstep:
            raise ClusterConfigError(
                f"in_process=True steps the environments in the learner, and this job "
                f"{'asks for lockstep' if self.lockstep else f'has {self.num_actors} actor(s)'}"
                ". HINT: drop in_process=True to use actor processes, or launch without "
                "--num-actors (and lockstep) for one process.")

    @property
    def is_actor(self) -> bool:
        return self.strategy is None

    # the actor's side
    def _actor_config(self, what: str) -> ActorConfig:
        if not self.is_actor:
            raise RuntimeError(
                f"{what} is for actor processes, and this is learner replica {self.rank}. "
                "HINT: branch on rp.rl.is_actor() (or ActorLearner.is_actor); a learner gives "
                "weights with publish_weights(model) (or batches(policy=...)) and reads "
                "experience with batches().")
        return self._config(actor_index(), _int_env(REJOIN_ENV))

    def _config(self, index: int, restart: int) -> ActorConfig:
        queue_kind = isinstance(self.replay, TrajectoryQueue)
        return ActorConfig(
            index=index, num_learners=max(1, _int_env(NUM_LEARNERS_ENV)),
            num_envs=self.num_envs, seed=self.seed,
            kind="trajectories" if queue_kind else "transitions",
            n_step=getattr(self.replay, "n_step", 1),
            discount=getattr(self.replay, "discount", 0.99),
            unroll_length=self.replay.length if isinstance(self.replay, TrajectoryQueue) else 0,
            lockstep=self.lockstep, round_steps=self.round_steps, send_every=self.send_every,
            timeout_seconds=self.timeout_seconds, restart=restart)

    def run_actor(self) -> dict[str, int]:
        """Step environments until the learners end (actors only)."""
        return run_actor(self._actor_config("run_actor()"), self.env_fn, self.policy_fn,
                         self.act_fn)

    def _session(self, what: str) -> ActorSession:
        if self._actor_session is None:
            cfg = self._actor_config(what)
            if cfg.lockstep:
                raise ClusterConfigError(
                    f"actor {cfg.index}: lockstep mode runs the library's actor loop. HINT: "
                    "call run_actor(), or drop lockstep= for a loop of your own.")
            self._actor_session = ActorSession(cfg, self.env_fn, self.policy_fn)
        return self._actor_session

    def latest_weights(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """For a loop of your own on an actor: ``(version, state_dict)`` newer than the
        weights it last returned, else ``None`` (also once the learners ended, see
        :attr:`learners_done`). The first call waits for the first publication; later ones
        never wait on the learner's training loop (a learner thread answers)."""
        return self._session("latest_weights()").latest_weights()

    def send(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any,
             truncated: Any, *, version: int | None = None, final_obs: Any = None,
             extras: dict[str, torch.Tensor] | None = None) -> bool:
        """For a loop of your own on an actor: one environment step of experience (unbatched
        for one env, leading dim ``N`` for ``N``). ``next_obs`` is the observation the next
        step starts from (after a reset), ``final_obs`` the one this step ended in when it
        differs. ``version`` defaults to the weights version last returned by
        :meth:`latest_weights`. Shipped every ``send_every`` items; False once the learners
        ended."""
        return self._session("send()").send(obs, action, reward, next_obs, terminated,
                                            truncated, version=version, final_obs=final_obs,
                                            extras=extras)

    @property
    def learners_done(self) -> bool:
        """On an actor: True once the learners ended (a loop of your own stops then)."""
        return self._actor_session is not None and self._actor_session.done

    # the learner's side
    def _started(self) -> ExperienceServer | InProcessActor:
        if self._server is None:
            if self.strategy is None:
                raise RuntimeError("the learner's API is for learner processes")
            self._server = ExperienceServer(
                self.replay, self.rank, self.num_actors, lockstep=self.lockstep,
                publish_every=self.publish_every, timeout_seconds=self.timeout_seconds,
                max_policy_lag=self.max_policy_lag)
            self._server.step = self.step
            if self._published is not None:
                self._server.publish(*self._published)
            self._server.start(rl_store(self.timeout_seconds))
        return self._server

    def publish_weights(self, model: torch.nn.Module) -> None:
        """Give actors ``model``'s weights (its state dict, copied now) as version ``step``;
        replica 0 serves them (all replicas hold the same weights)."""
        server = self._started()
        if self.rank == 0 or isinstance(server, InProcessActor):  # each steps its own envs
            server.publish(self.step, list(model.state_dict().values()))

    def batches(self, batch_size: int, num_steps: int, policy: torch.nn.Module | None = None
                ) -> Iterator[dict[str, torch.Tensor]]:
        """``num_steps`` per-replica batches of ``batch_size`` from this replica's shard,
        publishing ``policy`` every ``publish_every`` steps (first at step 0)."""
        server = self._started()
        mine = [a for a in range(self.num_actors) if a % self.num_learners == self.rank]
        device = self.strategy.device if self.strategy is not None else torch.device("cpu")
        for _ in range(num_steps):
            if policy is not None and self.step % self.publish_every == 0:
                self.publish_weights(policy)
            if isinstance(server, InProcessActor):
                server.fill(batch_size)
            elif self.lockstep:
                for items in server.take_round(self.step, mine):
                    self.replay.add(items)
            batch = self.replay.sample(batch_size)
            yield {k: v.to(device) for k, v in batch.items()}
            self.step += 1
            server.step = self.step

    def input_fn(self, global_batch_size: int) -> Callable[[InputContext], Iterator[Any]]:
        """The replay as TF-Replicator's ``input_fn``, for
        ``strategy.distribute_datasets_from_function``."""
        if isinstance(self._started(), InProcessActor):
            raise ClusterConfigError(
                "in_process=True steps the environments inside batches(); input_fn() reads a "
                "replay that actor processes fill. HINT: iterate batches(batch_size, steps, "
                "policy=model) with in_process=True.")

        def fn(ctx: InputContext) -> Iterator[Any]:
            return self.replay.as_dataset(ctx.get_per_replica_batch_size(global_batch_size))
        return fn

    def stats(self) -> dict[str, Any]:
        """Environment steps, items, policy lag (max, median), inserts and samples."""
        out = self._started().stats() if self.strategy is not None else {}
        if isinstance(self.replay, ReplayBuffer):
            out.update(inserted=self.replay.limiter.inserted,
                       sampled=self.replay.limiter.sampled)
        else:
            out.update(inserted=self.replay.inserted, dropped=self.replay.dropped)
        out["learner_steps"] = self.step
        return out

    def episodes(self, start: int = 0) -> list[tuple[float, int, float]]:
        """Episodes the actors (or, with ``in_process=True``, this learner's environments)
        finished: (return, env steps received, learner seconds), from the ``start``-th on (a
        loop that checks every step reads only the new ones)."""
        return [] if self._server is None else self._server.episodes[start:]

    def state_dict(self) -> dict[str, Any]:
        """The learner step, the replay and the weights last published (the actors' policy
        after a resume); model and optimizer are the script's to save."""
        snapshot = None if self._server is None else self._server.snapshot()
        return {"step": self.step, "replay": self.replay.state_dict(), "published": snapshot}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.replay.load_state_dict(state["replay"])
        self._published = state.get("published")
        if self._server is not None:
            self._server.step = self.step
            if self._published is not None:
                self._server.publish(*self._published)

    def close(self) -> None:
        """Tell the actors the learner is done (they exit) and release the replay; on an
        actor, send what a loop of its own has left and leave."""
        global _current
        if _current is self:
            _current = None
        if self._actor_session is not None:
            self._actor_session.close()
        if self._server is not None:
            self._server.close()
        self.replay.close()

    def __enter__(self) -> ActorLearner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
