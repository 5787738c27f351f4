"""torchft's lighthouse (its quorum service) for replica groups: start, wait until it answers, stop.
It has no authentication, so it listens on loopback unless told otherwise."""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from replicator.cluster.env_names import REPLICA_ID_FORMAT
from replicator.cluster.ports import LOOPBACK, check_port
from replicator.errors import ClusterConfigError, LighthouseError

#: Seconds the lighthouse may take to start answering (it starts in well under a second).
START_TIMEOUT_SECONDS = 60.0
#: Seconds a running lighthouse gets to stop after SIGTERM, before SIGKILL.
STOP_GRACE_SECONDS = 5.0
#: How the missing optional dependency is installed.
INSTALL_HINT = "pip install 'replicator[live]'"
_LISTENING = re.compile(r"listening on:?\s+\S+?:(\d+)\s*$")
_LOG_DIRECTIVE = "torchft::lighthouse=info"


def torchft_missing() -> str | None:
    """Why replica groups cannot run here (torchft is not installed), or ``None``."""
    if importlib.util.find_spec("torchft") is None:
        return (f"--replica-groups needs torchft (live recovery across replica groups), which "
                f"is not installed. HINT: {INSTALL_HINT}, or leave out --replica-groups to "
                "run one group that restarts as a whole.")
    return None


def require_torchft() -> None:
    """Raise :class:`ClusterConfigError` naming the install command when torchft is missing."""
    why = torchft_missing()
    if why is not None:
        raise ClusterConfigError(why)


def lighthouse_command() -> list[str]:
    """The ``torchft_lighthouse`` command: beside this interpreter, on PATH, or run by it."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("torchft_lighthouse")
    if found:
        return [found]
    require_torchft()
    return [sys.executable, "-c", "import sys; from torchft._torchft import lighthouse_main; "
            "sys.argv[0] = 'torchft_lighthouse'; sys.exit(lighthouse_main())"]


def parse_address(text: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    """``"HOST:PORT"`` (also ``http://HOST:PORT``, ``[::1]:PORT``) -> ``(host, port)``."""
    body = re.sub(r"^https?://", "", text.strip()).rstrip("/")
    match = re.fullmatch(r"\[(?P<v6>[0-9a-fA-F:.]+)\](?::(?P<p6>\d+))?|"
                         r"(?P<host>[^:\s/\[\]]+)(?::(?P<port>\d+))?", body)
    if not match:
        raise ClusterConfigError(f"{flag} {text!r} is not HOST:PORT. HINT: e.g. {flag} "
                                 f"127.0.0.1:29510 or {flag} 10.0.0.1:29510.")
    host = match["v6"] or match["host"]
    port_text = match["p6"] or match["port"]
    if port_text is None:
        if default_port is None:
            raise ClusterConfigError(f"{flag} {text!r} has no port. HINT: write HOST:PORT, "
                                     f"e.g. {flag} {host}:29510.")
        return host, default_port
    port = int(port_text)
    if port != 0 or default_port is None:
        check_port(port, flag)
    return host, port


def url_of(host: str, port: int) -> str:
    """``http://HOST:PORT`` (IPv6 hosts in brackets), the form torchft's clients take."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def wait_reachable(url: str, timeout: float, flag: str = "--lighthouse") -> str:
    """The ``/status`` page of the lighthouse at ``url`` once it answers (at most ``timeout``
    s)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=max(
                    1.0, min(5.0, deadline - time.monotonic()))) as resp:
                return resp.read().decode("utf-8", "replace")
        except (OSError, urllib.error.URLError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise LighthouseError(
                f"the lighthouse at {url} ({flag}) did not answer within {timeout:.0f} s "
                f"({last}). HINT: is it running, and is this address reachable from here? "
                "Start it with `replicator run --replica-groups N ...` (which prints its "
                "address) or `torchft_lighthouse --min_replicas 1 --bind ADDR:PORT`.")
        time.sleep(0.2)


def seen_group_ids(page: str) -> set[int]:
    """The replica-group ids (of :data:`REPLICA_ID_FORMAT`) a status page names."""
    prefix, suffix = REPLICA_ID_FORMAT.split("{group}")
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + r"(?=:)")
    return {int(m.group(1)) for m in pattern.finditer(page)}


def foreign_replicas(page: str) -> bool:
    """True when the status page lists replicas whose ids replicator did not make."""
    ids = re.findall(r"^\s*([^\s<>:]+):[0-9a-f-]{36}: seen", page, flags=re.MULTILINE)
    prefix = REPLICA_ID_FORMAT.split("{group}")[0]
    return any(not i.startswith(prefix) for i in ids)


@dataclass
class LighthouseSettings:
    """What the lighthouse is started with (torchft's flags, in seconds here)."""

    min_replicas: int = 1
    #: How long a quorum waits for groups that heartbeat but have not asked to join yet.
    join_timeout: float = 60.0
    #: How long without a heartbeat before a group counts as gone.
    heartbeat_timeout: float = 2.0
    quorum_tick: float = 0.1

    def argv(self, bind: str) -> list[str]:
        return ["--min_replicas", str(self.min_replicas), "--bind", bind,
                "--join_timeout_ms", str(int(self.join_timeout * 1000)),
                "--heartbeat_timeout_ms", str(int(self.heartbeat_timeout * 1000)),
                "--quorum_tick_ms", str(max(1, int(self.quorum_tick * 1000)))]


class Lighthouse:
    """A ``torchft_lighthouse`` process this launcher owns; see the module doc."""

    def __init__(self, host: str = LOOPBACK, port: int = 0,
                 settings: LighthouseSettings | None = None) -> None:
        self.host = host
        self.requested_port = port
        self.settings = settings or LighthouseSettings()
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=40)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where the groups reach it: ``http://HOST:PORT`` (loopback when bound to all)."""
        if self.port is None:
            raise LighthouseError("internal error: the lighthouse has not started")
        host = {"0.0.0.0": LOOPBACK, "::": "::1", "": LOOPBACK}.get(self.host, self.host)
        return url_of(host, self.port)

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> str:
        """Start the lighthouse and wait until it answers; return its URL."""
        bind = url_of(self.host, self.requested_port).removeprefix("http://")
        user_log = os.environ.get("RUST_LOG")  # its "listening on" line must be logged
        env = dict(os.environ, RUST_LOG=f"{user_log},{_LOG_DIRECTIVE}" if user_log
                   else "info")
        self.proc = subprocess.Popen(lighthouse_command() + self.settings.argv(bind),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="replicator-lighthouse-log",
                                        daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                self._reader.join(2.0)
                raise self._start_error()
            if time.monotonic() > deadline:
                self.stop()
                raise LighthouseError(
                    f"the lighthouse on {bind} did not start within {timeout:.0f} s. Its last "
                    f"lines:\n{self.tail()}")
        wait_reachable(self.url, max(1.0, deadline - time.monotonic()), "the lighthouse")
        return self.url

    def _read(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self._lines.append(line)
            match = _LISTENING.search(line)
            if match and not self._ready.is_set():
                self.port = int(match.group(1))
                self._ready.set()

    def _start_error(self) -> Exception:
        text = self.tail()
        where = f"{self.host}:{self.requested_port}"
        if "Address already in use" in text:
            return ClusterConfigError(
                f"port {self.requested_port} on {self.host} is already in use, so the "
                "lighthouse cannot listen there. HINT: pick another port with "
                f"--lighthouse-bind {self.host}:PORT, leave the port out to let replicator "
                "choose a free one, or use the lighthouse already running there with "
                f"--lighthouse {where}.")
        if "Cannot assign requested address" in text or "lookup address" in text:
            return ClusterConfigError(
                f"the lighthouse cannot listen on {where}: that address is not on this "
                "machine. HINT: --lighthouse-bind takes one of this machine's addresses "
                "(127.0.0.1 by default).")
        if "Permission denied" in text:
            return ClusterConfigError(
                f"no permission to listen on {where} (ports below 1024 need root). HINT: pick "
                "a port above 1023, or leave the port out.")
        code = self.proc.poll() if self.proc is not None else None
        return LighthouseError(f"the lighthouse exited at start (exit code {code}). Its last "
                               f"lines:\n{text}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        """The lighthouse's last log lines (for error messages)."""
        return "\n".join(list(self._lines)[-lines:]) or "(no output)"

    def stop(self) -> None:
        """Stop the lighthouse (SIGTERM, then SIGKILL); a no-op when it is not running."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
        if self._reader is not None:
            self._reader.join(2.0)


__all__ = ["Lighthouse", "LighthouseSettings", "torchft_missing", "require_torchft",
           "lighthouse_command", "parse_address", "url_of", "wait_reachable", "seen_group_ids",
           "foreign_replicas", "INSTALL_HINT"]
