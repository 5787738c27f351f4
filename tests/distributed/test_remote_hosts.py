"""A host dies and the run goes on from the object store on another host.

Three network hosts (namespaces on a bridge, tests/hosts.py, always removed afterwards):
host2 serves S3 (moto's server on its own address, which exists only inside these
namespaces); host0 trains 2 workers with ``BackupAndRestore("s3://hosts/run")`` and is killed
whole (every process in it) after step 37; the same command on host1 resumes from the backup
of step 30 in the store and finishes with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# the script, steps and backups of the uninterrupted run shared with it (conftest.py)
from tests.distributed.test_fault_tolerance import SAVE_FREQ, SCRIPT, STEPS
from tests.hosts import namespaces_unavailable, virtual_hosts
from tests.s3_server import CREDENTIALS

PY = sys.executable
KILL_AFTER = 37

_WHY = namespaces_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces: {_WHY}")


def _last_step(out: Path) -> int:
    """The step every rank of the first run has logged (0 before both have begun)."""
    last = []
    for rank in (0, 1):
        log = out / f"log-a0-r{rank}.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        last.append(json.loads(lines[-1])["step"] if lines else 0)
    return min(last)


@pytest.mark.timeout(400, method="signal")
def test_a_killed_host_resumes_on_another_from_the_object_store(backup_reference, tmp_path):
    reference = backup_reference  # the same script, steps and backups, uninterrupted
    with virtual_hosts(3) as net:
        store = net.hosts[2]
        endpoint = f"http://{store.address}:9000"
        env = {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": endpoint, "TMPDIR": str(tmp_path),
               "REPLICATOR_JOB_ID": "run-ns"}  # one job, whichever host runs it
        store.popen([PY, "-m", "moto.server", "-H", store.address, "-p", "9000"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        make_bucket = (f"import s3fs; s3fs.S3FileSystem(endpoint_url={endpoint!r}, "
                       "skip_instance_cache=True).mkdir('hosts')")
        deadline = time.monotonic() + 90
        while True:  # the server is up once host0 can make the bucket through it
            made = subprocess.run(net.hosts[0].command([PY, "-c", make_bucket]),
                                  env=net.hosts[0].env(env), capture_output=True, timeout=60)
            if made.returncode == 0:
                break
            assert time.monotonic() < deadline, made.stderr.decode()[-2000:]
            time.sleep(0.5)
        out = tmp_path / "out"
        out.mkdir()
        command = [PY, "-m", "replicator.cli", "run", "--nproc", "2", "--timeout", "30",
                   SCRIPT, str(out), "s3://hosts/run", "--steps", str(STEPS), "--save-freq",
                   str(SAVE_FREQ)]
        # rank 0 stalls before step 38 (rank 1 waits for it), so the host dies at step 37
        # however fast the steps run
        first = net.hosts[0].popen([*command, "--delay", f"0:{KILL_AFTER + 1}:1000"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 200
        while _last_step(out) < KILL_AFTER:
            assert first.poll() is None, first.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "host0 did not reach step 37"
            time.sleep(0.05)
        net.hosts[0].kill_all()  # the host dies: launcher, workers, everything on it
        first.wait(30)
        assert _last_step(out) == KILL_AFTER
        second = net.hosts[1].popen([*command, "--attempt-offset", "1"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = second.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            second.kill()
            output, _ = second.communicate()
        assert second.returncode == 0, output[-4000:]
    assert "taking over the lease of s3://hosts/run" in output and "the same job" in output
    assert "resuming from s3://hosts/run/commits/step-00000030." in output
    for rank in (0, 1):
        steps = [json.loads(line)["step"] for line in
                 (out / f"log-a1-r{rank}.jsonl").read_text().splitlines()]
        assert steps == list(range(31, STEPS + 1))
        want = load_file(str(reference / f"final-r{rank}.safetensors"))
        got = load_file(str(out / f"final-r{rank}.safetensors"))
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), f"rank {rank} {key} differs"
