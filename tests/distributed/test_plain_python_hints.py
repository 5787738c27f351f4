"""A script run with plain ``python`` is one process; a ParameterServerStrategy script needs
servers of its own, and the error says the command that starts them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PS_SCRIPT = '''
import torch
import replicator as rp

strategy = rp.ParameterServerStrategy(num_ps=1)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
'''


@pytest.mark.timeout(120)
def test_plain_python_parameter_server_script_names_the_num_ps_command(tmp_path) -> None:
    script = tmp_path / "ps_train.py"
    script.write_text(PS_SCRIPT)
    out = subprocess.run([sys.executable, "ps_train.py"], capture_output=True, text=True,
                         timeout=100, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode != 0
    assert "ClusterConfigError: num_ps=1 leaves no worker in a job of 1 process(es)" in out.stderr
    assert "`replicator run --nproc 2 --num-ps 1 ps_train.py`" in out.stderr, out.stderr
