"""The chief's store calls (the commit's listing and write, pruning, the lease) run in the
saver process while one runs, against a real S3 server (moto), and in this process again
once it is closed."""

from __future__ import annotations

import pytest

from replicator.checkpoint import CheckpointManager
from replicator.checkpoint.saver import BackgroundSaver, SaverFilesystem
from tests.s3_server import s3_server  # noqa: F401 - a fixture


@pytest.mark.timeout(120)
def test_store_calls_go_through_the_saver_process_and_come_back_on_close(
        s3_server):  # noqa: F811 - the fixture
    s3_server.make_bucket("calls")
    manager = CheckpointManager("s3://calls/run")
    store = manager.store
    original = store.fs
    saver = BackgroundSaver(manager, async_mode="process")
    try:
        assert isinstance(store.fs, SaverFilesystem)
        jobs = saver.process._jobs
        store.put("a/one.bin", b"\x00\x01" * 1000)
        store.put("a/two.json", b"{}")
        store.put("b/c/three", b"3")
        assert store.get("a/one.bin") == b"\x00\x01" * 1000  # bytes survive the round trip
        assert store.objects("a") == [("one.bin", 2000), ("two.json", 2)]
        assert store.folders("b") == ["c"]
        assert store.exists("a/two.json") and not store.exists("a/none")
        with pytest.raises(FileNotFoundError):
            store.get("a/none")
        store.remove("a/two.json")
        store.remove("b", recursive=True)
        store.remove("a/none")  # missing: nothing to do, as in this process
        assert store.objects("a") == [("one.bin", 2000)] and store.folders("b") == []
        assert saver.process._jobs - jobs == 14  # every call above ran in the saver process
        with pytest.raises(OSError, match="does not make the call 'mkdir'"):  # only a few
            saver.process.call(store.scheme, store.storage_options, "mkdir", "calls/run/d")
    finally:
        saver.close()
    assert store.fs is original  # closed: the calls run in this process again
    assert store.objects("a") == [("one.bin", 2000)]
