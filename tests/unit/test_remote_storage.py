"""Training state at fsspec URLs, in one process: unknown schemes refused, the commit protocol
(commit objects last, newest verified commit chosen, damaged ones skipped by name and hash,
keep-last-k), the lease between jobs; against ``memory://`` and a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from replicator.checkpoint import CheckpointManager
from replicator.checkpoint.store import LEASE_NAME, RemoteStore
from replicator.errors import CheckpointCorruptError, StorageURLError, StoreLeaseError
from replicator.resume import BackupAndRestore
from tests.s3_server import s3_server  # noqa: F401 - a fixture


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, generator=g), "b": torch.randn(3, generator=g)}


def _save(manager: CheckpointManager, step: int) -> None:
    manager.save(step, {"model": _state(step)}, {"rank_value": torch.tensor([step])},
                 {"step": step})


def _flip_last_byte(store: RemoteStore, commit: str, fname: str) -> str:
    prefix = json.loads(store.get(f"commits/{commit}"))["prefix"]
    raw = bytearray(store.get(f"{prefix}/{fname}"))
    raw[-1] ^= 0xFF
    store.put(f"{prefix}/{fname}", bytes(raw))
    return f"{prefix}/{fname}"


@pytest.mark.parametrize("url", ["foo://bucket/run", "s4://bucket/run"])
def test_an_unknown_scheme_is_an_error_never_a_local_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for make in (lambda: BackupAndRestore(url), lambda: CheckpointManager(url)):
        with pytest.raises(StorageURLError, match="unknown URL scheme") as info:
            make()
        assert url in str(info.value) and "HINT" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no directory named 'foo:' or 's4:'


def test_a_scheme_whose_package_is_missing_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(StorageURLError, match="gcsfs"):
        BackupAndRestore("gs://bucket/run")
    assert list(tmp_path.iterdir()) == []


def test_file_urls_and_paths_keep_the_local_layout(tmp_path):
    manager = CheckpointManager(f"file://{tmp_path}/run", keep=2)
    assert type(manager) is CheckpointManager and manager.directory == tmp_path / "run"
    _save(manager, 5)
    assert (tmp_path / "run" / "step-00000005" / "COMMIT.json").exists()


def test_commit_objects_last_keep_k_and_restore_the_newest(tmp_path):
    url = f"memory://remote-{time.monotonic_ns()}/run"
    manager = CheckpointManager(url, keep=2)
    for step in (10, 20, 30):
        _save(manager, step)
    store = manager.store
    commits = [n for n, _ in store.objects("commits")]
    assert [n.split(".")[0] for n in commits] == ["step-00000020", "step-00000030"]
    assert len(store.folders("data")) == 2  # the data of step 10 went after a newer commit
    restored = CheckpointManager(url).restore()
    assert restored is not None and restored.step == 30
    assert torch.equal(restored.replicated["model"]["w"], _state(30)["w"])
    assert restored.per_rank["rank_value"].item() == 30


def test_pruning_keeps_the_upload_of_a_later_step_in_flight():
    url = f"memory://remote-{time.monotonic_ns()}/run"
    manager = CheckpointManager(url, keep=1)
    _save(manager, 10)
    store = manager.store
    store.put("data/step-00000005.dead-0x9/rank-00000.safetensors", b"old, never committed")
    store.put("data/step-00000020.next-0x9/rank-00001.safetensors", b"another rank's upload")
    _save(manager, 15)
    folders = store.folders("data")
    assert len(folders) == 2 and "step-00000020.next-0x9" in folders  # and step 15's own
    _save(manager, 25)
    assert [f.split(".")[0] for f in store.folders("data")] == ["step-00000025"]


def test_flipped_bytes_and_partial_saves_are_skipped_by_name(tmp_path, recwarn):
    url = f"memory://remote-{time.monotonic_ns()}/run"
    manager = CheckpointManager(url, keep=3)
    for step in (10, 20, 30):
        _save(manager, step)
    store = manager.store
    newest = [n for n, _ in store.objects("commits")][-1]
    damaged = _flip_last_byte(store, newest, "model.safetensors")
    store.put("data/step-00000040.feed-0x9/model.safetensors", b"partial")  # no commit
    restored = CheckpointManager(url).restore()
    assert restored is not None and restored.step == 20
    text = " ".join(str(w.message) for w in recwarn)
    assert f"skipping checkpoint {newest}" in text
    assert damaged in text and "fails its SHA-256 check" in text and "sha256 " in text
    # every commit damaged: a clear error naming each
    for _, name in manager.commits():
        _flip_last_byte(store, name, "rank-00000.safetensors")
    with pytest.raises(CheckpointCorruptError, match="no valid checkpoint"):
        CheckpointManager(url).restore()


def test_a_second_job_refuses_a_location_whose_lease_is_fresh(capfd):
    url = f"memory://remote-{time.monotonic_ns()}/run"
    first = CheckpointManager(url, job_id="job-a")
    _save(first, 1)
    second = CheckpointManager(url, job_id="job-b")
    with pytest.raises(StoreLeaseError, match="job 'job-a'.*refuses to write"):
        second.restore()
    with pytest.raises(StoreLeaseError):
        _save(second, 2)
    # the same job restarted (another process of job-a) takes it back at once
    store = first.store
    lease = json.loads(store.get(LEASE_NAME))
    store.put(LEASE_NAME, json.dumps({**lease, "pid": 1 << 22}).encode())
    again = CheckpointManager(url, job_id="job-a")
    assert again.restore() is not None
    assert "taking over the lease" in capfd.readouterr().err
    first.close()
    again.close()


def test_a_stale_lease_is_taken_over_and_said(capfd):
    url = f"memory://remote-{time.monotonic_ns()}/run"
    store = RemoteStore(url)
    store.put(LEASE_NAME, json.dumps({"job_id": "old-job", "host": "elsewhere", "pid": 7,
                                      "heartbeat": time.time() - 50}).encode())
    fresh = CheckpointManager(url, job_id="new-job", lease_timeout=30)
    assert fresh.restore() is None
    err = capfd.readouterr().err
    assert "taking over the lease" in err and "old-job" in err and "stale" in err
    assert json.loads(store.get(LEASE_NAME))["job_id"] == "new-job"
    fresh.close()
    assert not store.exists(LEASE_NAME)


_NEVER_CLOSED = """
import sys, torch
from replicator.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], job_id="forgetful")
manager.save(1, {"model": {"w": torch.ones(2)}})
manager.finish()
print("saved", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_script_that_never_closes_its_backups_releases_the_lease_at_exit(tmp_path):
    url = (tmp_path / "run").as_uri()
    done = subprocess.run([sys.executable, "-c", _NEVER_CLOSED, url], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr
    assert "still running" not in done.stderr  # the heartbeat thread was stopped
    assert not RemoteStore(url).exists(LEASE_NAME)  # the next job need not wait it out
    again = CheckpointManager(url, job_id="another")  # takes the location at once
    assert again.restore() is not None
    again.close()


# -- a real S3 server ------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_s3_commit_protocol_and_damage(s3_server):  # noqa: F811 - the fixture
    s3_server.make_bucket("unit")
    url = "s3://unit/run"
    manager = CheckpointManager(url, keep=2)
    for step in (5, 10):
        _save(manager, step)
    assert manager.committed_steps() == [5, 10]
    newest = manager.commits()[-1][1]
    damaged = _flip_last_byte(manager.store, newest, "model.safetensors")
    manager.close()
    with pytest.warns(RuntimeWarning, match=f"skipping checkpoint {newest}.*{damaged}.*SHA-256"):
        restored = CheckpointManager(url).restore()
    assert restored is not None and restored.step == 5
    assert torch.equal(restored.replicated["model"]["w"], _state(5)["w"])
    assert socket.gethostname()  # the lease names this host
    assert "FSSPEC_S3_ENDPOINT_URL" in os.environ
