"""Test set-up: keep every tool's files inside a temporary folder, never in $HOME."""

from __future__ import annotations

import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="replicator-tests-")
for var, sub in (("SCIKIT_LEARN_DATA", "sklearn"), ("MPLCONFIGDIR", "mpl")):
    os.environ.setdefault(var, os.path.join(_TMP, sub))
os.environ.setdefault("REPLICATOR_TIMEOUT_SECONDS", "60")
