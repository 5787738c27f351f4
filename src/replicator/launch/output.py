"""The launcher's output relay: every worker's stdout and stderr, line by line, rank-prefixed.

One thread per pipe drains it (no worker blocks on a full pipe) and writes whole lines under one
lock, so ranks never interleave mid-line. A ``\\r`` update (a progress bar) is drawn in place
behind its prefix; another rank's line clears it, is written, and redraws it.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import IO, Any

from replicator.cluster.terminal import TTY_COMPATIBLE_ENV, isatty

#: What erases the current terminal line (rich writes it after each ``\r``).
_ERASE_LINE = b"\x1b[2K"
#: Seconds to wait for a pipe's last bytes once its worker ended.
DRAIN_SECONDS = 5.0


def rank_prefix(rank: int) -> str:
    """The prefix of a worker's lines: ``[rank 3] ``."""
    return f"[rank {rank}] "


def terminal_env(rank: int, world: int, stream: IO[Any] | None = None) -> dict[str, str]:
    """For a relayed worker on a terminal: the columns left after the prefix, and for the
    chief ``TTY_COMPATIBLE=1`` (rich honours it), so a progress bar redraws one line."""
    if not isatty(sys.stdout if stream is None else stream):
        return {}
    columns = shutil.get_terminal_size().columns
    env = {"COLUMNS": str(max(20, columns - len(rank_prefix(world - 1))))}
    if rank == 0:
        env[TTY_COMPATIBLE_ENV] = "1"
    return env


class _Sink:
    """One of the launcher's own streams, written as bytes."""

    def __init__(self, stream: IO[Any]) -> None:
        self.stream = stream
        self.tty = isatty(stream)

    def write(self, data: bytes) -> None:
        buffer = getattr(self.stream, "buffer", None)
        try:
            if buffer is not None:
                self.stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                self.stream.write(data.decode("utf-8", "replace"))
                self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed terminal must not kill the relay (the workers still need draining)


class OutputRelay:
    """Copy workers' pipes to the launcher's stdout/stderr; see the module doc."""

    def __init__(self, stdout: IO[Any] | None = None, stderr: IO[Any] | None = None) -> None:
        self._sinks = {"stdout": _Sink(stdout or sys.stdout), "stderr": _Sink(stderr or sys.stderr)}
        self._lock = threading.RLock()  # a SIGTERM handler may print while the lock is held
        self._threads: list[tuple[str | None, threading.Thread]] = []
        #: The line being redrawn in place: (sink name, bytes shown), or None.
        self._live: tuple[str, bytes] | None = None

    def attach(self, rank: int, pipe: IO[bytes] | None, stream: str, *,
               label: str | None = None, group: str | None = None) -> None:
        """Start draining ``pipe`` into ``stream``; ``label`` replaces ``rank R`` in the prefix,
        ``group`` names the pipes :meth:`drain` can wait for alone."""
        if pipe is None:
            return
        head = (f"[{label}] " if label is not None else rank_prefix(rank)).encode()
        thread = threading.Thread(target=self._pump, args=(pipe, head, stream),
                                  name=f"replicator-relay-{rank}-{stream}", daemon=True)
        thread.start()
        with self._lock:
            self._threads.append((group, thread))

    def drain(self, timeout: float = DRAIN_SECONDS, group: str | None = None) -> None:
        """Wait (at most ``timeout``) until the pipes (of ``group``) reached their end; one still
        open (a grandchild holds it) is left relaying in the background."""
        deadline = time.monotonic() + timeout
        with self._lock:
            mine = [t for g, t in self._threads if group is None or g == group]
        for thread in mine:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._threads = [(g, t) for g, t in self._threads if t.is_alive()]
            if group is None:  # another group's line being redrawn stays live
                self._end_live()

    def emit(self, text: str, stream: str = "stderr") -> None:
        """Write a launcher message of whole lines, never inside a worker's line."""
        self._write(stream, text.encode() if text.endswith("\n") else (text + "\n").encode())

    # -- the pumps -------------------------------------------------------------------------------
    def _pump(self, pipe: IO[bytes], head: bytes, stream: str) -> None:
        fd = pipe.fileno()
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                pending = self._relay(pending + chunk, head, stream)
        finally:
            if pending.strip(b"\r"):
                self._relay(pending + b"\n", head, stream)
            try:
                pipe.close()
            except OSError:
                pass

    def _relay(self, data: bytes, head: bytes, stream: str) -> bytes:
        """Write the whole lines of ``data``; draw a pending ``\\r`` update; return the rest."""
        *lines, rest = data.split(b"\n")
        if lines:
            out = b"".join(head + _visible(line) + b"\n" for line in lines)
            self._write(stream, out, replace_live=(stream, head))
        if b"\r" in rest:
            shown = _visible(rest)
            rest = rest[rest.rfind(b"\r"):]
            if shown:
                self._draw_live(stream, head + shown)
        return rest

    # -- writing, under the lock ----------------------------------------------------------------
    def _write(self, stream: str, data: bytes, replace_live: tuple[str, bytes] | None = None
               ) -> None:
        with self._lock:
            sink, live = self._sinks[stream], self._live
            if live is None:
                sink.write(data)
                return
            live_sink = self._sinks[live[0]]
            if replace_live is not None and live[0] == replace_live[0] \
                    and live[1].startswith(replace_live[1]):
                # The live line's own stream ends it: its final state replaces it in place.
                live_sink.write(b"\r" + _ERASE_LINE if live_sink.tty else b"\r")
                self._live = None
                sink.write(data)
            elif live_sink.tty:
                # Another rank's line: clear the live line, write above it, draw it again.
                live_sink.write(b"\r" + _ERASE_LINE)
                sink.write(data)
                live_sink.write(live[1])
            else:
                live_sink.write(b"\n")
                self._live = None
                sink.write(data)

    def _draw_live(self, stream: str, line: bytes) -> None:
        with self._lock:
            live = self._live
            if live is not None and live[0] != stream:
                self._end_live()
            sink = self._sinks[stream]
            if sink.tty:
                sink.write(b"\r" + _ERASE_LINE + line)
            elif live is not None and live[0] == stream:
                sink.write(b"\r" + line)
            else:
                sink.write(line)
            self._live = (stream, line)

    def _end_live(self) -> None:
        if self._live is not None:
            self._sinks[self._live[0]].write(b"\n")
            self._live = None


def _visible(line: bytes) -> bytes:
    """What a terminal shows of ``line``: its last non-empty ``\\r`` segment, no erase code."""
    if b"\r" not in line:
        return line
    parts = [p for p in line.split(b"\r") if p]
    text = parts[-1] if parts else b""
    while text.startswith(_ERASE_LINE):
        text = text[len(_ERASE_LINE):]
    return text
