"""Uninterrupted reference runs that tests in several modules compare with, each made once per
session: the same script with the same arguments on the same number of processes trains the
same bits every time, so one run serves every comparison."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def backup_reference(tmp_path_factory) -> Path:
    """tests/scripts/backup_train.py on 2 processes, 100 steps with a backup every 10, never
    interrupted: its output folder (the step logs and ``final-r{rank}.safetensors``)."""
    from tests.distributed.test_fault_tolerance import _run

    root = tmp_path_factory.mktemp("backup-reference")
    _run(root / "out", root / "backup", max_restarts=0)
    return root / "out"


@pytest.fixture(scope="session")
def sharded_reference(tmp_path_factory) -> Callable[[str], Path]:
    """``get(layout)``: the output folder of tests/scripts/sharded_backup_train.py with that
    layout (30 steps, a backup every 10), never interrupted; run at the first request."""
    from tests.distributed.test_fault_tolerance import _run_sharded

    refs: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in refs:
            root = tmp_path_factory.mktemp(f"sharded-{layout}")
            _run_sharded(root / "out", root / "backup", layout, max_restarts=0)
            refs[layout] = root / "out"
        return refs[layout]

    return get
