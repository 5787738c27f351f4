"""The rooms' import layers (pyproject.toml's [tool.importlinter]) hold: `lint-imports` passes;
and `mypy src` and `ruff check` find nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    """The tool of this interpreter's environment (else on PATH); skips when it is absent."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_import_contracts_are_kept():
    out = _run(_tool("lint-imports"), "--no-cache", timeout=110)
    assert out.returncode == 0, f"lint-imports found broken contracts:\n{out.stdout}{out.stderr}"


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_src():
    out = _run(_tool("mypy"), "src", timeout=590)
    assert out.returncode == 0, f"mypy src:\n{out.stdout}{out.stderr}"


@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    out = _run(_tool("ruff"), "check", "src", "tests", "benchmarks", "examples", timeout=110)
    assert out.returncode == 0, f"ruff check:\n{out.stdout}{out.stderr}"
