"""Backups in a real S3 server (moto, on loopback), with real worker processes and gloo.

A rank killed with SIGKILL resumes from the store bit for bit; a server that hangs during a
save leaves training running (the save is logged and the next one retries); a server gone for
good is a clear error at the end with the local mirror holding the final state; a saver process
killed in the middle of an upload leaves the previous backup the one that loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import replicator as rp
from replicator import fault_points
from replicator.checkpoint import CheckpointManager
from replicator.errors import WorkerFailedError
from replicator.resume import BackupAndRestore
from replicator.testing import run_distributed

# the script, steps and backups of the uninterrupted run shared with it (conftest.py)
from tests.distributed.test_fault_tolerance import SAVE_FREQ, SCRIPT, STEPS
from tests.helpers import make_mlp, regression_data
from tests.s3_server import S3Server, s3_server  # noqa: F401 - a fixture

#: Fail fast while the server hangs: one attempt, a few seconds (defaults are minutes).
QUICK = {"retries": 1, "operation_timeout": 10,
         "config_kwargs": {"connect_timeout": 5, "read_timeout": 8,
                           "retries": {"max_attempts": 1}}}


def _final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"final-r{rank}.safetensors"))


@pytest.mark.timeout(300)
def test_rank_killed_at_step_37_resumes_bit_identically_from_s3(
        s3_server, backup_reference, tmp_path):  # noqa: F811
    s3_server.make_bucket("kill")
    ref = backup_reference  # the same script, steps and backups, on local disk, uninterrupted
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "replicator.cli", "run", "--nproc", "2", "--max-restarts", "1",
           "--timeout", "30", SCRIPT, str(out), "s3://kill/run", "--steps", str(STEPS),
           "--save-freq", str(SAVE_FREQ), "--kill", "1:37"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=250, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 1 failed (exit code -9): killed by SIGKILL; restarting" in proc.stderr
    assert "resuming from s3://kill/run/commits/step-00000030." in proc.stderr
    for rank in (0, 1):
        want, got = _final(ref, rank), _final(out, rank)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), f"rank {rank} {key} differs"
        steps = [json.loads(line)["step"] for line in
                 (out / f"log-a1-r{rank}.jsonl").read_text().splitlines()]
        assert steps == list(range(31, STEPS + 1))  # resumed after the backup of step 30
    manager = CheckpointManager("s3://kill/run")
    name = manager.commits()[-1][1]
    commit = json.loads(manager.store.get(f"commits/{name}"))
    assert commit["step"] == STEPS and set(commit["files"]) == {
        "model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
        "rank-00000.safetensors", "rank-00001.safetensors"}


# -- outages (2 workers under run_distributed) ---------------------------------------------------
def _train(url: str, steps: int, events: dict[str, int], server_pid: int, mirror: str | None,
           saver: str | None = None) -> dict:
    """Train an MLP for ``steps`` with backups every 5 steps at ``url``; ``events``: at which
    step rank 0 pauses ("pause", before that save's uploads) or kills ("kill") the S3 server,
    the first rank to get there resumes it ("resume"), or rank 0 makes its saver process die
    mid-upload ("saver_dies"), and where the loop stops early ("stop")."""
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    data = strategy.distribute_dataset(regression_data(), batch_size=16, shuffle=True, seed=3)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    background = saver is not None
    backup = BackupAndRestore(url, save_freq=5, keep=9, delete_checkpoint=False,
                              background=background, saver=saver, mirror=mirror,
                              storage_options=QUICK)
    backup.track(model=model, optimizer=optimizer)
    if rank == 0 and "pause" in events:
        def pause(step: int, path: object, rank: int) -> None:
            if step == events["pause"]:
                os.kill(server_pid, signal.SIGSTOP)
        fault_points.add_hook("before_write", pause)
    for step, (x, y) in backup.steps(data, num_steps=steps):
        if step == events.get("resume"):
            os.kill(server_pid, signal.SIGCONT)
        if rank == 0 and step == events.get("kill"):
            os.kill(server_pid, signal.SIGKILL)
        if rank == 0 and step == events.get("saver_dies"):
            backup.wait_for_save()
            backup._saver.process.die_during_file = 1  # type: ignore[union-attr]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == events.get("stop"):
            break
    restored = backup.restored
    return {"rank": rank, "step": backup.step,
            "failures": list(getattr(backup.manager, "failure_log", [])),
            "restored": None if restored is None else restored.step,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(300)
def test_a_server_hung_during_a_save_is_logged_and_the_next_save_retries(
        s3_server, tmp_path):  # noqa: F811
    s3_server.make_bucket("hang")
    # Both uploads of step 10 wait out the operation timeout; rank 1 then starts step 11 and
    # resumes the server while rank 0 (the chief) still deletes the failed upload, which would
    # otherwise wait out a second timeout on the paused server.
    events = {"pause": 10, "resume": 11}
    results = run_distributed(_train, world_size=2,
                              args=("s3://hang/run", 20, events, s3_server.proc.pid, None),
                              timeout_seconds=60)
    assert [r["step"] for r in results] == [20, 20]  # training went on
    for r in results:
        assert len(r["failures"]) == 1 and r["failures"][0].startswith("step 10: saving the "
                                                                      "checkpoint of step 10")
        assert "rank 0: OSError: writing s3://hang/run/data/step-00000010" in r["failures"][0]
    assert CheckpointManager("s3://hang/run").committed_steps() == [5, 15, 20]


@pytest.mark.timeout(300)
def test_a_server_gone_for_good_is_an_error_at_the_end_and_the_mirror_keeps_the_state(
        tmp_path, monkeypatch):
    server = S3Server(str(tmp_path / "moto.log"))
    server.start()
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        server.make_bucket("gone")
        mirror = tmp_path / "ckpt"
        with pytest.raises(WorkerFailedError) as info:
            run_distributed(_train, world_size=2,
                            args=("s3://gone/run", 20, {"kill": 12}, server.proc.pid,
                                  str(mirror)), timeout_seconds=60)
    finally:
        server.stop()
    text = str(info.value)
    assert "s3://gone/run was unreachable for the last 2 saves (steps 15, 20)" in text
    assert "its newest backup is step 10" in text and str(mirror) in text
    restored = CheckpointManager(mirror).restore()
    assert restored is not None and restored.step == 20
    expected = _train_locally(tmp_path / "plain", 20)
    for key, value in restored.replicated["model"].items():
        assert torch.equal(value, expected[key]), key


def _train_locally(where: Path, steps: int) -> dict[str, torch.Tensor]:
    results = run_distributed(_train, world_size=2,
                              args=(str(where), steps, {}, 0, None), timeout_seconds=60)
    return results[0]["params"]


@pytest.mark.timeout(300)
def test_a_saver_process_killed_mid_upload_leaves_the_previous_backup(
        s3_server, tmp_path):  # noqa: F811
    s3_server.make_bucket("saver")
    pid = s3_server.proc.pid
    first = run_distributed(_train, world_size=2,
                            args=("s3://saver/run", 20, {"saver_dies": 10, "stop": 12}, pid,
                                  None, "process"), timeout_seconds=60)
    assert [r["step"] for r in first] == [11, 11]  # left during step 12
    for r in first:
        assert len(r["failures"]) == 1 and r["failures"][0].startswith("step 10:")
        assert "the saver process (pid" in r["failures"][0]
        assert "died (exit code -9)" in r["failures"][0]
    manager = CheckpointManager("s3://saver/run")
    assert manager.committed_steps() == [5]  # no commit of step 10, partial or whole
    again = run_distributed(_train, world_size=2,
                            args=("s3://saver/run", 15, {}, pid, None, "process"),
                            timeout_seconds=60)
    assert [r["restored"] for r in again] == [5, 5]
    assert manager.committed_steps() == [5, 10, 15]
