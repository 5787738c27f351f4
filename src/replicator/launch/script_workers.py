"""Starting one worker of a script, forked from the warm forkserver or as a fresh
interpreter, its output relayed, inherited or dropped: the one way ``replicator run`` and its
replica groups start a script's process (:func:`script_starter`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

from replicator.launch.forked_start import StandardStreams, check_start_method, forkserver_context
from replicator.launch.output import OutputRelay


class _ForkedScript:
    """Forks each worker from the forkserver (:mod:`replicator.launch.forked_start`)."""

    def __init__(self, script: str, args: Sequence[str]) -> None:
        self.script = script
        self.args = list(args)
        self.ctx: Any = forkserver_context()

    def start(self, rank: int, env: dict[str, str], *, relay: OutputRelay | None = None,
              quiet: bool = False, label: str | None = None, group: str | None = None) -> Any:
        # imported here: ``python -m replicator.launch.script_entry`` (the fresh path) warns
        # when importing the package has already imported that module
        from replicator.launch.script_entry import forked_entry

        pipes: list[tuple[int, int]] = []
        ends: list[int] = []
        if quiet:
            ends = [os.open(os.devnull, os.O_WRONLY)]
            streams = StandardStreams(0, ends[0], ends[0])
        elif relay is not None:
            pipes = [os.pipe(), os.pipe()]
            ends = [w for _, w in pipes]
            streams = StandardStreams(0, *ends)
        else:
            streams = StandardStreams()
        proc = self.ctx.Process(target=forked_entry, name=f"replicator-rank{rank}",
                                args=(self.script, self.args, env, os.getcwd(), streams))
        try:
            proc.start()
        finally:
            for fd in ends:  # the worker holds its own copies now
                os.close(fd)
        if relay is not None:
            for (r, _), stream in zip(pipes, ("stdout", "stderr")):
                relay.attach(rank, os.fdopen(r, "rb"), stream, label=label, group=group)
        return proc


class _FreshScript:
    """Starts each worker as a fresh ``python -u`` interpreter."""

    def __init__(self, script: str, args: Sequence[str]) -> None:
        self.cmd = [sys.executable, "-u", "-m", "replicator.launch.script_entry", script,
                    *args]

    def start(self, rank: int, env: dict[str, str], *, relay: OutputRelay | None = None,
              quiet: bool = False, label: str | None = None, group: str | None = None) -> Any:
        if quiet:
            return subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        if relay is None:
            return subprocess.Popen(self.cmd, env=env)
        proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        pipes: tuple[IO[bytes] | None, IO[bytes] | None] = (proc.stdout, proc.stderr)
        for pipe, stream in zip(pipes, ("stdout", "stderr")):
            relay.attach(rank, pipe, stream, label=label, group=group)
        return proc


def script_starter(script: str, args: Sequence[str], start_method: str = "forkserver") -> Any:
    """What starts the workers of ``script args``: ``start(rank, env, relay=, quiet=, label=,
    group=)`` returns the worker's process (``quiet``: output dropped; no ``relay``: the
    launcher's own streams). ``start_method``: ``"forkserver"`` or ``"spawn"``."""
    method = check_start_method(start_method)
    return (_ForkedScript if method == "forkserver" else _FreshScript)(script, args)
