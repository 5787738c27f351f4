"""The rooms' import layers (pyproject.toml's [tool.importlinter]) hold: `lint-imports` passes;
and `mypy src` finds nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> str | None:
    beside = Path(sys.executable).with_name("lint-imports")  # the tool of this interpreter
    return str(beside) if beside.exists() else shutil.which("lint-imports")


@pytest.mark.timeout(120)
def test_import_contracts_are_kept():
    tool = _lint_imports()
    if tool is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    out = subprocess.run([tool, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, f"lint-imports found broken contracts:\n{out.stdout}{out.stderr}"


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_src():
    beside = Path(sys.executable).with_name("mypy")
    tool = str(beside) if beside.exists() else shutil.which("mypy")
    if tool is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    out = subprocess.run([tool, "src"], cwd=ROOT, capture_output=True, text=True, timeout=590)
    assert out.returncode == 0, f"mypy src:\n{out.stdout}{out.stderr}"
