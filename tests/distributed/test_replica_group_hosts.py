"""Replica groups on two network hosts (namespaces on one bridge, tests/hosts.py).

Host 0 runs `replicator run --replica-groups 1` with the lighthouse on its network address;
host 1 joins with `replicator run --join HOST0:PORT` (it gets group id 1 from the lighthouse).
Mid-run host 1's link is cut (its veth port set down): host 0 goes on training alone; when the
link returns, host 1's group heals from host 0 and both end equal to one device. The groups
sum through gloo, as on separate machines (the namespaces share one /dev/shm).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from replicator.launch.lighthouse import torchft_missing
from replicator.testing import assert_params_close
from tests.hosts import Network, namespaces_unavailable, virtual_hosts
from tests.live_helpers import SCRIPT as LIVE_TRAIN
from tests.live_helpers import env as live_env
from tests.live_helpers import one_device

_WHY = namespaces_unavailable() or torchft_missing()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cannot run: {_WHY}")

#: 120 steps (3 epochs of 40 global batches of 24); slowed so the cut and the heal land
#: mid-run, until group 1 has healed after the cut (the file HEALED): the steps after that
#: run at full speed, both groups together.
TRAIN_ARGS = ["--samples", "960", "--epochs", "3"]
HEALED = "healed_after_the_cut"
SLOW = ["--step-seconds", "0.4", "--slow-until", HEALED]
LIGHTHOUSE_PORT = 29510  # inside host 0's own namespace: no other job can hold it


def _progress(out: Path, group: int) -> int:
    try:
        return int((out / f"progress_g{group}.txt").read_text() or -1)
    except (OSError, ValueError):
        return -1


def _wait(what: str, condition, procs: list[subprocess.Popen], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            texts = [p.communicate()[0][-3000:] for p in procs if p.poll() is not None]
            pytest.fail(f"a host's launcher ended before {what}:\n" + "\n---\n".join(texts))
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _link(net: Network, host: int, state: str) -> None:
    subprocess.run(["ip", "-n", net.switch, "link", "set", net.hosts[host].switch_port, state],
                   check=True, capture_output=True, timeout=30)


@pytest.mark.timeout(600, method="signal")
def test_a_cut_host_goes_on_without_its_peer_and_heals_when_the_link_returns(tmp_path):
    reference = one_device(tmp_path, TRAIN_ARGS)
    out = tmp_path / "groups"
    out.mkdir()
    # the namespaces share this machine's /dev/shm; separate hosts would sum through gloo
    env = {**live_env(), "REPLICATOR_LIVE_TIMEOUT_SECONDS": "5", "TMPDIR": str(tmp_path),
           "REPLICATOR_LIVE_TRANSPORT": "gloo"}
    run = [sys.executable, "-m", "replicator.cli", "run", "--nproc", "1", "--max-restarts", "4"]
    script = [str(LIVE_TRAIN), "--out", str(out), *TRAIN_ARGS, *SLOW]
    with virtual_hosts(2) as net:
        address = f"{net.hosts[0].address}:{LIGHTHOUSE_PORT}"
        procs = [net.hosts[0].popen(run + ["--replica-groups", "1", "--lighthouse-bind", address,
                                           *script], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)]
        _wait("group 0 to start", lambda: (out / "started_g0.txt").exists(), procs)
        procs.append(net.hosts[1].popen(run + ["--join", address, *script], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True))
        _wait("group 1 to train", lambda: _progress(out, 1) >= 10, procs)
        _link(net, 1, "down")
        cut_at = _progress(out, 0)
        _wait("host 0 to go on alone", lambda: _progress(out, 0) >= cut_at + 8, procs)
        assert _progress(out, 0) < 115, "host 0 nearly finished: the cut came too late"
        back_at = _progress(out, 0)
        _link(net, 1, "up")
        # group 1 commits nothing while cut off (the lighthouse is on host 0): it gets to host
        # 0's step of the link's return only by healing from host 0
        _wait("group 1 to heal after the cut", lambda: _progress(out, 1) >= back_at, procs)
        (out / HEALED).write_text("1")
        texts = []
        for proc in procs:
            text, _ = proc.communicate(timeout=300)
            texts.append(text)
        codes = [p.returncode for p in procs]
    host0, host1 = texts
    assert codes == [0, 0], f"exit codes {codes}\n{host0[-3000:]}\n---\n{host1[-4000:]}"
    assert f"started a torchft lighthouse at http://{address}" in host0
    assert f"using the torchft lighthouse at http://{address}" in host1
    assert "replica groups 1 of 1 process(es)" in host1  # --join took an unused id
    heals = [int(s) for s in re.findall(r"replica group 1, rank 0 healed from a live peer at "
                                        r"step (\d+)", host1)]
    assert heals and max(heals) > cut_at, (cut_at, heals, host1[-4000:])
    for g in (0, 1):
        assert_params_close(reference, torch.load(out / f"final_g{g}.pt"), atol=1e-5,
                            label=f"group {g}: ")
