"""Sharded (DCP) checkpoints in a real S3 server (moto, on loopback): saved by FSDP(2) to an
``s3://`` URL and loaded into one device; a damaged shard object is refused by name; a rank of
an FSDP run with ``BackupAndRestore("s3://...")`` killed at step 17 resumes from the store and
equals the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replicator.checkpoint.storage import open_storage
from replicator.checkpoint.store import RemoteStore
from replicator.launch.script_launch import run_script
from replicator.testing import run_distributed
from tests.distributed.test_fault_tolerance import (
    SHARDED_SCRIPT,
    SHARDED_STEPS,
    _assert_same_sharded_run,
    _committed,
)
from tests.distributed.test_model_parallel_checkpoint import _load_damaged, _session
from tests.s3_server import s3_server  # noqa: F401 - a fixture


@pytest.mark.timeout(300)
def test_fsdp_saves_shards_to_s3_and_one_device_loads_them(s3_server):  # noqa: F811
    s3_server.make_bucket("shards")
    url = "s3://shards/ckpt"
    saved = run_distributed(_session, 2, args=("fsdp", url, True), timeout_seconds=150)
    store = RemoteStore(url)
    commits = open_storage(store).saves()
    assert [s for s, _ in commits] == [3]
    manifest = json.loads(store.get(f"commits/{commits[0][1]}"))
    shards = [f for f in manifest["files"] if f.endswith(".safetensors")]
    assert len(shards) == 2 and manifest["prefix"].startswith("data/step-00000003.")
    one = run_distributed(_session, 1, args=("one_device", url, False), timeout_seconds=90)[0]
    assert one["step"] == 3
    assert torch.allclose(one["before"], saved[0]["before"], atol=1e-6)
    assert torch.allclose(one["after"], saved[0]["after"], atol=1e-5)
    # one flipped byte in a shard object: refused, naming the object and the hash mismatch
    name = f"{manifest['prefix']}/{shards[0]}"
    data = bytearray(store.get(name))
    data[-1] ^= 0xFF
    store.put(name, bytes(data))
    message = run_distributed(_load_damaged, 1, args=(url,), timeout_seconds=90)[0]
    assert "SHA-256" in message and shards[0] in message
    assert "no valid sharded checkpoint" in message


@pytest.mark.timeout(400)
def test_fsdp_rank_killed_resumes_from_s3_and_equals_the_uninterrupted_run(
        s3_server, sharded_reference, tmp_path, capfd, monkeypatch):  # noqa: F811
    s3_server.make_bucket("fsdp-kill")
    reference = sharded_reference("fsdp")  # the same run on local disk, uninterrupted
    out = tmp_path / "out"
    out.mkdir()
    # the launcher of `replicator run --max-restarts 1` in this process (one interpreter
    # fewer); the workers' temporary directory is this test's
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    capfd.readouterr()
    run_script(SHARDED_SCRIPT, [str(out), "s3://fsdp-kill/run", "--layout", "fsdp", "--steps",
                                str(SHARDED_STEPS), "--save-freq", "10", "--kill", "1:17"],
               2, max_restarts=1, timeout_seconds=30.0)
    err = capfd.readouterr().err
    assert "killing itself with SIGKILL at step 17" in err
    assert "resuming from s3://fsdp-kill/run/commits/step-00000010." in err
    for rank in range(2):
        assert _committed(out, rank)[1] == [0, 10]
    _assert_same_sharded_run(reference, out, 2)
    shards = RemoteStore("s3://fsdp-kill/run/sharded")
    assert [s for s, _ in open_storage(shards).saves()][-1] == SHARDED_STEPS
    # no scratch folder is left behind in the temporary directory
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith("replicator-shards-")]
