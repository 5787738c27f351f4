"""The per-step protocol of live recovery: torchft's Manager composed into a replica group
(docs/fault_tolerance.md, "Live recovery across replica groups"). A step not committed raises
``StepNotCommitted`` before any update and is redone; in rounds (DiLoCo's replica groups,
:meth:`LiveEngine.use_rounds`) a round not committed is rolled back to its start.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from replicator.cluster.env_names import PREEMPTION_EXIT_CODE, REPLICA_ID_FORMAT
from replicator.cluster.ports import listen
from replicator.cluster.process_group import on_shutdown
from replicator.comm.reduce_op import ReduceOp
from replicator.data.live_split import Share
from replicator.errors import ClusterConfigError
from replicator.strategies.live import (
    LighthouseUnreachableError,
    LiveRecoveryError,
    QuorumTimeoutError,
    StepNotCommitted,
)
from replicator.strategies.live import state as live_state
from replicator.strategies.live.exchange import (
    first_line,
    flatten_grads,
    managed_all_gather,
    quiet_flight_recorder_note,
    unflatten_grads,
)
from replicator.strategies.live.settings import QUORUM_TIMEOUT_ENV, LiveSettings
from replicator.strategies.replicas import ReplicaGroup

#: The parts of a live step that :attr:`LiveEngine.seconds` times.
PHASES = ("quorum", "allreduce", "commit", "bookkeeping")


@dataclass(frozen=True)
class Quorum:
    """One step's quorum as this group sees it."""

    step: int           # committed steps so far: the global batch this step trains on
    participant: int    # this group's index among the participants
    participants: int   # groups taking part in the step


class RoundOwner(Protocol):
    """A strategy whose groups synchronise once every ``round_steps`` steps; its state beyond
    modules and optimizers (outer weights, its step) heals and rolls back with them."""

    round_steps: int

    def round_state(self) -> dict[str, Any]: ...

    def load_round_state(self, state: dict[str, Any]) -> None: ...


class LiveEngine:
    """torchft's Manager for one process of one replica group; ``modules`` returns what heals
    and whose gradients are averaged across groups."""

    def __init__(self, settings: LiveSettings, replicas: ReplicaGroup,
                 modules: Callable[[], list[torch.nn.Module]],
                 replicated: Callable[[], bool] = lambda: True) -> None:
        try:
            from torchft.manager import Manager  # type: ignore[import-untyped]

            from replicator.strategies.live.process_group import (
                BoundHTTPTransport,
                LiveProcessGroup,
            )
        except ImportError as exc:
            raise ClusterConfigError(f"replica groups need torchft ({exc}). HINT: pip install "
                                     "'replicator[live]'") from exc

        quiet_flight_recorder_note()
        self.settings = settings
        self.replicas = replicas
        self._modules = modules
        self._replicated = replicated
        self.who = settings.who
        timeout = timedelta(seconds=settings.collective_timeout)
        store_addr, store_port = self._store_address()
        self._transport = BoundHTTPTransport(settings.bind, timeout)
        #: Seconds the last heal took here: the state's transfer plus loading it.
        self.last_heal_seconds: float | None = None
        self._phase = "idle"          # idle -> begun -> committed
        self._quorum: Quorum | None = None
        self._share: Share | None = None
        # what a redone step starts from again: the buffers and the torch RNG
        self._snapshot: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None
        self._rounds: RoundOwner | None = None
        self._in_round = 0            # rounds: steps taken since the round's start
        self._round_start: dict[str, Any] | None = None
        #: A :meth:`backup_state` read from disk (by the live dataset) for :meth:`resume_at`.
        self.from_backup: dict[str, Any] | None = None
        self._healed_now = False
        #: ``check(progress)`` run on a peer's progress before its state is loaded (the dataset's).
        self.progress_check: Callable[[dict[str, Any]], None] | None = None
        self._leave_requested = False
        self._announce_leave = False  # this group tells the others in this step's all-reduce
        self._leave_announced = False
        self._quorum_due = True       # the next step joins a quorum, whatever its number
        self._closed = False
        self.source: Any = None       # the live dataset that made the step's batch
        self.redone_steps = 0
        #: Seconds spent in each of the :data:`PHASES` since the start (a benchmark's breakdown;
        #: bookkeeping: gradients flattened and copied back, the redo snapshot).
        self.seconds = dict.fromkeys(PHASES, 0.0)
        try:
            # torchft 0.2 binds its manager server to every interface (docs/fault_tolerance.md,
            # Trust model); it advertises ``settings.bind``.
            #: The process group across the groups (torchft reconfigures it at each quorum),
            #: held for the exchanges the Manager has no call for (an all-gather).
            self.process_group = LiveProcessGroup(timeout, settings.transport)
            self.manager = Manager(
                pg=self.process_group, load_state_dict=self._load_state,
                state_dict=self._state, min_replica_size=settings.min_replicas,
                use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=settings.quorum_timeout),
                connect_timeout=timedelta(seconds=min(settings.quorum_timeout, 30.0)),
                rank=settings.rank, world_size=settings.group_size, store_addr=store_addr,
                store_port=store_port, lighthouse_addr=settings.lighthouse,
                replica_id=REPLICA_ID_FORMAT.format(group=settings.group),
                hostname=settings.bind,
                checkpoint_transport=self._transport,
                init_sync=True)
        except Exception as exc:  # noqa: BLE001 - torchft raises plain RuntimeErrors
            self._transport.shutdown(wait=False)  # its server thread would outlive the error
            raise LighthouseUnreachableError(
                f"{self.who} could not join the lighthouse at {settings.lighthouse}: "
                f"{first_line(exc)}. HINT: is the lighthouse running and reachable? "
                "`replicator run --replica-groups N` starts one on loopback; otherwise start "
                "`torchft_lighthouse --min_replicas M --bind HOST:PORT`") from exc
        self._install_sigterm()
        on_shutdown(self.close)  # a script that ends on an error stops the state server too

    # -- setup -----------------------------------------------------------------------------------
    def _store_address(self) -> tuple[str, int]:
        """A store for torchft's keys on group rank 0 for this life of the group only (one that
        outlived a restarted group would hand out the old manager's address)."""
        port = torch.zeros(1, dtype=torch.int64)
        if self.settings.rank == 0:
            sock = listen(self.settings.bind, 0)  # this address only, never every interface
            port[0] = int(sock.getsockname()[1])
            self._own_store = dist.TCPStore(self.settings.bind, int(port[0]), 1, True,
                                            timeout=timedelta(seconds=30),
                                            wait_for_workers=False,
                                            master_listen_fd=sock.detach())
        self.replicas.collectives.broadcast_([port], src=0,
                                             what="port of the replica group's store")
        return self.settings.bind, int(port.item())

    def _install_sigterm(self) -> None:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            def request_leave(signum: int, frame: Any) -> None:
                self._leave_requested = True

            signal.signal(signal.SIGTERM, request_leave)

    def _steps_our_parameters(self, optimizer: torch.optim.Optimizer) -> bool:
        ours = {id(p) for m in self._modules() for p in m.parameters()}
        return any(id(p) in ours for g in optimizer.param_groups for p in g["params"])

    # -- the step ----------------------------------------------------------------------------------
    def use_rounds(self, owner: RoundOwner) -> None:
        """Synchronise in rounds of ``owner.round_steps`` steps, set before the first step."""
        if self._quorum is not None:
            raise LiveRecoveryError(f"{self.who}: rounds must be set before the first step")
        self._rounds = owner

    @property
    def committed_steps(self) -> int:
        """Steps committed so far (the next step's global batch; in rounds, with the round's)."""
        done = int(self.manager.current_step())
        return done if self._rounds is None else done * self._rounds.round_steps + self._in_round

    @property
    def writes_backups(self) -> bool:
        """True in the first participant of the last quorum: the one group whose
        ``BackupAndRestore`` saves (all groups hold the same committed state)."""
        return self._quorum is not None and self._quorum.participant == 0

    def backup_state(self) -> dict[str, Any]:
        """What a backup holds beside the tracked objects so that :meth:`resume_at` can go on
        when every group is lost at once: in rounds, the state the round in progress started
        from (a backup at a round's end: the next round's start); else nothing."""
        if self._rounds is None:
            return {}
        start = self._round_start if self._in_round and self._round_start is not None \
            else self._state()
        return {"round_steps": self._rounds.round_steps, "round_start": start}

    def resume_at(self, step: int) -> None:
        """Continue from committed step ``step`` (restored from a backup on disk, when every
        group was lost at once); a peer further on still heals this group. In rounds, from
        the start of the round ``step`` is in, with the state :attr:`from_backup` holds."""
        self._quorum_due = True
        if self._rounds is None:
            self.manager.load_state_dict({"step": int(step), "batches_committed": int(step)})
            return
        saved, self.from_backup = self.from_backup, None
        h = self._rounds.round_steps
        if not saved or "round_start" not in saved:
            raise LiveRecoveryError(
                f"{self.who} cannot resume a run that synchronises in rounds from the backup "
                f"of step {step}: it holds no round state (written by a run without rounds, "
                "or a loop that saved no input state). HINT: resume with the strategy that "
                "wrote it, loop with `backup.steps(strategy.distribute_dataset(...))`, or keep "
                "at least one replica group alive (a restarted group heals from a peer)")
        if int(saved["round_steps"]) != h:
            raise LiveRecoveryError(
                f"{self.who} synchronises every {h} steps but the backup of step {step} was "
                f"written by a run that synchronised every {saved['round_steps']}, so its "
                "round cannot go on here. HINT: resume with the inner_steps (and fragments) of "
                "the run that wrote it, or start in another backup directory")
        start = int(saved["round_start"]["progress"]["step"])
        self._apply(saved["round_start"], self.progress_check)
        self.manager.load_state_dict({"step": start // h, "batches_committed": start // h})
        self._round_start = None
        if start != step:
            print(f"[replicator] {self.who} resumes at step {start}, the start of the round "
                  f"the backup of step {step} was taken in: the round's {step - start} "
                  "step(s) before it are trained again", file=sys.stderr, flush=True)

    @property
    def participants(self) -> int:
        """Replica groups in the quorum of the step in progress (or the last one)."""
        return 0 if self._quorum is None else self._quorum.participants

    @property
    def in_step(self) -> bool:
        return self._phase == "begun"

    def begin_step(self) -> Quorum:
        """This step's quorum: a new one from the lighthouse when due, healing this group when
        behind, else the last one again. Called by the live dataset
        before it cuts the step's batch, else by ``strategy.run``."""
        if self._closed:
            raise LiveRecoveryError(f"{self.who}: live recovery was closed (the strategy was "
                                    "closed or the group left)")
        if self._phase == "begun" and self._quorum is not None:
            return self._quorum
        start = time.perf_counter()
        self._maybe_leave()
        self._healed_now = False
        last = self._quorum
        if last is None or self._quorum_is_due():
            participant, participants = self._join_quorum()
        else:
            participant, participants = last.participant, last.participants
        start = self._add("quorum", start)
        self._quorum = Quorum(self.committed_steps, participant, participants)
        if self._rounds is None:
            self._snapshot = ([(b, b.detach().clone()) for m in self._modules()
                               for b in m.buffers()], torch.get_rng_state())
        elif self._in_round == 0:  # what a round not committed starts again from
            self._round_start = self._state()
        self._phase = "begun"
        self._add("bookkeeping", start)
        return self._quorum

    def _quorum_is_due(self) -> bool:
        """Whether this step asks the lighthouse (every group of the last quorum agrees)."""
        if self._rounds is not None:
            return self._in_round == 0
        return self._quorum_due or self.committed_steps % self.settings.quorum_every == 0

    def _join_quorum(self) -> tuple[int, int]:
        """Join a quorum (healing when behind): this group's index and the participants."""
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.settings.quorum_timeout))
        except LiveRecoveryError:
            raise
        except Exception as exc:  # noqa: BLE001 - torchft's errors are plain RuntimeErrors
            text = first_line(exc)
            if any(w in text.lower() for w in ("timeout", "timed out", "deadline", "elapsed")):
                raise QuorumTimeoutError(
                    f"{self.who} waited {self.settings.quorum_timeout:.0f} s for a quorum of at "
                    f"least {self.settings.min_replicas} replica group(s) at step "
                    f"{self.committed_steps} and none formed ({text}). HINT: fewer groups are "
                    f"alive than --min-replicas {self.settings.min_replicas}; restart the lost "
                    f"groups, lower --min-replicas, or wait longer with {QUORUM_TIMEOUT_ENV}"
                ) from exc
            raise LighthouseUnreachableError(
                f"{self.who} lost the lighthouse at {self.settings.lighthouse} while asking for "
                f"the quorum of step {self.committed_steps}: {text}. HINT: the lighthouse process "
                "must outlive every replica group; check that it is running") from exc
        self._agree_on_healing()
        participant = self.manager.participating_rank()
        participants = self.manager.num_participants()
        if participant is None or participants < 1:
            raise LiveRecoveryError(f"{self.who} is not part of the quorum it joined (step "
                                    f"{self.committed_steps}); please report this as a bug")
        self._quorum_due = False
        return int(participant), int(participants)

    def _add(self, phase: str, start: float) -> float:
        """Count the seconds since ``start`` to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] += now - start
        return now

    def _agree_on_healing(self) -> None:
        """Where any rank of a replicating group healed at the first step, take rank 0's."""
        if self.replicas.world_size == 1 or not self._replicated():
            return
        flag = torch.tensor([1 if self._healed_now else 0], dtype=torch.int64)
        if int(self.replicas.collectives.all_reduce(flag, ReduceOp.MAX,
                                                     "agreement on healing").item()):
            tensors = [t for m in self._modules() for t in [*m.parameters(), *m.buffers()]]
            with torch.no_grad():
                self.replicas.collectives.broadcast_(
                    tensors, src=0, what="parameters of group rank 0 after healing")

    def use_share(self, share: Share, source: Any) -> None:
        """The step's batch came from ``source`` (a live dataset) with ``share``."""
        self._share = share
        self.source = source

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer step of a step commits it (in rounds, counts an inner step)."""
        if self._closed or not self._steps_our_parameters(optimizer):
            return
        if self._phase == "committed":
            return  # a second optimizer of the same step: its gradients are averaged already
        if self._phase == "idle":
            self.begin_step()
        if self._rounds is None:
            self.commit()
        else:  # an inner step: the group's own; the round's end syncs across groups
            self._in_round += 1
            self._phase = "committed"

    def commit(self) -> None:
        """Average the gradients across the quorum's groups and ask whether the step may be
        committed; raises ``StepNotCommitted`` when not (nothing has been updated yet)."""
        quorum = self._quorum
        assert quorum is not None
        start = time.perf_counter()
        weight = 1.0 / quorum.participants if self._share is None or \
            self._share.step != quorum.step else self._share.group_weight
        buckets = flatten_grads(
            [p for _, p in live_state.named_parameters(self._modules()) if p.requires_grad],
            weight, 1.0 if self._announce_leave else 0.0, self.process_group.buffer)
        start = self._add("bookkeeping", start)
        works = [self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
                 for _, flat in buckets]
        for work in works:
            work.wait()
        start = self._add("allreduce", start)
        unflatten_grads(buckets)
        start = self._add("bookkeeping", start)
        self._vote(start, f"step {quorum.step}")
        if float(buckets[0][1][-1]) > 0.5:  # a group leaves: every group joins a quorum next
            self._quorum_due = True
            self._leave_announced = self._announce_leave
        self._phase = "committed"

    def start_round_sync(self, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """In rounds: start averaging ``flat`` over the quorum's groups; the call returned, at
        the round's last step, gives the average or ``StepNotCommitted``. Started earlier, it
        overlaps the steps between (streaming DiLoCo's ``sync_delay``); a one-value all-reduce
        at the end fails if a group was lost after the exchange."""
        quorum = self._round_quorum()
        flat = flat / quorum.participants
        work = self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        started_at = self._in_round

        def finish() -> torch.Tensor:
            start = time.perf_counter()
            work.wait()
            if self._in_round != started_at:
                self.manager.allreduce(torch.zeros(1), reduce_op=dist.ReduceOp.SUM).wait()
            self._vote(self._add("allreduce", start), f"the round ending at step {quorum.step}")
            return flat
        return finish

    def sync_round_gathered(self, payload: torch.Tensor,
                            combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """In rounds, at the round's last step: ``combine`` of every group's ``payload`` (one
        length on all), all-gathered in the quorum's order so every group combines the same
        list, divided by the participants; or ``StepNotCommitted`` as :meth:`start_round_sync`.
        For payloads an all-reduce cannot sum (quantised values with per-group scales)."""
        quorum = self._round_quorum()
        start = time.perf_counter()
        parts = managed_all_gather(self.manager, self.process_group, payload,
                                   f"{self.who}: the all-gather across the replica groups for "
                                   f"the round ending at step {quorum.step}")
        total = combine(parts).div_(quorum.participants) if parts is not None else None
        self._vote(self._add("allreduce", start), f"the round ending at step {quorum.step}")
        if total is None:  # the failure went to the Manager, whose should_commit said no
            raise LiveRecoveryError(f"{self.who}: the round ending at step {quorum.step} was "
                                    "committed after its all-gather failed; please report "
                                    "this as a bug")
        return total

    def _round_quorum(self) -> Quorum:
        quorum = self._quorum
        if self._rounds is None or quorum is None:
            raise LiveRecoveryError(f"{self.who}: a round's exchange outside a round; please "
                                    "report this as a bug")
        return quorum

    def _vote(self, start: float, what: str) -> None:
        """Ask whether ``what``, ending now, may be committed; ``StepNotCommitted`` if not."""
        committed = self.manager.should_commit()
        self._add("commit", start)
        if not committed:
            raise StepNotCommitted(f"{self.who}: {what} was not committed")
        self._in_round = 0  # in rounds: the next round starts (always 0 without rounds)

    def run_step(self, call: Callable[[tuple], Any], args: tuple) -> Any:
        """Run one step through ``call(args)``, redone with the next quorum until committed."""
        if self._phase != "begun":
            self.begin_step()
        while True:
            try:
                result = call(args)
            except StepNotCommitted:
                new_args = self._redo(call, args)
                if new_args is None:  # healed past the end of the data
                    return None
                args = new_args
                continue
            if self._phase == "begun":
                self._phase = "idle"  # a step without an optimizer step (evaluation)
            return result

    def _redo(self, call: Callable[[tuple], Any], args: tuple) -> tuple | None:
        """After a step not committed: roll back, join the next quorum and return the step's
        arguments cut for it (in rounds, after training the round's earlier steps again)."""
        self._quorum_due = True  # the quorum changed: a group failed or left
        for _, p in live_state.named_parameters(self._modules()):
            p.grad = None
        if self._rounds is not None and self._round_start is not None:
            self._apply(self._round_start)
        elif self._snapshot is not None:
            with torch.no_grad():
                for b, saved in self._snapshot[0]:
                    b.copy_(saved)
            torch.set_rng_state(self._snapshot[1])
        self._phase = "idle"
        quorum = self.begin_step()
        self.redone_steps += 1
        if self.source is None:
            if self._rounds is not None:
                raise LiveRecoveryError(
                    f"{self.who} must train a round again with a new quorum, but the batches "
                    "did not come from strategy.distribute_dataset. HINT: iterate the "
                    "distributed dataset and pass its batches to strategy.run")
            return args
        new_args = self.source.reshare(args, quorum)
        rounds = self._rounds
        while new_args is not None and rounds is not None \
                and (quorum.step + 1) % rounds.round_steps:
            call(new_args)  # an inner step: nothing crosses the groups before the round's end
            if self._phase == "begun":
                raise LiveRecoveryError(f"{self.who}: a step of a round took no optimizer "
                                        "step. HINT: step the optimizer in every step")
            quorum = self.begin_step()
            new_args = self.source.reshare(new_args, quorum)
        return new_args

    # -- state for healing -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        progress: dict[str, Any] = {"step": self.committed_steps}
        if self.source is not None:
            progress.update(self.source.progress(self.committed_steps))
        state = live_state.capture(self._modules(), progress)
        if self._rounds is not None:
            state["round"] = self._rounds.round_state()
        return state

    def _apply(self, state: dict[str, Any],
               check: Callable[[dict[str, Any]], None] | None = None) -> None:
        live_state.apply(state, self._modules(), self.who, check or (lambda progress: None))
        if self._rounds is not None:
            self._rounds.load_round_state(state["round"])
            self._in_round = 0  # a peer's state is taken at its round's start

    def _load_state(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        self._apply(state, self.progress_check)
        self.last_heal_seconds = time.perf_counter() - start + (
            self._transport.last_recv_seconds or 0.0)
        self._healed_now = True
        print(f"[replicator] {self.who} healed from a live peer at step "
              f"{state.get('progress', {}).get('step')}", file=sys.stderr, flush=True)

    # -- leaving ----------------------------------------------------------------------------------
    def _maybe_leave(self) -> None:
        """Leave at this step boundary after SIGTERM once the other groups know (the last
        all-reduce told them, or this step joins a quorum); else this step tells them. In
        rounds, only at a round's start."""
        if self._rounds is not None and self._in_round:
            return
        flag = torch.tensor([1 if self._leave_requested else 0], dtype=torch.int64)
        if self.replicas.world_size > 1:
            flag = self.replicas.collectives.all_reduce(flag, ReduceOp.MAX, "agreement on leaving")
        if not int(flag.item()):
            return
        if not (self._leave_announced or self._quorum is None or self._quorum_is_due()):
            self._announce_leave = True
            return
        print(f"[replicator] {self.who} leaves at step {self.committed_steps} (SIGTERM); "
              "the other groups go on without a failed step", file=sys.stderr, flush=True)
        self.close()
        raise SystemExit(PREEMPTION_EXIT_CODE)

    def close(self) -> None:
        """Leave the lighthouse's quorums and stop the state server; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self._transport.shutdown(wait=False)

    def __repr__(self) -> str:
        s = self.settings
        return (f"LiveEngine({self.who} of {s.groups}, lighthouse {s.lighthouse}, "
                f"min_replicas {s.min_replicas}, step {self.committed_steps})")
