"""Workers forked from a warm forkserver: how ``rp.launch`` and ``replicator run`` start one.

A fresh interpreter takes 3-4 s to import torch on a quiet 2-core machine and 10-25 s on a busy
one, for every worker and restart; a fork of a server that imported it once starts in a
fraction of a second. :func:`become_worker` puts back what a fresh interpreter would have.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.reduction
import os
import sys
from multiprocessing import forkserver
from typing import Any

#: Modules the forkserver imports once, before it forks any worker: torch and the rooms a
#: training script uses (``import replicator`` itself imports none of them), and
#: ``torch._dynamo``, which every ``torch.optim`` optimizer imports when it is made (0.6-2 s a
#: worker). Only what nearly every worker imports: the server's import is on the way of a
#: one-off launch, where fresh workers would import in parallel (DCP or pipelining, about 0.6 s
#: each, are imported by the workers that use them).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "replicator.strategies",
                      "replicator.train", "replicator.resume", "replicator.ps",
                      "replicator.callbacks", "replicator.testing")

#: The variable naming more modules for the server to import (read when the server starts).
PRELOAD_VARIABLE = "REPLICATOR_PRELOAD"

#: The start methods a launcher offers: a warm forkserver, or a fresh interpreter per worker.
START_METHODS = ("forkserver", "spawn")


def check_start_method(method: Any, allowed: tuple[str, ...] = START_METHODS) -> str:
    """``method`` if it is one of ``allowed``, else a ValueError that lists them."""
    if method not in allowed:
        raise ValueError(f"start_method must be one of {', '.join(map(repr, allowed))}; got "
                         f"{method!r}")
    return str(method)


def forkserver_context() -> Any:
    """The forkserver context, preloading :data:`FORKSERVER_PRELOAD` and the modules named in
    ``REPLICATOR_PRELOAD`` (comma-separated: a script's own heavy imports, ``transformers``
    takes 3-5 s), started now so that its imports (3-4 s) overlap the launcher's own set-up."""
    ctx = mp.get_context("forkserver")
    named = [name.strip() for name in os.environ.get(PRELOAD_VARIABLE, "").split(",")]
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, *filter(None, named)])
    forkserver.ensure_running()
    return ctx


class StandardStreams:
    """The fds 0-2 a forked worker takes (a forkserver's children would inherit the server's);
    pickled at start they travel with it (``DupFd``), so the caller may then close its copies."""

    def __init__(self, stdin: int = 0, stdout: int = 1, stderr: int = 2) -> None:
        self.fds = (stdin, stdout, stderr)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReceivedStreams, tuple(mp.reduction.DupFd(fd) for fd in self.fds))


class _ReceivedStreams:
    """The worker's side of :class:`StandardStreams`."""

    def __init__(self, *received: Any) -> None:
        self._fds = tuple(fd.detach() for fd in received)

    def install(self) -> None:
        for target, fd in enumerate(self._fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        # as ``python -u`` gives a fresh worker: a line reaches the relay when it is written
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      line_buffering=True, errors="backslashreplace")


def become_worker(env: dict[str, str], cwd: str, streams: Any = None) -> None:
    """In a forked worker: the launcher's streams, environment and directory, as if fresh."""
    if isinstance(streams, _ReceivedStreams):
        streams.install()
    # exactly the launcher's environment: the server's may hold variables unset since
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    os.chdir(cwd)
    mp.set_start_method(None, force=True)  # unset, as in a fresh interpreter
    if "numpy" in sys.modules:  # every fork would otherwise draw the server's numbers
        import numpy

        numpy.random.seed()
