"""Fault tolerance end to end: real worker processes killed, preempted, hung and restarted.

Every run trains the same small model for 100 steps on 2 replicas with a backup every 10 steps
(tests/scripts/backup_train.py) and is compared with one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from replicator.checkpoint.manifest import read_marker
from replicator.checkpoint.storage import LocalStorage
from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.errors import PreemptedError, WorkerFailedError
from replicator.launch.script_launch import run_script

SCRIPT = str(Path(__file__).resolve().parent.parent / "scripts" / "backup_train.py")
STEPS, SAVE_FREQ = 100, 10


def _run(out: Path, backup: Path, *extra: str, max_restarts: int = 1,
         timeout: float = 30.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run_script(SCRIPT, [str(out), str(backup), "--steps", str(STEPS), "--save-freq",
                        str(SAVE_FREQ), *extra], 2, max_restarts=max_restarts,
               timeout_seconds=timeout)


def _logs(out: Path) -> dict[int, dict[int, list[dict]]]:
    """``{attempt: {rank: [entries]}}`` from the per-attempt, per-rank step logs."""
    logs: dict[int, dict[int, list[dict]]] = {}
    for path in out.glob("log-a*-r*.jsonl"):
        attempt, rank = (int(x) for x in path.stem[len("log-a"):].split("-r"))
        logs.setdefault(attempt, {})[rank] = [json.loads(line)
                                              for line in path.read_text().splitlines()]
    return logs


def _committed(out: Path, rank: int) -> tuple[list[dict], list[int]]:
    """The steps that count, by the resume rule: what an attempt did after the step the next
    attempt resumed from was rolled back. Returns the entries and each attempt's resume step."""
    logs = _logs(out)
    attempts = sorted(logs)
    entries: list[dict] = []
    resumes = []
    for a in attempts:
        mine = logs[a].get(rank, [])
        resume = mine[0]["step"] - 1 if mine else None
        resumes.append(resume)
        if entries and resume is not None:
            entries = [e for e in entries if e["step"] <= resume]
        entries += mine
    return entries, resumes


def _final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"final-r{rank}.safetensors"))


def _assert_same_run(reference: Path, out: Path) -> None:
    """Parameters, optimizer state, consumed sample ids and random draws equal the reference."""
    for rank in (0, 1):
        ref, got = _final(reference, rank), _final(out, rank)
        assert ref.keys() == got.keys()
        for key in ref:
            diff = (ref[key].double() - got[key].double()).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {key}: max |diff| {diff}"
        entries, _ = _committed(out, rank)
        assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
        ref_entries, _ = _committed(reference, rank)
        assert [e["ids"] for e in entries] == [e["ids"] for e in ref_entries]
        assert [e["draw"] for e in entries] == [e["draw"] for e in ref_entries]
        assert [e["loss"] for e in entries] == [e["loss"] for e in ref_entries]


@pytest.fixture
def reference(backup_reference: Path) -> Path:
    """The uninterrupted run (``_run`` with no fault), made once per session (conftest.py)."""
    return backup_reference


@pytest.mark.timeout(120)
def test_rank_killed_at_step_37_resumes_bit_identically(reference, tmp_path, capfd):
    # the launcher in this process (the same under `replicator run --max-restarts 1`, which
    # test_remote_backup.py's kill at step 37 runs): one interpreter fewer
    _run(tmp_path / "out", tmp_path / "backup", "--kill", "1:37")
    err = capfd.readouterr().err
    assert "rank 1 failed (exit code -9): killed by SIGKILL; restarting" in err
    _assert_same_run(reference, tmp_path / "out")
    for rank in (0, 1):
        _, resumes = _committed(tmp_path / "out", rank)
        assert resumes == [0, 30]  # at most save_freq steps are repeated
    last = _logs(tmp_path / "out")[0][1][-1]["step"]
    assert last == 36 and last - 30 < SAVE_FREQ
    # The chief wrote the shared state, each rank its own file.
    manifest = read_marker(tmp_path / "backup" / "step-00000100")
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors",
                                      "scheduler.safetensors", "rank-00000.safetensors",
                                      "rank-00001.safetensors"}


@pytest.mark.timeout(120)
def test_torchrun_max_restarts_resumes_the_same_script(reference, tmp_path):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), SCRIPT, str(out),
           str(backup), "--steps", str(STEPS), "--save-freq", str(SAVE_FREQ), "--kill", "1:37",
           "--stateful-data"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path),
               REPLICATOR_TIMEOUT_SECONDS="30")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        entries, resumes = _committed(out, rank)
        assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
        assert resumes == [0, 30]


@pytest.mark.timeout(120)
def test_kill_between_data_files_and_commit_marker_loads_previous(reference, tmp_path, capfd):
    _run(tmp_path / "out", tmp_path / "backup", "--kill-during-save", "20")
    err = capfd.readouterr().err
    assert "killing itself during the save of step 20" in err
    assert "skipping checkpoint step-00000020" in err and "no commit marker" in err
    assert "resuming from" in err and "step-00000010" in err
    for rank in (0, 1):
        assert _committed(tmp_path / "out", rank)[1] == [0, 10]
    _assert_same_run(reference, tmp_path / "out")


@pytest.mark.timeout(150)
def test_sigterm_to_one_worker_saves_everywhere_exits_75_and_resumes(reference, tmp_path,
                                                                    capfd):
    out, backup = tmp_path / "out", tmp_path / "backup"
    _run(out, backup, "--terminate", "1:43", max_restarts=1)
    err = capfd.readouterr().err
    restart = next(line for line in err.splitlines() if "restarting all workers" in line)
    assert "the workers were preempted (SIGTERM reached a rank)" in restart
    assert "rank 0: exit code 75" in restart and "rank 1: exit code 75" in restart
    logs = _logs(out)[0]
    stop = logs[0][-1]["step"]
    assert logs[1][-1]["step"] == stop and stop in (43, 44)  # agreed one step after the signal
    assert f"resuming from {backup / f'step-{stop:08d}'} (step {stop}," in err
    # The restart continues right after the preemption step, with no step repeated.
    assert _committed(out, 0)[1] == [0, stop]
    _assert_same_run(reference, out)


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_stops_the_job_with_75(tmp_path):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    cmd = [sys.executable, "-m", "replicator.cli", "run", "--nproc", "2", "--max-restarts", "3",
           SCRIPT, str(out), str(backup), "--steps", str(STEPS), "--step-sleep", "0.05",
           "--check-seconds", "0.2"]  # checks adapt to every ~4 steps here
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.time() + 60
    while time.time() < deadline and len(_logs(out).get(0, {}).get(1, [])) < 12:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTION_EXIT_CODE, err
    assert "received SIGTERM" in err and "Rerun the same command" in err
    logs = _logs(out)
    assert sorted(logs) == [0]  # no restart after the job itself was preempted
    stop = logs[0][0][-1]["step"]
    assert logs[0][1][-1]["step"] == stop and stop < STEPS
    assert read_marker(backup / f"step-{stop:08d}")["info"]["reason"] == "preemption"


@pytest.mark.timeout(120)
def test_rank_failing_on_every_attempt_is_reported_after_k_restarts(tmp_path, capfd):
    with pytest.raises(WorkerFailedError) as info:
        _run(tmp_path / "out", tmp_path / "backup", "--fail", "1:3", max_restarts=2)
    assert info.value.rank == 1 and info.value.exitcode == 1
    assert "injected failure (rank 1, step 3)" in info.value.traceback_text
    assert "RuntimeError" in str(info.value)
    err = capfd.readouterr().err
    assert "restart 1 of 2" in err and "restart 2 of 2" in err
    assert sorted(_logs(tmp_path / "out")) == [0, 1, 2]


@pytest.mark.timeout(150)
def test_hung_rank_becomes_a_named_timeout_then_a_restart(reference, tmp_path, capfd):
    # rank 1 hangs at step 15 until rank 0 has its timeout (the hang ends then, so the
    # launcher need not wait out its grace and SIGKILL for a rank still asleep)
    _run(tmp_path / "out", tmp_path / "backup", "--hang", "1:15:60", timeout=4.0)
    err = capfd.readouterr().err
    first = next(line for line in err.splitlines() if "restarting all workers" in line)
    assert "rank 0 failed" in first and "ReplicaTimeoutError" in first and "rank 1" in first
    _assert_same_run(reference, tmp_path / "out")


@pytest.mark.timeout(120)
def test_nan_loss_stops_before_the_optimizer_step_and_keeps_the_backup(tmp_path):
    with pytest.raises(WorkerFailedError) as info:
        _run(tmp_path / "out", tmp_path / "backup", "--nan-at", "50", max_restarts=0)
    assert "NonFiniteLossError" in str(info.value) and "at step 50" in str(info.value)
    assert "last backup: step 40" in str(info.value)
    for rank in (0, 1):
        assert _logs(tmp_path / "out")[0][rank][-1]["step"] == 49
    step_dir = tmp_path / "backup" / "step-00000040"
    LocalStorage(step_dir.parent).fetch_all(step_dir.name)  # every file verifies
    model = load_file(str(step_dir / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in model.values())
    assert not (tmp_path / "backup" / "step-00000050").exists()


def test_preempted_error_carries_the_exit_code():
    err = PreemptedError("stopped", rank=1)
    assert isinstance(err, WorkerFailedError) and err.exitcode == err.exit_code == 75


# -- sharded backups: the model split across ranks (FSDP, data x pipeline, tensor) ---------------

SHARDED_SCRIPT = str(Path(__file__).resolve().parent.parent / "scripts"
                     / "sharded_backup_train.py")
SHARDED_STEPS = 30
SHARDED_NPROC = {"fsdp": 2, "data_pipeline": 4, "tensor": 2}


def _run_sharded(out: Path, backup: Path, layout: str, *extra: str,
                 max_restarts: int = 1) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run_script(SHARDED_SCRIPT, [str(out), str(backup), "--layout", layout, "--steps",
                                str(SHARDED_STEPS), "--save-freq", "10", *extra],
               SHARDED_NPROC[layout], max_restarts=max_restarts, timeout_seconds=30.0)


def _assert_same_sharded_run(reference: Path, out: Path, nproc: int) -> None:
    """Each rank's parameters and optimizer state (its shards or its stage), losses and random
    draws equal the uninterrupted run's."""
    for rank in range(nproc):
        ref, got = _final(reference, rank), _final(out, rank)
        assert ref.keys() == got.keys() and ref, f"rank {rank}: {sorted(got)}"
        for key in ref:
            diff = (ref[key].double() - got[key].double()).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {key}: max |diff| {diff}"
        entries, _ = _committed(out, rank)
        ref_entries, _ = _committed(reference, rank)
        assert [e["step"] for e in entries] == list(range(1, SHARDED_STEPS + 1))
        assert [e["loss"] for e in entries] == [e["loss"] for e in ref_entries]
        assert [e["draw"] for e in entries] == [e["draw"] for e in ref_entries]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp", "data_pipeline", "tensor"])
def test_sharded_backup_rank_killed_resumes_identically(sharded_reference, tmp_path, layout,
                                                       capfd):
    reference = sharded_reference(layout)
    out, backup = tmp_path / "out", tmp_path / "backup"
    _run_sharded(out, backup, layout, "--kill", "1:17")
    err = capfd.readouterr().err
    assert "killing itself with SIGKILL at step 17" in err
    assert f"resuming from {backup / 'step-00000010'} (step 10," in err
    nproc = SHARDED_NPROC[layout]
    for rank in range(nproc):
        assert _committed(out, rank)[1] == [0, 10]
    _assert_same_sharded_run(reference, out, nproc)
    # The backup names its sharded part; model and optimizer are not written by the chief.
    manifest = read_marker(backup / "step-00000030")
    assert manifest["info"]["sharded"] == {"directory": "sharded",
                                           "states": ["model", "optimizer"]}
    assert set(manifest["files"]) == {"scheduler.safetensors",
                                      *(f"rank-{r:05d}.safetensors" for r in range(nproc))}
    shards = backup / "sharded" / "step-00000030"
    LocalStorage(shards.parent).fetch_all(shards.name)  # every file verifies
    assert len([p for p in shards.iterdir() if p.name.startswith("shard-")]) == nproc


@pytest.mark.timeout(200)
def test_sharded_backup_killed_between_shards_and_marker_resumes_previous(sharded_reference,
                                                                          tmp_path, capfd):
    reference = sharded_reference("fsdp")
    out, backup = tmp_path / "out", tmp_path / "backup"
    _run_sharded(out, backup, "fsdp", "--kill-during-save", "20")
    err = capfd.readouterr().err
    assert "killing itself during the save of step 20" in err
    assert "skipping checkpoint step-00000020" in err
    assert f"resuming from {backup / 'step-00000010'} (step 10," in err
    for rank in range(2):
        assert _committed(out, rank)[1] == [0, 10]
    _assert_same_sharded_run(reference, out, 2)


@pytest.mark.timeout(300)
def test_the_rerun_line_names_the_step_the_rerun_resumes_from(tmp_path, capfd):
    # rank 1 dies at step 13 while the chief is still finishing the commit of step 10 (its
    # COMMIT.json is written; slow steps give rank 1's save thread time to agree on its
    # writes first): the launcher's line must name step 10 (not 5 before it), which the
    # rerun loads. The launcher runs in this process, as `replicator run` runs it (which
    # prints the same error): two interpreters fewer
    out, backup = tmp_path / "out", tmp_path / "backup"
    with pytest.raises(WorkerFailedError) as info:
        _run(out, backup, "--save-freq", "5", "--kill", "1:13", "--background", "--slow-commit",
             "10:5", "--step-sleep", "0.3", max_restarts=0)
    assert (backup / "step-00000010" / "COMMIT.json").exists()
    line = next(s for s in str(info.value).splitlines() if "resume from the backup" in s)
    said = int(line.split("(step ")[1].split()[0])
    capfd.readouterr()
    _run(out, backup, "--save-freq", "5", "--steps", "15", "--attempt-offset", "1")
    resumed = next(s for s in capfd.readouterr().err.splitlines() if "resuming from" in s)
    assert f"(step {said}," in resumed and said == 10, (line, resumed)
