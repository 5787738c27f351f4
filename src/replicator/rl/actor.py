"""The actor process: vectorised environments stepped with the newest weights it holds.

An actor connects to every learner replica (addresses from the launcher's store), waits for
the first weights, then steps its environments without stopping. The stepping loop writes
everything it sends itself: each batch of experience (round robin over the learners' replay
shards: one ``sendmsg``, so no second thread contends for the interpreter lock at every batch)
and, every ``poll_seconds`` and every few batches, a request to replica 0 for newer weights;
a thread reads the answers, and the loop swaps the weights in between two steps. While a
request is unanswered the loop holds its batches (a few, then it waits), so a learner whose
rate limiter holds inserts back also holds the actor, and no queue of batches made with old
weights builds up in the socket's buffers. Batches not yet sent when the actor dies are all
it loses. Each batch carries the weights version that made it (the oldest in the batch), so
the learner measures the policy lag.

Lockstep mode (tests): round ``r`` resets the environments with a seed derived from the actor
and ``r``, waits for exactly the weights the learner published for round ``r``, runs a fixed
number of steps and sends them to its learner. Every round is then a function of the seed and
the weights alone, which makes a learner's run repeatable and its resume exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replicator.errors import ClusterConfigError, ReplicatorError
from replicator.ps.messages import Connection, PeerLostError, tensor_text
from replicator.rl import transport as T
from replicator.rl.environments import env_name, make_vector_env
from replicator.rl.experience import ExperienceBuilder

__all__ = ["ActorConfig", "EnvironmentStepError", "Stepper", "base_seed", "run_actor",
           "named_weights"]


#: Batches the stepping loop holds while a request for weights waits for its answer (see
#: :class:`_Outgoing`); past this many, the loop waits for the answer.
_HELD_BATCHES = 2
#: Batches sent before the next request goes out even if ``poll_seconds`` have not passed:
#: at most these (and the held ones) wait in the sockets in front of a request.
_UNCONFIRMED_BATCHES = 4


class EnvironmentStepError(ReplicatorError):
    """An environment raised inside an actor; the message names the actor and the step."""


@dataclass
class ActorConfig:
    """What an actor needs to know besides its functions."""

    index: int
    num_learners: int
    num_envs: int
    seed: int
    kind: str  # "transitions" | "trajectories"
    n_step: int = 1
    discount: float = 0.99
    unroll_length: int = 0
    lockstep: bool = False
    round_steps: int = 8
    send_every: int = 64
    poll_seconds: float = 0.05
    timeout_seconds: float = 60.0
    restart: int = 0


def base_seed(cfg: ActorConfig) -> int:
    """What an actor's random seeds derive from: the job's seed and the actor's index, far
    apart so that no two actors (or rounds, or restarts) draw the same seed."""
    return cfg.seed * 1_000_003 + cfg.index * 10_007


class _Links:
    """This actor's connections, one per learner replica."""

    def __init__(self, cfg: ActorConfig, spec: dict[str, Any]) -> None:
        store = T.rl_store(cfg.timeout_seconds)
        self.conns: list[Connection] = []
        self.done = False
        for rank in range(cfg.num_learners):
            raw = store.get(T.LEARNER_KEY.format(rank=rank)).decode()
            host, _, port = raw.rpartition(":")
            conn = Connection.connect((host, int(port)), f"learner {rank}", cfg.timeout_seconds)
            T.send_hello(conn, cfg.index, cfg.restart, spec)
            reply = conn.receive(f"waiting for learner {rank}'s hello")
            if reply.kind == T.ERROR:
                raise ClusterConfigError(tensor_text(reply.payload))
            if rank == 0:
                self.start_round = reply.b
            self.conns.append(conn)

    def ask(self, held: int, round_: int) -> tuple[int, list[torch.Tensor]] | None:
        """Weights newer than ``held`` from learner 0 (lockstep: for ``round_``), else None."""
        self.request(held, round_)
        return self.answer()

    def request(self, held: int, round_: int) -> None:
        """Ask learner 0 for weights newer than ``held``; :meth:`answer` takes the reply."""
        self.conns[0].send(T.ASK, a=held, b=round_)

    def answer(self) -> tuple[int, list[torch.Tensor]] | None:
        """The reply to the last :meth:`request`: newer weights, or None (none newer, or the
        learner said goodbye: then ``done``)."""
        conn = self.conns[0]
        msg = conn.receive("waiting for weights")
        if msg.kind == T.BYE:
            self.done = True
            return None
        if msg.kind == T.ERROR:
            raise ClusterConfigError(tensor_text(msg.payload))
        if msg.version < 0:
            T.receive_parts(conn, msg.c, "receiving weights")
            return None
        return msg.version, T.receive_parts(conn, msg.c, "receiving weights")

    def send(self, learner: int, items: dict[str, torch.Tensor], version: int, steps: int,
             round_: int, returns: list[float], total_steps: int) -> None:
        T.send_items(self.conns[learner % len(self.conns)], items, version, steps, round_,
                     returns, total_steps)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(T.BYE)
            except PeerLostError:
                pass
            conn.close()


def _load(policy: torch.nn.Module, tensors: list[torch.Tensor]) -> None:
    policy.load_state_dict(named_weights(policy.state_dict(), tensors))


def named_weights(state: dict[str, torch.Tensor], tensors: list[torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """The published ``tensors`` under the names of ``state`` (policy_fn()'s state dict),
    refused when their number or shapes differ."""
    if len(state) != len(tensors) or any(tuple(a.shape) != tuple(b.shape)
                                         for a, b in zip(state.values(), tensors)):
        raise ClusterConfigError(
            f"the learner publishes {len(tensors)} tensors of shapes "
            f"{[tuple(t.shape) for t in tensors]}; policy_fn() builds a state dict of "
            f"{[tuple(t.shape) for t in state.values()]}. HINT: publish the module policy_fn "
            "builds.")
    return dict(zip(state, tensors))


def _act(act_fn: Callable[..., Any] | None, policy: torch.nn.Module, obs: torch.Tensor
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.no_grad():
        out = policy(obs) if act_fn is None else act_fn(policy, obs)
    if isinstance(out, tuple):
        action, extras = out
        if isinstance(extras, torch.Tensor):
            extras = {"behaviour_logp": extras}
        return action, dict(extras)
    return out, {}


class Stepper:
    """The environments, the policy and the experience builder of one actor."""

    def __init__(self, cfg: ActorConfig, env_fn: Any, policy_fn: Callable[[], torch.nn.Module],
                 act_fn: Callable[..., Any] | None) -> None:
        self.cfg = cfg
        self.name = env_name(env_fn)
        self.envs = make_vector_env(env_fn, cfg.num_envs)
        self.policy = policy_fn()
        self.policy.eval()
        self.act_fn = act_fn
        self.vector_steps = 0
        self.returns = np.zeros(cfg.num_envs)
        self.finished: list[float] = []
        self.obs: Any = None
        self._obs_tensor: torch.Tensor | None = None  # self.obs as the policy's input

    def spec(self) -> dict[str, Any]:
        space = self.envs.single_observation_space
        return {"kind": self.cfg.kind, "env": self.name, "obs_shape": list(space.shape or ()),
                "actor": self.cfg.index}

    def reset(self, seed: int | None) -> None:
        self.obs, _ = self.envs.reset(seed=seed)
        self._obs_tensor = None
        self.returns[:] = 0

    def step(self, builder: ExperienceBuilder, version: int, truncate: bool = False) -> None:
        obs = self._obs_tensor if self._obs_tensor is not None else \
            torch.as_tensor(np.asarray(self.obs), dtype=torch.float32)
        action, extras = _act(self.act_fn, self.policy, obs)
        try:
            next_obs, reward, term, trunc, info = self.envs.step(action.numpy())
        except Exception as exc:
            raise EnvironmentStepError(
                f"actor {self.cfg.index}: environment {self.name} raised at env step "
                f"{self.vector_steps} (vector step of {self.cfg.num_envs} envs): "
                f"{type(exc).__name__}: {exc}. HINT: fix the environment; with --max-restarts "
                "the launcher restarts this actor alone.") from exc
        self.vector_steps += 1
        trunc = np.asarray(trunc) | truncate
        # one conversion per observation: the vector env returns a new array each step, so
        # the tensor is this step's next observation and the next step's policy input
        next_tensor = torch.as_tensor(np.asarray(next_obs), dtype=torch.float32)
        final = next_tensor
        if "_final_obs" in info:  # an episode ended: its last observation, not the reset's
            final = next_tensor.clone()
            for i in np.nonzero(info["_final_obs"])[0]:
                final[i] = torch.as_tensor(np.asarray(info["final_obs"][i]), dtype=torch.float32)
        self.returns += reward
        for i in np.nonzero(np.asarray(term) | trunc)[0]:
            self.finished.append(float(self.returns[i]))
            self.returns[i] = 0
        builder.step(obs, action, torch.as_tensor(reward, dtype=torch.float32), final,
                     torch.as_tensor(np.asarray(term)), torch.as_tensor(trunc), extras, version,
                     next_tensor)
        self.obs, self._obs_tensor = next_obs, next_tensor

    def take_returns(self) -> list[float]:
        out, self.finished = self.finished, []
        return out


def run_actor(cfg: ActorConfig, env_fn: Any, policy_fn: Callable[[], torch.nn.Module],
              act_fn: Callable[..., Any] | None = None) -> dict[str, int]:
    """Run one actor until its learners end; returns its counts."""
    stepper = Stepper(cfg, env_fn, policy_fn, act_fn)
    links = _Links(cfg, stepper.spec())
    try:
        if cfg.lockstep:
            _lockstep(cfg, stepper, links)
        else:
            _free_running(cfg, stepper, links)
    except PeerLostError:
        pass  # the learners ended or went away: this actor has nothing left to do
    finally:
        stepper.envs.close()
        links.close()
    return {"vector_steps": stepper.vector_steps}


def _wait_weights(cfg: ActorConfig, links: _Links, held: int, round_: int
                  ) -> tuple[int, list[torch.Tensor]] | None:
    deadline = time.monotonic() + cfg.timeout_seconds
    while True:
        got = links.ask(held, round_)
        if got is not None or links.done:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {cfg.index} waited {cfg.timeout_seconds:.0f} s for "
                               f"weights (round {round_}). HINT: the learner must call "
                               "publish_weights(model) (ActorLearner.batches(policy=...)).")
        time.sleep(0.01)


def _lockstep(cfg: ActorConfig, stepper: Stepper, links: _Links) -> None:
    round_ = links.start_round
    while True:
        got = _wait_weights(cfg, links, -1, round_)
        if got is None:
            return
        version, tensors = got
        _load(stepper.policy, tensors)
        seed = base_seed(cfg) + round_
        torch.manual_seed(seed)
        stepper.reset(seed)
        builder = ExperienceBuilder(cfg.kind, cfg.n_step, cfg.discount, cfg.unroll_length)
        for s in range(cfg.round_steps):
            stepper.step(builder, version, truncate=s == cfg.round_steps - 1)
        items, oldest = builder.take()
        if items is not None:
            links.send(cfg.index, items, oldest, cfg.round_steps * cfg.num_envs, round_,
                       stepper.take_returns(), stepper.vector_steps * cfg.num_envs)
        round_ += 1


def _free_running(cfg: ActorConfig, stepper: Stepper, links: _Links) -> None:
    got = _wait_weights(cfg, links, -1, 0)
    if got is None:
        return
    version, tensors = got
    _load(stepper.policy, tensors)
    torch.manual_seed(base_seed(cfg) + cfg.restart)
    stepper.reset(base_seed(cfg) + cfg.restart * 101)
    answers = _WeightAnswers(links, version)
    answers.start()
    builder = ExperienceBuilder(cfg.kind, cfg.n_step, cfg.discount, cfg.unroll_length)
    outgoing = _Outgoing(cfg, links, answers)
    try:
        while not answers.stopped.is_set():
            newer = answers.take_weights()
            if newer is not None:
                version, tensors = newer
                _load(stepper.policy, tensors)
            stepper.step(builder, version)
            if builder.count >= cfg.send_every:
                items, oldest = builder.take()
                if items is not None:
                    outgoing.add(items, oldest, stepper)
            outgoing.flush()
    finally:
        answers.stopped.set()
    if answers.error is not None:
        raise answers.error


class _Outgoing:
    """The stepping loop's sends: its batches, and a request for newer weights every
    ``poll_seconds``, written in that order on the connections.

    The learner answers a request after the experience queued before it (its rate limiter may
    hold those inserts), so an answer says that everything sent before its request has been
    taken. Batches sent beyond that would pile up in the socket's buffers, made with weights
    the answer replaces: the policy lag. So a request goes out every ``poll_seconds`` and after
    every :data:`_UNCONFIRMED_BATCHES` batches sent; while one waits, batches are held
    (:data:`_HELD_BATCHES`, then the loop waits for the answer). A learner that holds inserts
    back thus holds the actor with them, with a few batches in between.
    """

    def __init__(self, cfg: ActorConfig, links: _Links, answers: _WeightAnswers) -> None:
        self.cfg, self.links, self.answers = cfg, links, answers
        self.held: list[tuple[Any, ...]] = []
        self.sent_steps = 0
        self.target = 0
        self.unconfirmed = 0  # batches sent since the last request
        self.asked = time.monotonic()

    def add(self, items: dict[str, torch.Tensor], oldest: int, stepper: Stepper) -> None:
        total = stepper.vector_steps * self.cfg.num_envs
        self.held.append((items, oldest, total - self.sent_steps, stepper.take_returns(),
                          total))
        self.sent_steps = total

    def flush(self) -> None:
        if not self.answers.answered(wait=len(self.held) > _HELD_BATCHES):
            return
        for items, oldest, steps, returns, total in self.held:
            self.links.send(self.target, items, oldest, steps, 0, returns, total)
            self.target += 1
        self.unconfirmed += len(self.held)
        self.held.clear()
        if self.unconfirmed >= _UNCONFIRMED_BATCHES or \
                time.monotonic() - self.asked >= self.cfg.poll_seconds:
            self.asked = time.monotonic()
            self.unconfirmed = 0
            self.answers.expect()
            self.links.request(self.answers.held, 0)


class _WeightAnswers(threading.Thread):
    """Takes learner 0's answers to the stepping loop's requests for weights, off that loop
    (an answer's round trip would stall it); the loop swaps them in with
    :meth:`take_weights`."""

    def __init__(self, links: _Links, version: int) -> None:
        super().__init__(name="replicator-rl-weights", daemon=True)
        self.links = links
        self.held = version
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self._slot: tuple[int, list[torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._asked = threading.Event()  # a request is out: its answer is to be read
        self._answered = threading.Event()  # no request waits for its answer
        self._answered.set()

    def expect(self) -> None:
        """A request is about to be sent: read its answer."""
        self._answered.clear()
        self._asked.set()

    def answered(self, wait: bool) -> bool:
        """Whether no request waits for its answer; ``wait``: until none does (or this
        thread ended, its error then raised by the stepping loop)."""
        while wait and not self._answered.is_set() and not self.stopped.is_set():
            self._answered.wait(0.1)
        return self._answered.is_set()

    def take_weights(self) -> tuple[int, list[torch.Tensor]] | None:
        with self._lock:
            slot, self._slot = self._slot, None
        return slot

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                if not self._asked.wait(0.1):
                    continue
                self._asked.clear()
                got = self.links.answer()  # bounded by the connection's timeout
                if got is not None:
                    self.held = got[0]
                    with self._lock:
                        self._slot = got
                self._answered.set()
                if self.links.done:
                    break
        except PeerLostError:
            pass
        except BaseException as exc:  # noqa: BLE001 - raised again by the stepping loop
            self.error = exc
        finally:
            self.stopped.set()
