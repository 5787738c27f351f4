"""Listening sockets for the rendezvous store (loopback by default, clear errors when busy) and
the network interface gloo uses: the one whose address routes to the master."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping

from replicator.errors import ClusterConfigError

LOOPBACK = "127.0.0.1"
#: The rendezvous port of a multi-node or SLURM job when none is given (torchrun's).
DEFAULT_MASTER_PORT = 29500
#: The highest TCP port number.
MAX_PORT = 65535


def check_port(port: object, flag: str = "--master-port") -> int | None:
    """A user's rendezvous port (``None``: the OS picks), refused with a hint outside 1..65535."""
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


_SIOCGIFADDR = 0x8915


def _interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (``None`` if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


def local_address_towards(host: str, family: int = socket.AF_UNSPEC) -> str:
    """This machine's address on the route to ``host`` (a UDP ``connect`` sends nothing);
    ``OSError`` when there is none."""
    target = socket.getaddrinfo(host, 9, family, socket.SOCK_DGRAM)[0]
    with socket.socket(target[0], socket.SOCK_DGRAM) as s:
        s.connect(target[4])
        return str(s.getsockname()[0])


def interface_towards(addr: str) -> str | None:
    """The local interface that traffic to ``addr`` leaves from, if found."""
    try:
        local = local_address_towards(addr, socket.AF_INET)
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _interface_address(name) == local:
            return name
    return None


def choose_gloo_interface(master_addr: str,
                          env: MutableMapping[str, str] | None = None) -> str | None:
    """Point gloo at the interface towards a non-loopback ``master_addr`` unless
    ``GLOO_SOCKET_IFNAME`` is set (gloo's own choice picks the wrong network on a multi-homed
    machine); the interface now in force, if any."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    if target.get("GLOO_SOCKET_IFNAME"):
        return target["GLOO_SOCKET_IFNAME"]
    if is_loopback(master_addr):
        return None
    interface = interface_towards(master_addr)
    if interface:
        target["GLOO_SOCKET_IFNAME"] = interface
    return interface
