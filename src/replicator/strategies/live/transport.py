"""torchft's HTTP checkpoint transport, listening on one address and loading without pickle.

As shipped, ``HTTPTransport`` listens on every interface and loads with
``weights_only=False``; here it listens on the given address (``REPLICATOR_LIVE_BIND``) and
loads with ``weights_only=True`` (the state is tensors and plain values, ``state.py``).
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

import torchft.checkpointing.http_transport as http_transport  # type: ignore[import-untyped]
from torchft.checkpointing import HTTPTransport  # type: ignore[import-untyped]
from torchft.checkpointing._serialization import (  # type: ignore[import-untyped]
    _streaming_load,
)

_SERVER_CLASS_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


def _log_to_debug(handler: BaseHTTPRequestHandler, format: str, *args: Any) -> None:
    """A request's access-log line, at debug level of this module's logger (``http.server``
    writes it to stderr for every state a healing group fetches)."""
    logger.debug("%s %s", handler.address_string(), format % args)


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class BoundServer(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

        def __init__(self, server_address: Any, handler: Any) -> None:
            # torchft's request handler, its access log sent to logging instead of stderr
            quiet = type(handler.__name__, (handler,), {"log_message": _log_to_debug})
            super().__init__((host, 0), quiet)

    return BoundServer


class BoundHTTPTransport(HTTPTransport[Any]):
    """:class:`~torchft.checkpointing.HTTPTransport` on ``host`` only, loading tensors and
    plain values only (``weights_only=True``)."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self._host = host
        with _SERVER_CLASS_LOCK:  # torchft builds its server from this module-level name
            original = http_transport._IPv6HTTPServer
            http_transport._IPv6HTTPServer = _server_class(host)  # type: ignore[misc]
            try:
                super().__init__(timeout=timeout, num_chunks=0)
            finally:
                http_transport._IPv6HTTPServer = original  # type: ignore[misc]

    #: Seconds the last received state took to arrive (what a healing group waited for).
    last_recv_seconds: float | None = None

    def address(self) -> str:
        """Where a healing group fetches the state: the bound host (torchft's own answer is
        this machine's hostname, which need not resolve to the bound address)."""
        port = self._server.socket.getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        start = time.perf_counter()
        try:
            return super().recv_checkpoint(src_rank, metadata, step, timeout)
        finally:
            self.last_recv_seconds = time.perf_counter() - start

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return cast(object, _streaming_load(f, weights_only=True))
