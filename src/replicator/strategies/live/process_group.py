"""What torchft is given in place of its own (docs/fault_tolerance.md, "Live recovery"): the
process group across replica groups, summing through shared memory when every group of the
quorum runs on this host, and a checkpoint transport over HTTP on one address only
(``REPLICATOR_LIVE_BIND``), loaded with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions
from torch.utils._pytree import tree_map
from torchft.checkpointing import CheckpointTransport  # type: ignore[import-untyped]
from torchft.checkpointing._serialization import (  # type: ignore[import-untyped]
    _streaming_load,
    _streaming_save,
)
from torchft.process_group import ProcessGroupGloo  # type: ignore[import-untyped]
from torchft.work import _DummyWork  # type: ignore[import-untyped]

from replicator.comm.shared_memory import SharedMemoryAllReduce
from replicator.comm.shm_segment import (
    all_on_this_host,
    flag_barrier_is_safe,
    shared_memory_problem,
)
from replicator.errors import ReplicatorError

log = logging.getLogger("replicator")
logger = logging.getLogger(__name__)


class LiveProcessGroup(ProcessGroupGloo):  # type: ignore[misc]
    """torchft's ``ProcessGroupGloo`` with a same-host shared-memory sum (see the module doc);
    ``transport``: one of ``LiveSettings``' (checked there)."""

    def __init__(self, timeout: timedelta, transport: str = "auto") -> None:
        super().__init__(timeout=timeout)
        self._transport = transport
        self._shared: SharedMemoryAllReduce | None = None
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._error: BaseException | None = None

    @property
    def uses_shared_memory(self) -> bool:
        """True while this configuration sums through a shared-memory segment."""
        return self._shared is not None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  *args: Any, **kwargs: Any) -> None:
        """torchft's reconfiguration, then whether every member can sum through a new segment
        (new at each quorum change: a healed group never meets an old one's counters)."""
        self._drop_shared()
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        if self._transport == "gloo" or world_size < 2:
            return
        usable = flag_barrier_is_safe() and not shared_memory_problem()
        if not all_on_this_host(self.parent, usable):
            return
        shared = SharedMemoryAllReduce(timeout_seconds=self._timeout.total_seconds())
        try:  # a collective that fails on every member alike (a full /dev/shm, say)
            shared.channel(self.parent)
        except ReplicatorError as exc:
            log.warning("the replica groups sum through gloo: %s", exc)
            return
        self._shared = shared
        log.info("the %d replica groups sum through shared memory", world_size)

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor to sum in place: in this configuration's segment where shared memory
        is used (no copy in or out), else ordinary memory. Every member asks for the same
        sizes in the same order (the first ask of a size is a collective)."""
        shared = self._shared
        if shared is None or device.type != "cpu" or self._error is not None:
            return torch.empty(numel, dtype=dtype, device=device)
        found = self._buffers.get((numel, dtype))
        if found is None:
            try:
                found = shared.make_buffers([(numel, dtype, device)], self.parent)[0]
            except Exception as exc:  # noqa: BLE001 - a peer lost while the segment was made
                # the sum that follows raises inside torchft's all-reduce, which skips the step
                self._error = exc
                return torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(numel, dtype)] = found
        return found

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        shared = self._shared
        if shared is None or not _summable(tensors, opts):
            return super().allreduce(tensors, opts)
        if self._error is not None:  # the segment's counters no longer agree: torchft reconfigures
            raise ReplicatorError(f"the shared-memory sum across replica groups failed before "
                                  f"in this quorum: {self._error}")
        try:
            for tensor in tensors:
                shared.all_reduce_sum(tensor, self.parent)
        except Exception as exc:
            self._error = exc
            raise
        return _DummyWork(tensors)

    def abort(self, errored: bool = True) -> None:
        self._drop_shared()
        super().abort(errored)

    def shutdown(self) -> None:
        self._drop_shared()
        super().shutdown()

    def _drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.forget_groups()
        self._shared, self._error = None, None
        self._buffers.clear()


def _summable(tensors: list[torch.Tensor], opts: Any) -> bool:
    """A sum of contiguous CPU floating-point tensors (every member decides alike)."""
    op = opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
    return op == dist.ReduceOp.SUM and all(
        t.device.type == "cpu" and t.is_floating_point() and t.is_contiguous()
        for t in tensors)


# -- the checkpoint transport ----------------------------------------------------------------

class _StateHandler(BaseHTTPRequestHandler):
    """``GET /checkpoint/<step>/full``: the state of ``step`` while it is served."""

    server: _StateServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        transport = self.server.transport
        self.connection.settimeout(transport.timeout_s)
        parts = self.path.split("/")
        if len(parts) != 4 or parts[1] != "checkpoint" or not parts[2].lstrip("-").isdigit():
            self.send_error(400, f"expected /checkpoint/<step>/full, got {self.path}")
            return
        state = transport.begin_read(int(parts[2]))
        if isinstance(state, str):
            self.send_error(400 if "serving" in state else 503, state)
            return
        try:
            self.send_response(200)
            self.send_header("Content-type", "application/octet-stream")
            self.end_headers()
            _streaming_save(state, self.wfile)
        except OSError as exc:  # the healing group went away mid-transfer
            logger.debug("a state transfer to %s ended early: %s", self.address_string(), exc)
        finally:
            transport.end_read()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        """A request's access-log line at debug level (not http.server's stderr line)."""
        logger.debug("%s %s", self.address_string(), format % args)


class _StateServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, host: str, transport: BoundHTTPTransport) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.transport = transport
        super().__init__((host, 0), _StateHandler)


class BoundHTTPTransport(CheckpointTransport[Any]):
    """torchft's checkpoint transport served on ``host`` only, between ``send_checkpoint`` and
    ``disallow_checkpoint`` (a state is never read while the next step changes it)."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self._host = host
        self.timeout_s = timeout.total_seconds()
        self._cond = threading.Condition()
        self._state: Any = None
        self._step: int | None = None  # the step served; None: nothing served now
        self._readers = 0
        self._shut = False
        #: Seconds the last received state took to arrive (what a healing group waited for).
        self.last_recv_seconds: float | None = None
        self._server = _StateServer(host, self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="replicator-live-state-server")
        self._thread.start()

    # -- the serving side ------------------------------------------------------------------------
    def begin_read(self, step: int) -> Any:
        """The state of ``step`` for one fetch (ended by :meth:`end_read`), or why not (text)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._step is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"no state was offered within {self.timeout_s:.0f} s"
                self._cond.wait(left)
            if step != self._step:
                return f"serving the state of step {self._step}, not of step {step}"
            self._readers += 1
            return self._state

    def end_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def metadata(self) -> str:
        """Where a healing group fetches the state (the step and ``/full`` follow)."""
        port = self._server.socket.getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        """Serve ``state_dict`` as step ``step`` (a device's tensors copied to the CPU first)."""
        on_cpu = tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state_dict)
        with self._cond:
            self._state, self._step = on_cpu, step
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving, once no fetch reads the state (or after the timeout)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            self._step = None
            while self._readers and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._state = None

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and close the server (idempotent); ``wait``: for fetches in flight."""
        if self._shut:
            return
        self._shut = True
        if wait:
            self.disallow_checkpoint()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(self.timeout_s)

    # -- the receiving side ----------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(f"{metadata}{step}/full",
                                        timeout=timeout.total_seconds()) as f:
                return cast(object, _streaming_load(f, weights_only=True))
        finally:
            self.last_recv_seconds = time.perf_counter() - start
