"""Listening sockets for the rendezvous store: loopback by default, clear errors when busy."""

from __future__ import annotations

import errno
import socket

from replicator.errors import ClusterConfigError

LOOPBACK = "127.0.0.1"
#: The highest TCP port number.
MAX_PORT = 65535


def check_port(port: object, flag: str = "--master-port") -> int | None:
    """Validate a rendezvous port chosen by the user (``None``: the OS picks): a
    :class:`ClusterConfigError` with a hint outside 1..65535, before a socket's ``OverflowError``.
    """
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int):
        raise ClusterConfigError(f"{flag} must be a port number, got {port!r}. HINT: a whole "
                                 f"number from 1 to {MAX_PORT}, or leave it out to let "
                                 "replicator choose a free port.")
    if not 1 <= port <= MAX_PORT:
        raise ClusterConfigError(f"{flag} {port} is not a TCP port (ports run from 1 to "
                                 f"{MAX_PORT}). HINT: pick one such as 29500, or leave it out "
                                 "to let replicator choose a free port.")
    return port


def listen(addr: str, port: int) -> socket.socket:
    """Bind and listen on ``addr:port`` (port 0: a free one; the caller owns the socket), on the
    named address only, so a local job stays off the network."""
    if port != 0:
        check_port(port, "port")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ClusterConfigError(
                f"port {port} on {addr} is already in use. HINT: pick another with "
                "--master-port (or MASTER_PORT), or omit it to let replicator choose a free one."
            ) from None
        if exc.errno == errno.EACCES:
            raise ClusterConfigError(
                f"no permission to listen on {addr}:{port} (ports below 1024 need root). "
                "HINT: pick a port above 1023, or omit --master-port.") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ClusterConfigError(
                f"cannot listen on {addr}:{port}: that address is not on this machine. "
                "HINT: MASTER_ADDR must name this host on the chief.") from None
        raise
    sock.set_inheritable(True)
    return sock
