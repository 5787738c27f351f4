"""The parameter server: holds variable shards and their optimizer state and serves workers,
one thread per connection, until every worker has come and gone (a worker that disconnects
without ``BYE`` is lost, and rounds waiting for it complete without it). A large shard's values
go through the shared-memory lane in row parts of about ``PART_BYTES``, so the worker copies one
part while the server writes the next (one snapshot, under the lock); over TCP they go whole."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from replicator.cluster.env_names import REJOIN_KEY
from replicator.comm.shm_segment import SharedSegment, host_id
from replicator.ps import protocol as P
from replicator.ps.claims import WAIT
from replicator.ps.messages import (
    Connection,
    Into,
    Message,
    Outgoing,
    PeerLostError,
    SharedLane,
    Staged,
    accept_connections,
    tensor_text,
    text_tensor,
)
from replicator.ps.server_updates import (
    Grad,
    ServerUpdates,
    ShardState,
    WorkerState,
    build_shard_optimizer,
)

#: About how much of a large shard's values each part carries.
PART_BYTES = 1 << 20


def splits(value: torch.Tensor) -> bool:
    """Whether ``value`` is large enough to travel in parts (two or more, by rows)."""
    return value.dim() > 0 and len(value) > 1 \
        and value.numel() * value.element_size() >= 2 * PART_BYTES


def value_messages(shards: Iterable[tuple[int, int, torch.Tensor]], clock: int, repeat: bool,
                   in_parts: bool) -> list[Outgoing]:
    """``VALUE`` messages of ``(shard id, version, values)`` and the end marker; with
    ``in_parts`` a large shard's values become row ranges of about ``PART_BYTES``."""
    out: list[Outgoing] = []
    count = 0
    for sid, version, value in shards:
        count += 1
        if not in_parts or not splits(value):
            out.append((P.VALUE, sid, version, value, 0, 0, 0))
            continue
        nbytes, rows = value.numel() * value.element_size(), len(value)
        per = max(1, PART_BYTES // max(1, nbytes // rows))
        for start in range(0, rows, per):
            out.append((P.VALUE, sid, version, value[start:start + per], 0, rows, start + 1))
    out.append((P.VALUES_END, -1, clock, None, count, int(repeat), 0))
    return out


def send_in_parts(conn: Connection, messages: list[Outgoing]) -> None:
    """Write ``messages`` into the lane a part at a time, announcing each batch of about
    ``PART_BYTES`` as soon as it is written (the caller checked that they fit the lane)."""
    at = 0
    batch: list[Outgoing] = []
    size = 0
    for i, message in enumerate(messages):
        batch.append(message)
        tensor = message[3]
        if tensor is not None:
            size += tensor.numel() * tensor.element_size()
        if size >= PART_BYTES or i == len(messages) - 1:
            conn.send_staged(conn.stage(batch, shared=True, lane_start=at))
            at += SharedLane.nbytes([m[3] for m in batch])
            batch, size = [], 0


def _gradient_buffers(conn: Connection) -> Into:
    """Gradients land in buffers kept per connection and shard (free again by the next push),
    or stay in the worker's lane (views)."""
    def into(kind: int, var_id: int, dtype: torch.dtype, shape: tuple[int, ...]
             ) -> torch.Tensor | None:
        if kind != P.GRAD or conn.lane is not None:
            return None
        key = (var_id, dtype)  # one buffer per shard (a sparse table's rows change in number)
        buffer = conn.buffers.get(key)
        if buffer is None or tuple(buffer.shape) != shape:
            buffer = conn.buffers[key] = torch.empty(shape, dtype=dtype)
        return buffer

    return into


def _import_optimizer_dependencies() -> None:
    """What the first optimizer a server builds imports (torch.optim's constructor imports
    torch._dynamo; the library itself no longer does at import)."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - the optimizer's own import then reports it
        pass


class ParameterServer(ServerUpdates):
    """Serve shards to ``num_workers`` workers on ``sock`` (already listening)."""

    def __init__(self, index: int, num_workers: int, staleness: int | None, sock: socket.socket,
                 timeout_seconds: float, checkpoint_dir: str | None = None, store: Any = None,
                 shared_memory: bool = True) -> None:
        super().__init__(index, num_workers, staleness, timeout_seconds)
        self.sock, self.shared_memory = sock, shared_memory
        if not torch.sparse.check_sparse_tensor_invariants.is_enabled():
            # said explicitly (the default): torch's Adagrad otherwise warns at the first sparse
            # step that the checks are "implicitly disabled"; the rows are checked on arrival
            torch.sparse.check_sparse_tensor_invariants.disable()
        self.spec_text = ""
        self.restored_step: int | None = None
        self.extra: dict[str, Any] = {}
        self.checkpoint_dir, self.store = checkpoint_dir, store
        self.last_loss = 0.0
        #: the newest description of each optimizer, by the shards it covers
        self.specs: dict[str, tuple[str, dict[str, Any]]] = {}
        if checkpoint_dir:
            self._restore(checkpoint_dir)

    # -- serving -------------------------------------------------------------------------------
    def serve(self) -> None:
        """Accept workers until every worker has come and gone."""
        # building a torch.optim optimizer imports torch._dynamo (about a second here): done
        # while the workers set up, not when the first update arrives and every worker waits
        threading.Thread(target=_import_optimizer_dependencies, daemon=True,
                         name="ps-warm-imports").start()
        self._started = self._idle_since = time.monotonic()
        accept_connections(self.sock, self.timeout_seconds, self._handle, f"ps{self.index}-conn",
                           self._serving)
        self.sock.close()

    def _serving(self) -> bool:
        """False once every worker has come and gone (or none came back for the timeout)."""
        with self.lock:
            seen = len(self.workers)
            live = sum(w.connected for w in self.workers.values())
        now = time.monotonic()
        if live:
            self._idle_since = now
        if seen >= self.num_workers and live == 0 and not self._rejoin_pending():
            return False
        if seen == 0 and now - self._started > self.timeout_seconds:
            raise TimeoutError(f"parameter server {self.index}: no worker connected within "
                               f"{self.timeout_seconds:.0f} s")
        if seen and not live and now - self._idle_since > self.timeout_seconds:
            missing = sorted(set(range(self.num_workers)) - set(self.workers))
            print(f"[replicator] parameter server {self.index}: no worker left for "
                  f"{self.timeout_seconds:.0f} s and worker(s) {missing} never came; "
                  "stopping", file=sys.stderr, flush=True)
            return False
        return True

    def _rejoin_pending(self) -> bool:
        """Whether a lost worker is being restarted (the launcher says so in the store)."""
        with self.lock:
            lost = {w: s.connections for w, s in self.workers.items() if s.lost}
        if not lost:
            return False
        if time.monotonic() - self.last_loss < 1.0:
            return True  # give the launcher a moment to notice the loss
        if self.store is None:
            return False
        for worker, connections in lost.items():
            key = REJOIN_KEY.format(rank=worker)
            try:
                if self.store.check([key]) and int(self.store.get(key)) >= connections:
                    return True
            except (RuntimeError, ValueError):
                continue
        return False

    def _handle(self, conn: Connection) -> None:
        worker = -1
        try:
            hello = conn.receive("waiting for HELLO")
            if hello.kind != P.HELLO:
                return
            if not 0 <= hello.a < self.num_workers:
                raise P.ParameterServerError(f"worker index {hello.a} is not one of this job's "
                                             f"{self.num_workers} workers")
            worker = hello.a
            conn.peer = f"worker {worker}"
            with self.lock:
                state = self.workers.setdefault(worker, WorkerState())
                state.connected, state.in_flight, state.lost = True, False, False
                state.connections += 1
                self.lock.notify_all()
            restored = "" if self.restored_step is None else json.dumps(
                {"step": self.restored_step, "data": self.extra.get("worker_data", {})})
            conn.send(P.HELLO, var_id=host_id(), a=self.index, b=int(bool(restored)),
                      c=os.getpid(), tensor=text_tensor(restored) if restored else None)
            into = _gradient_buffers(conn)
            # the rows of each sparse shard this connection's last row pull named, which a
            # GRAD with c=2 takes as its rows (a lookup's gradient rows are the rows it pulled)
            served: dict[int, torch.Tensor] = {}
            while True:
                msg = conn.receive("waiting for a request", timeout_seconds=None, into=into)
                if msg.kind == P.BYE:
                    break
                self._dispatch(conn, worker, msg, served)
        except PeerLostError:
            with self.lock:
                if worker in self.workers:
                    self.workers[worker].lost = True
                    self.last_loss = time.monotonic()
            print(f"[replicator] parameter server {self.index}: lost worker {worker}; "
                  "going on without it", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - refused and reported to the worker
            text = str(exc) if isinstance(exc, P.ParameterServerError) else \
                f"{type(exc).__name__}: {exc}"
            print(f"[replicator] parameter server {self.index}: refused a request of worker "
                  f"{worker}: {text}", file=sys.stderr, flush=True)
            try:
                conn.send(P.ERROR, tensor=text_tensor(text))
            except PeerLostError:
                pass
        finally:
            conn.close()
            with self.lock:
                if worker in self.workers:
                    self.workers[worker].connected = False
                    self.workers[worker].in_flight = False
                    self.round.grads.pop(worker, None)
                    self.claims.give_back(worker)
                    self._maybe_finish_round()
                self.lock.notify_all()

    def _dispatch(self, conn: Connection, worker: int, msg: Message,
                  served: dict[int, torch.Tensor]) -> None:
        if msg.kind == P.REGISTER:
            self._register(conn, msg)
        elif msg.kind == P.OPTIMIZER:
            self._set_optimizer(tensor_text(msg.payload))
        elif msg.kind == P.TASK_COMMIT:
            repeat = self._commit_task(worker, (msg.var_id, msg.version))
            if msg.b:
                self._pull(conn, worker, expected=0, begin=False, repeat=repeat)
        elif msg.kind in (P.GRAD, P.ROW_IDS, P.PUSH, P.TASK_PUSH, P.TASK_PREPARE):
            # an update (GRADs, with ROW_IDS before a sparse one) or a pull of rows
            grads: dict[int, Grad] = {}
            rows: dict[int, torch.Tensor] = {}
            into = _gradient_buffers(conn)
            nxt = msg
            while nxt.kind not in (P.PUSH, P.TASK_PUSH, P.TASK_PREPARE, P.PULL_ROWS):
                if nxt.kind == P.ROW_IDS and nxt.payload is not None:
                    rows[nxt.var_id] = nxt.payload
                elif nxt.kind == P.GRAD:
                    grads[nxt.var_id] = (nxt.version, nxt.payload,
                                         self._gradient_rows(served, nxt, rows))
                else:
                    raise P.ParameterServerError(f"expected GRAD, ROW_IDS or PUSH, got kind "
                                                 f"{nxt.kind}")
                nxt = conn.receive("receiving gradients", into=into)
            if nxt.kind == P.PULL_ROWS:
                self._pull_rows(conn, self._rows_asked(nxt, rows), served)
                return
            if nxt.kind == P.TASK_PREPARE:
                conn.send(P.PREPARED, a=int(self._prepare((nxt.var_id, nxt.version), grads)))
                return
            repeat = self._push(worker, grads, nxt)
            if nxt.b:
                self._pull(conn, worker, expected=0, begin=False, repeat=repeat)
        elif msg.kind == P.PULL:
            self._pull(conn, worker, expected=msg.a, begin=bool(msg.b), everything=bool(msg.c))
        elif msg.kind == P.PULL_ROWS:  # one shard's rows (its ids as payload), or none
            self._pull_rows(conn, self._rows_asked(msg, {}), served)
        elif msg.kind == P.STATS:
            conn.send(P.STATS, tensor=text_tensor(json.dumps(self._stats(msg.a))))
        elif msg.kind == P.CLAIM:
            conn.send(P.CLAIMED, a=self._claim(worker, (msg.var_id, msg.a), msg.b))
        elif msg.kind == P.SHM_ATTACH:
            self._attach_lane(conn, worker, msg)
        elif msg.kind == P.SAVE:
            path = self._save(msg.a, json.loads(tensor_text(msg.payload)))
            conn.send(P.SAVED, tensor=text_tensor(path))
        else:
            raise P.ParameterServerError(f"unknown request kind {msg.kind}")

    def _attach_lane(self, conn: Connection, worker: int, msg: Message) -> None:
        """Map the segment the worker created (and unlink it), or tell it why not."""
        reason = ""
        if not self.shared_memory:
            reason = f"shared memory is switched off on parameter server {self.index}"
        elif msg.version != host_id():
            reason = f"worker {worker} and parameter server {self.index} run on different hosts"
        else:
            size, push, pull = SharedLane.layout(msg.a, msg.b)
            try:
                segment = SharedSegment.open_named(tensor_text(msg.payload), size)
                lane = SharedLane(segment, out=pull, inbox=push)
            except (OSError, ValueError, OverflowError) as exc:
                reason = (f"parameter server {self.index} could not map the segment: "
                          f"{type(exc).__name__}: {exc}")
        if reason:
            conn.send(P.SHM_ATTACHED, a=0, tensor=text_tensor(reason))
            return
        conn.buffers.clear()  # gradients arrive in the lane from now on
        conn.lane = lane
        conn.send(P.SHM_ATTACHED, a=1)

    # -- variables -------------------------------------------------------------------------
    def _register(self, conn: Connection, msg: Message) -> None:
        assert msg.payload is not None
        with self.lock:
            if msg.var_id not in self.shards:
                self.shards[msg.var_id] = ShardState(torch.nn.Parameter(msg.payload.clone()),
                                                      sparse=bool(msg.a))
                self._build_optimizers()
            elif msg.a:
                self.shards[msg.var_id].sparse = True  # restored from a checkpoint
            self.lock.notify_all()
        conn.send(P.REGISTERED, var_id=msg.var_id)

    def _set_optimizer(self, text: str) -> None:
        """An optimizer's description: it covers the shards it names (a model may have
        several optimizers, e.g. one for a sparse table and one for the dense layers)."""
        spec = json.loads(text)
        with self.lock:
            covers = ",".join(sorted(spec["shard_groups"]))
            if self.specs.get(covers, ("",))[0] == text:
                return
            self.specs[covers] = (text, spec)
            self.spec_text = text
            for sid, group in spec["shard_groups"].items():
                shard = self.shards.get(int(sid))
                if shard is None:
                    continue
                same = shard.optimizer is not None and \
                    json.loads(shard.spec_text or "{}").get("class") == spec["class"]
                shard.group, shard.spec_text = int(group), text
                if same:
                    assert shard.optimizer is not None
                    P.update_hyperparameters(shard.optimizer, spec, shard.group)
                else:
                    shard.optimizer = None
            self._build_optimizers()

    def _build_optimizers(self) -> None:
        for sid, shard in self.shards.items():
            if shard.optimizer is not None:
                continue
            found = [(t, s) for t, s in self.specs.values() if str(sid) in s["shard_groups"]]
            if not found:
                continue
            shard.spec_text, spec = found[-1]
            shard.group = int(spec["shard_groups"].get(str(sid), shard.group))
            shard.optimizer = build_shard_optimizer(spec, shard.param, shard.group, shard.sparse)
            pending = self.extra.pop(f"optimizer_state_{sid}", None)
            if pending is not None:
                shard.optimizer.load_state_dict(pending)

    # -- updates ---------------------------------------------------------------------------
    def _claim(self, worker: int, key: tuple[int, int], total: int) -> int:
        index = [WAIT]

        def claimed() -> bool:
            try:
                index[0] = self.claims.claim(worker, key, total)
            except ValueError as exc:
                raise P.ParameterServerError(str(exc)) from None
            return index[0] != WAIT

        with self.lock:
            self._wait_until(claimed, lambda: (
                f"parameter server {self.index}: epoch {key[1]} of input {key[0]} waited "
                f"{self.timeout_seconds:.0f} s for batches other workers claimed. HINT: a "
                "worker that takes a batch must push its update (optimizer.step())."))
        return index[0]

    @staticmethod
    def _rows_asked(end: Message, rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The rows a ``PULL_ROWS`` asks for: the ``ROW_IDS`` before it and, as its payload,
        the last shard's ids (one message fewer per pull); ``a`` counts them all."""
        if end.payload is not None:
            rows[end.var_id] = end.payload
        if end.a != len(rows):
            raise P.ParameterServerError(f"a row pull announced {end.a} shard(s) and named "
                                         f"{len(rows)}")
        return rows

    @staticmethod
    def _gradient_rows(served: dict[int, torch.Tensor], grad: Message,
                       rows: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """A ``GRAD``'s sparse rows: none (``c=0``, dense), the ``ROW_IDS`` before it
        (``c=1``), or the rows this connection's last pull of the shard named (``c=2``)."""
        if grad.c == 2:
            kept = served.pop(grad.var_id, None)
            if kept is None:
                raise P.ParameterServerError(
                    f"a gradient of shard {grad.var_id} names the rows of the last row pull, "
                    f"and this connection pulled none of that shard's rows")
            return kept
        return rows.pop(grad.var_id, None) if grad.c else None

    def _pull_rows(self, conn: Connection, rows: dict[int, torch.Tensor],
                   served: dict[int, torch.Tensor]) -> None:
        """The values of the named rows of sparse table shards (each shard's own numbering);
        ``served`` keeps the ids for a gradient of those rows (``GRAD`` with ``c=2``)."""
        with self.lock:
            out: list[tuple[int, int, torch.Tensor]] = []
            for sid, ids in sorted(rows.items()):
                shard = self.shards.get(sid)
                if shard is None:
                    raise P.ParameterServerError(f"parameter server {self.index} holds no "
                                                 f"shard {sid}")
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= len(shard.param)):
                    raise P.ParameterServerError(f"rows outside shard {sid} of "
                                                 f"{len(shard.param)} rows")
                out.append((sid, shard.version, shard.param.detach().index_select(0, ids)))
                served[sid] = ids.clone()  # the ids may sit in the worker's lane: kept
            clock = self.clock
        # through the worker's lane when they fit: it copies the rows out before it asks again
        conn.send_many(value_messages(out, clock, False, in_parts=False),
                       shared=conn.fits_shared([v for _, _, v in out]))

    def _pull(self, conn: Connection, worker: int, expected: int, begin: bool,
              everything: bool = False, repeat: bool = False) -> None:
        """Send every shard's values; ``begin``: the worker starts a step with them (it waits
        for the staleness bound and counts as a step in flight until its next push)."""
        with self.lock:
            self._wait_until(lambda: len(self.shards) >= expected and (
                not begin or self._may_pull(worker)), lambda: (
                f"parameter server {self.index} could not serve worker {worker}'s pull within "
                f"{self.timeout_seconds:.0f} s ({len(self.shards)} of {expected} shards "
                f"registered; staleness bound {self.staleness}). HINT: the chief registers the "
                "variables, and with a staleness bound the slowest worker must keep pushing; "
                "check that they are running."))
            if begin:
                state = self.workers[worker]
                state.in_flight = True
                state.pulled_clock = self.clock
            staged = self._stage_values(conn, everything, repeat)
            if staged is None:
                return  # sent in parts, under the lock
        conn.send_staged(staged)

    def _stage_values(self, conn: Connection, everything: bool = False, repeat: bool = False
                      ) -> Staged | None:
        """Every dense shard's values (``everything``: sparse tables' too) and the end marker,
        taken under the lock: into the lane (in parts when large: ``None``, sent), else cloned."""
        shards = [(sid, s.version, s.param.detach()) for sid, s in sorted(self.shards.items())
                  if everything or not s.sparse]
        if any(splits(v) for _, _, v in shards):  # else one batch, built once
            parts = value_messages(shards, self.clock, repeat, in_parts=True)
            if conn.fits_shared([m[3] for m in parts]):
                send_in_parts(conn, parts)
                return None
        shared = conn.fits_shared([v for _, _, v in shards])
        if not shared:
            shards = [(sid, version, v.clone()) for sid, version, v in shards]
        return conn.stage(value_messages(shards, self.clock, repeat, in_parts=False), shared=shared)

    def _stats(self, stream: int) -> dict[str, Any]:
        with self.lock:
            return {"staleness": [sum(self.histogram), self.stale_sum, self.stale_max,
                                  *self.histogram],
                    "versions": {sid: s.version for sid, s in self.shards.items()},
                    "tasks": self.tasks.summary(), "data": self.claims.summary(stream)}

    # -- checkpoints (under <directory>/ps-<index>) --------------------------------------------
    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors: dict[str, Any] = {}
        for sid, shard in self.shards.items():
            tensors[f"value_{sid}"] = shard.param.detach().clone()
            if shard.optimizer is not None:
                tensors[f"optimizer_state_{sid}"] = shard.optimizer.state_dict()
        info = {"versions": {str(s): sh.version for s, sh in self.shards.items()},
                "clock": self.clock, "histogram": list(self.histogram),
                "stale_sum": self.stale_sum, "stale_max": self.stale_max,
                "spec": self.spec_text, "claims": self.claims.state(),
                "specs": [t for t, _ in self.specs.values()], "tasks": self.tasks.state(),
                "sparse": sorted(sid for sid, sh in self.shards.items() if sh.sparse)}
        return tensors, info

    def _manager(self, directory: str) -> Any:
        from replicator.checkpoint.manager import CheckpointManager
        from replicator.comm.collectives import Collectives

        alone = Collectives(0, 1, torch.device("cpu"), self.timeout_seconds)  # a job of one
        return CheckpointManager(Path(directory) / f"ps-{self.index:03d}", keep=2,
                                 collectives=alone)

    def _save(self, step: int, extra: dict[str, Any]) -> str:
        directory = extra.get("directory") or self.checkpoint_dir
        if not directory:
            raise P.ParameterServerError("no checkpoint directory. HINT: pass "
                                         "checkpoint_dir= to ParameterServerStrategy")
        with self.lock:
            tensors, info = self._state()
            info["worker_data"] = extra.get("worker_data", {})
            path = self._manager(directory).save(step, replicated={"server": tensors}, info=info)
        return str(path)

    def _restore(self, directory: str) -> None:
        restored = self._manager(directory).restore()
        if restored is None:
            return
        tensors = restored.replicated.get("server", {})
        info = restored.info
        for key, value in tensors.items():
            if key.startswith("value_"):
                sid = int(key[len("value_"):])
                self.shards[sid] = ShardState(torch.nn.Parameter(value.clone()))
            else:
                self.extra[key] = value
        for sid, version in info.get("versions", {}).items():
            self.shards[int(sid)].version = int(version)
        for name in ("clock", "stale_sum", "stale_max"):
            setattr(self, name, int(info.get(name, 0)))
        self.histogram = list(info.get("histogram", self.histogram))
        self.extra["worker_data"] = info.get("worker_data", {})
        self.claims.load(info.get("claims", {}))
        self.tasks.load(info.get("tasks", []))
        for sid in info.get("sparse", []):
            self.shards[int(sid)].sparse = True
        for text in info.get("specs") or ([info["spec"]] if info.get("spec") else []):
            self._set_optimizer(text)
        self.restored_step = restored.step
