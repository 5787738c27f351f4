"""Uninterrupted reference runs that tests in several modules compare with, each made once per
session: the same script with the same arguments on the same number of processes trains the
same bits every time, so one run serves every comparison, on every xdist worker (the first
worker that needs one makes it while the others wait for it, instead of each making its own)."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

#: How long a worker waits for another worker's reference run (longer than any of them takes).
LOCK_TIMEOUT_SECONDS = 300.0


def _session_root(tmp_path_factory) -> Path:
    """A folder of this session that every one of its xdist workers sees (each worker's base
    temporary folder is a child of the session's); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold ``lock`` (a file lock across processes), waiting at most LOCK_TIMEOUT_SECONDS."""
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another test worker held {lock} for more than "
                                       f"{LOCK_TIMEOUT_SECONDS:.0f} s while making {what}"
                                       ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _made_once(root: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``root/name``, filled by ``make(folder)`` once for the whole session; a run that failed
    leaves no mark, so the next test that asks makes it again (and fails the same way)."""
    folder, done = root / name, root / f"{name}.done"
    with _exclusive(root / f"{name}.lock", name):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def backup_reference(tmp_path_factory) -> Path:
    """tests/scripts/backup_train.py on 2 processes, 100 steps with a backup every 10, never
    interrupted: its output folder (the step logs and ``final-r{rank}.safetensors``)."""
    from tests.distributed.test_fault_tolerance import _run

    def make(root: Path) -> None:
        _run(root / "out", root / "backup", max_restarts=0)

    return _made_once(_session_root(tmp_path_factory), "backup-reference", make) / "out"


@pytest.fixture(scope="session")
def sharded_reference(tmp_path_factory) -> Callable[[str], Path]:
    """``get(layout)``: the output folder of tests/scripts/sharded_backup_train.py with that
    layout (30 steps, a backup every 10), never interrupted; run at the first request."""
    from tests.distributed.test_fault_tolerance import _run_sharded

    def get(layout: str) -> Path:
        def make(root: Path) -> None:
            _run_sharded(root / "out", root / "backup", layout, max_restarts=0)

        return _made_once(_session_root(tmp_path_factory), f"sharded-{layout}", make) / "out"

    return get
