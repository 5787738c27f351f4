"""Network hosts on one machine for the multi-host tests: network namespaces on a bridge.

``virtual_hosts(n)`` builds a switch namespace holding a bridge, and ``n`` host namespaces,
each joined to the bridge by a veth pair (``eth0`` inside the host, ``h<i>`` on the switch) with
an address from a private range (``10.213.<k>.<i+1>/24``) that exists only inside these
namespaces. Each host's loopback is up and unlimited. Everything lives inside namespaces the
fixture creates, so deleting them removes every link and address; cleanup runs on exit, on
failure, on a pytest-timeout, at interpreter exit, and a later run deletes namespaces left by a
process that no longer exists (a test killed with SIGKILL).

Processes run on a host with ``host.popen(argv)``: inside its namespace, in their own process
group (killed at cleanup), with ``REPLICATOR_HOST`` naming the host and ``GLOO_SOCKET_IFNAME``
set to its interface, and with the UTS namespace unshared so ``hostname`` is the host's own name.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from replicator.cluster.processes import process_alive

#: Prefix of every namespace made here: ``rpnh<pid>x<n>-sw`` / ``-h<i>``.
PREFIX = "rpnh"
SUBNET = "10.213"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or ``None`` when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None




def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of this module whose creating process is gone; return their names."""
    out = _ip("netns", "list", check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid_text = name[len(PREFIX):].split("x", 1)[0]
        if pid_text.isdigit() and not process_alive(int(pid_text)):
            _kill_namespace_processes(name)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class Host:
    """One network host: a namespace, its interface and address."""

    index: int
    name: str
    netns: str
    address: str
    switch_port: str
    interface: str = "eth0"
    procs: list[subprocess.Popen] = field(default_factory=list)

    def env(self, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The environment of a process on this host (``extra`` values of ``None`` unset)."""
        env = dict(os.environ)
        env.update({"REPLICATOR_HOST": self.name, "GLOO_SOCKET_IFNAME": self.interface,
                    "PYTHONUNBUFFERED": "1"})
        for key, value in (extra or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host (its network and its own hostname)."""
        wrapped = ["ip", "netns", "exec", self.netns]
        if shutil.which("unshare"):
            wrapped += ["unshare", "--uts", "sh", "-c",
                        f'hostname {self.name} && exec "$@"', "sh"]
        return wrapped + list(argv)

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str | None] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` on this host in its own process group (killed at cleanup)."""
        proc = subprocess.Popen(self.command(argv), env=self.env(env), start_new_session=True,
                                **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host and wait (a short command such as ``tc``)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True,
                              text=True, timeout=timeout, check=True)

    def pids(self) -> list[int]:
        """Every process now inside this host's network namespace."""
        return [int(p) for p in _ip("netns", "pids", self.netns, check=False).stdout.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Kill every process of this host (its process groups and anything in its netns)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Network:
    """Hosts on one bridge, plus the switch namespace that holds the bridge."""

    hosts: list[Host]
    switch: str

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes through each host's link so far, ``{host: {"tx": sent, "rx": received}}``
        as the host sees it (read from the switch side of its veth pair)."""
        out = _ip("-n", self.switch, "-s", "-j", "link", "show").stdout
        stats = {item["ifname"]: item["stats64"] for item in json.loads(out)}
        result = {}
        for host in self.hosts:
            s = stats[host.switch_port]
            # the switch port receives what the host sends, and the other way round
            result[host.name] = {"tx": int(s["rx"]["bytes"]), "rx": int(s["tx"]["bytes"])}
        return result

    def limit_rate(self, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """A token-bucket limit of ``rate`` (``"1gbit"``, ``"100mbit"``) on each host's link,
        both directions; loopback inside a host stays unlimited."""
        for host in self.hosts:
            for ns, dev in ((host.netns, host.interface), (self.switch, host.switch_port)):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev,
                                "root", "tbf", "rate", rate, "burst", burst, "latency", latency],
                               check=True, capture_output=True, timeout=30)

    def clear_limits(self) -> None:
        for host in self.hosts:
            for ns, dev in ((host.netns, host.interface), (self.switch, host.switch_port)):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True, timeout=30)


_COUNTER = 0
_LIVE: list[Network] = []


def _teardown(net: Network) -> None:
    for host in net.hosts:
        host.kill_all()
        for proc in host.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    for ns in [h.netns for h in net.hosts] + [net.switch]:
        _kill_namespace_processes(ns)
        for _ in range(20):
            if _ip("netns", "delete", ns, check=False).returncode == 0 or \
                    ns not in _ip("netns", "list", check=False).stdout:
                break
            time.sleep(0.1)
    if net in _LIVE:
        _LIVE.remove(net)


def _teardown_all() -> None:
    for net in list(_LIVE):
        _teardown(net)


atexit.register(_teardown_all)


def create_network(n: int) -> Network:
    """Make ``n`` hosts on a bridge (see the module doc); undo with :func:`destroy_network`."""
    global _COUNTER
    remove_stale_namespaces()
    _COUNTER += 1
    tag = f"{PREFIX}{os.getpid()}x{_COUNTER}"
    subnet = f"{SUBNET}.{(os.getpid() + _COUNTER) % 250 + 1}"
    switch = f"{tag}-sw"
    net = Network(hosts=[], switch=switch)
    _LIVE.append(net)
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            ns = f"{tag}-h{i}"
            host = Host(index=i, name=f"host{i}", netns=ns, address=f"{subnet}.{i + 1}",
                        switch_port=f"h{i}")
            _ip("netns", "add", ns)
            net.hosts.append(host)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}",
                "netns", switch)
            _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", switch, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"h{i}", "up")
    except BaseException:
        _teardown(net)
        raise
    return net


def destroy_network(net: Network) -> None:
    """Kill every process on the hosts and delete their namespaces."""
    _teardown(net)


@contextmanager
def virtual_hosts(n: int) -> Iterator[Network]:
    """``n`` network hosts for the duration of the block, always removed afterwards."""
    net = create_network(n)
    try:
        yield net
    finally:
        destroy_network(net)
