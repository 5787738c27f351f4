"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing
page or an API reference that no longer resolves fails it), and, in the slow test, renders in
a real browser with a working search (``docs/check_site.py``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings")
    is None, reason="the docs extra is not installed: pip install -e '.[docs]'")


def _build(site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@needs_mkdocs
@pytest.mark.timeout(300)
def test_site_builds_strict_with_every_page_and_the_api_reference(tmp_path):
    done = _build(tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-5000:]}"
    site = tmp_path / "site"
    for page in ("index.html", "strategies/mirrored/index.html", "migration/ddp/index.html",
                 "troubleshooting/index.html", "reference/replicator/index.html"):
        assert (site / page).exists(), page
    api = (site / "reference" / "callbacks" / "index.html").read_text()
    assert "MLflowLogger" in api and "BackupAndRestore" in api
    assert "BackupAndRestore" in (site / "search" / "search_index.json").read_text()


@needs_mkdocs
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_site_renders_in_chromium_and_search_finds_backup_and_restore(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium: apt-get install -y chromium")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "check_site.py"),
                           "--out", str(tmp_path / "shots")],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for shot in ("home.png", "strategy.png", "api.png"):
        assert (tmp_path / "shots" / shot).stat().st_size > 10_000, shot
