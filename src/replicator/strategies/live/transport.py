"""The checkpoint transport a healing group fetches a peer's state through: torchft's
``CheckpointTransport`` over HTTP, unlike torchft's ``HTTPTransport`` listening on one address
(``REPLICATOR_LIVE_BIND``, loopback by default) and loading with ``weights_only=True``. A state
is served only between ``send_checkpoint`` and ``disallow_checkpoint``, which waits for the
fetches in flight, so it is never read while the next step changes it.
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
from torch.utils._pytree import tree_map
from torchft.checkpointing import CheckpointTransport  # type: ignore[import-untyped]
from torchft.checkpointing._serialization import (  # type: ignore[import-untyped]
    _streaming_load,
    _streaming_save,
)

logger = logging.getLogger(__name__)


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
    """torchft's checkpoint transport served on ``host`` only (see the module doc)."""

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
        """Stop serving; returns once no fetch reads the state (or after the timeout, which
        cuts a stuck fetch's socket too)."""
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
