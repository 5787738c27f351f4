"""Test set-up: keep every tool's files inside a temporary folder, never in $HOME."""

from __future__ import annotations

import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="replicator-tests-")
for var, sub in (("SCIKIT_LEARN_DATA", "sklearn"), ("MPLCONFIGDIR", "mpl")):
    os.environ.setdefault(var, os.path.join(_TMP, sub))
os.environ.setdefault("REPLICATOR_TIMEOUT_SECONDS", "60")
# Every worker a test starts imports the test module, hence pytest: once, in the forkserver.
os.environ.setdefault("REPLICATOR_PRELOAD", "pytest")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (a browser, long trainings)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only when asked: ``--run-slow`` or ``-m slow``."""
    import pytest

    if config.getoption("--run-slow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (or -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
