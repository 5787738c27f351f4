"""Listening sockets for the rendezvous store: loopback by default, clear errors when busy."""

from __future__ import annotations

import errno
import socket

from replicator.errors import ClusterConfigError

LOOPBACK = "127.0.0.1"


def listen(addr: str, port: int) -> socket.socket:
    """Bind and listen on ``addr:port`` (port 0 picks a free one); the caller owns the socket.

    Binding to the named address, not to all interfaces, keeps a local job off the network.
    """
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
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ClusterConfigError(
                f"cannot listen on {addr}:{port}: that address is not on this machine. "
                "HINT: MASTER_ADDR must name this host on the chief.") from None
        raise
    sock.set_inheritable(True)
    return sock
