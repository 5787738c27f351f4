"""Launching: rp.launch, `replicator run`, torchrun and plain python run the same script."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import replicator as rp
from replicator.testing import assert_params_close

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
REPLICATOR = [sys.executable, "-m", "replicator.cli"]


def _run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    tmpdir = kw.pop("tmpdir", os.environ.get("TMPDIR", "/tmp"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=tmpdir)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.mark.timeout(180)
def test_same_script_under_python_replicator_run_and_torchrun(tmp_path):
    ref_out, rr_out, tr_out = tmp_path / "one.st", tmp_path / "rr.st", tmp_path / "tr.st"
    one = _run([sys.executable, str(SCRIPTS / "train_mirrored.py"), str(ref_out),
                "--strategy", "one_device"])
    assert one.returncode == 0, one.stderr
    plain = _run([sys.executable, str(SCRIPTS / "train_mirrored.py"), str(tmp_path / "plain.st")])
    assert plain.returncode == 0, plain.stderr
    assert "rank 0 of 1 done" in plain.stdout
    rr = _run(REPLICATOR + ["run", "--nproc", "2", str(SCRIPTS / "train_mirrored.py"), str(rr_out)])
    assert rr.returncode == 0, rr.stderr
    assert "rank 0 of 2 done" in rr.stdout and "rank 1 of 2 done" in rr.stdout
    tr = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "train_mirrored.py"),
               str(tr_out)], tmpdir=str(tmp_path))
    assert tr.returncode == 0, tr.stderr
    ref = load_file(ref_out)
    for out in (tmp_path / "plain.st", rr_out, tr_out):
        assert_params_close(ref, load_file(out), atol=1e-5, label=f"{out.name}: ")


def test_plain_python_logs_how_to_use_more_replicas(tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "import replicator as rp; s = rp.MirroredStrategy(); print(s.num_replicas_in_sync)")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert "replicator run --nproc N" in out.stderr


def _square(x: int) -> tuple:
    s = rp.MirroredStrategy()
    return s.replica_id, x * x, torch.ones(2) * s.replica_id, torch.get_num_threads()


@pytest.mark.timeout(60)
def test_launch_returns_every_replicas_value_in_rank_order():
    out = rp.launch(_square, num_replicas=2, args=(7,))
    assert [o[0] for o in out] == [0, 1] and all(o[1] == 49 for o in out)
    assert torch.equal(out[1][2], torch.ones(2))
    assert all(o[3] == max(1, (os.cpu_count() or 1) // 2) for o in out)  # no oversubscription


def _raise_on_rank1(_: int) -> None:
    s = rp.MirroredStrategy()
    if s.replica_id == 1:
        raise ValueError("bad value on purpose in rank 1")
    s.reduce("sum", torch.ones(1))  # rank 0 waits here; must not hang


@pytest.mark.timeout(60)
def test_worker_that_raises_ends_the_group_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(rp.WorkerFailedError) as info:
        rp.launch(_raise_on_rank1, num_replicas=2, args=(0,), timeout_seconds=30)
    assert time.monotonic() - start < 25  # well inside the 30 s collective timeout
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "ValueError: bad value on purpose in rank 1" in str(err)
    assert "_raise_on_rank1" in err.traceback_text


@pytest.mark.timeout(60)
def test_replicator_run_prints_the_failing_ranks_traceback_first_and_once():
    out = _run(REPLICATOR + ["run", "--nproc", "2", "--timeout", "30",
                             str(SCRIPTS / "fail_on_rank1.py")])
    assert out.returncode == 1
    err = out.stderr
    assert err.count("ValueError: bad value on purpose in rank 1") == 2  # summary + traceback
    assert err.count("Traceback of rank 1") == 1
    assert err.index("rank 1 failed") < err.index("Traceback")
    assert "Other ranks" in err and "rank 0" in err


def _sleep_on_rank1(_: int) -> None:
    s = rp.MirroredStrategy()
    if s.replica_id == 1:
        time.sleep(30)
    s.reduce("sum", torch.ones(1))


@pytest.mark.timeout(60)
def test_collective_a_rank_never_joins_times_out_naming_it():
    start = time.monotonic()
    with pytest.raises(rp.WorkerFailedError) as info:
        rp.launch(_sleep_on_rank1, num_replicas=2, args=(0,), timeout_seconds=3)
    assert time.monotonic() - start < 25
    err = info.value
    assert err.rank == 0
    assert "ReplicaTimeoutError" in str(err)
    assert "reduce(sum)" in str(err) and "rank 1" in str(err) and "3 s" in str(err)


def _mismatched_models(_: int) -> None:
    s = rp.MirroredStrategy()
    with s.scope():
        torch.nn.Linear(4, 4 + s.replica_id)


@pytest.mark.timeout(60)
def test_models_that_differ_across_replicas_fail_at_scope_exit():
    with pytest.raises(rp.WorkerFailedError) as info:
        rp.launch(_mismatched_models, num_replicas=2, args=(0,), timeout_seconds=20)
    text = str(info.value)
    assert "ReplicaMismatchError" in text
    assert "parameter 0: shape (4, 4)" in text and "shape (5, 4)" in text


@pytest.mark.timeout(60)
def test_busy_port_nproc_zero_and_missing_script_are_clear_errors(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        out = _run(REPLICATOR + ["run", "--nproc", "2", "--master-port", str(port),
                                 str(SCRIPTS / "train_mirrored.py"), str(tmp_path / "x")])
    finally:
        sock.close()
    assert out.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in out.stderr
    out = _run(REPLICATOR + ["run", "--nproc", "0", str(SCRIPTS / "train_mirrored.py")])
    assert out.returncode == 2 and "--nproc must be a positive integer" in out.stderr
    out = _run(REPLICATOR + ["run", "--nproc", "2", "no_such_script.py"])
    assert out.returncode == 2 and "script 'no_such_script.py' not found" in out.stderr
    with pytest.raises(rp.ClusterConfigError, match="num_replicas must be a positive integer"):
        rp.launch(_square, num_replicas=0)


def test_unknown_strategy_and_missing_devices_are_clear_errors():
    with pytest.raises(ValueError, match="unknown strategy 'mirroed'; available: .*mirrored"):
        rp.get_strategy("mirroed")
    with pytest.raises(rp.ClusterConfigError, match="does not exist on this machine"):
        rp.MirroredStrategy(devices=["cuda:7"])
    with pytest.raises(rp.ClusterConfigError, match="not a device name|not supported"):
        rp.OneDeviceStrategy("tpu:0")
    with pytest.raises(rp.ClusterConfigError, match="--nproc 2"):
        rp.MirroredStrategy(devices=["cpu:0", "cpu:1"])
