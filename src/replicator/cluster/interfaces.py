"""Which network interface gloo uses: the one whose address routes to the master. Used by
strategies and by :mod:`replicator.launch.multi_node`, so it lives apart from the launcher.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping

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


def interface_towards(addr: str) -> str | None:
    """The local interface that traffic to ``addr`` leaves from, if found (a UDP ``connect``
    asks the routing table and sends nothing)."""
    try:
        target = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _interface_address(name) == local:
            return name
    return None


def choose_gloo_interface(master_addr: str,
                          env: MutableMapping[str, str] | None = None) -> str | None:
    """Point gloo at the interface towards ``master_addr`` unless ``GLOO_SOCKET_IFNAME`` is set
    (gloo would resolve the hostname, which picks the wrong network on a multi-homed machine).
    Loopback masters are left alone. Returns the interface now in force, if any.
    """
    target: MutableMapping[str, str] = os.environ if env is None else env
    if target.get("GLOO_SOCKET_IFNAME"):
        return target["GLOO_SOCKET_IFNAME"]
    if master_addr.startswith("127.") or master_addr in ("localhost", "::1"):
        return None
    interface = interface_towards(master_addr)
    if interface:
        target["GLOO_SOCKET_IFNAME"] = interface
    return interface


__all__ = ["interface_towards", "choose_gloo_interface"]
