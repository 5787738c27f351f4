"""Launching: rp.launch, `replicator run`, torchrun and plain python run the same script."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import replicator as rp
from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.testing import assert_params_close
from tests.helpers import hang, launch, run_cli

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
REPLICATOR = [sys.executable, "-m", "replicator.cli"]


def _run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    tmpdir = kw.pop("tmpdir", os.environ.get("TMPDIR", "/tmp"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=tmpdir, **kw.pop("env", {}))
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


def test_plain_python_prints_how_to_use_more_replicas_once(tmp_path, capfd):
    code = ("import replicator as rp; s = rp.MirroredStrategy(); rp.MirroredStrategy();"
            "print(s.num_replicas_in_sync)")
    out = _run([sys.executable, "-c", code])  # no logging configured: the hint still shows
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert out.stderr.count("replicator run --nproc N") == 1
    script = tmp_path / "one.py"
    script.write_text(code)
    launched = run_cli(capfd, ["run", "--nproc", "1", str(script)])
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.strip() == "1"  # one process: no rank prefix
    assert "replicator run --nproc N" not in launched.stderr  # not under the launcher


def _square(x: int) -> tuple:
    s = rp.MirroredStrategy()
    return s.replica_id, x * x, torch.ones(2) * s.replica_id, torch.get_num_threads()


@pytest.mark.timeout(60)
def test_launch_returns_every_replicas_value_in_rank_order():
    out = rp.launch(_square, num_replicas=2, args=(7,))
    assert [o[0] for o in out] == [0, 1] and all(o[1] == 49 for o in out)
    assert torch.equal(out[1][2], torch.ones(2))
    assert all(o[3] == max(1, (os.cpu_count() or 1) // 2) for o in out)  # no oversubscription


def _environment_and_a_line(name: str) -> str | None:
    print(f"worker {os.environ['RANK']} says hello", flush=True)
    return os.environ.get(name)


@pytest.mark.timeout(180)
def test_forkserver_workers_get_the_callers_environment_and_output(monkeypatch, capfd):
    # workers fork from a server that may have started long ago, with another environment and
    # other file descriptors: each must still see the caller's environment and output now
    monkeypatch.setenv("REPLICATOR_TEST_MARK", "set after the server started")
    monkeypatch.delenv("SCIKIT_LEARN_DATA")  # set (conftest) before any server started
    capfd.readouterr()
    for name, expected in (("REPLICATOR_TEST_MARK", "set after the server started"),
                           ("SCIKIT_LEARN_DATA", None)):
        out = rp.launch(_environment_and_a_line, num_replicas=2, args=(name,),
                        start_method="forkserver")
        assert out == [expected, expected]
    printed = capfd.readouterr().out
    assert printed.count("worker 0 says hello") == 2 and printed.count("worker 1 says hello") == 2


_REPORTING_SCRIPT = """
import atexit, json, multiprocessing, os, sys
import numpy, torch
import replicator as rp

rank = os.environ["RANK"]
out = sys.argv[1]
before = multiprocessing.get_start_method(allow_none=True)
multiprocessing.set_start_method("spawn")  # a script may choose, as in a fresh interpreter
report = {"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
          "mark": os.environ.get("REPLICATOR_TEST_MARK"),
          "sklearn": os.environ.get("SCIKIT_LEARN_DATA"), "start_method": before,
          "threads": torch.get_num_threads(), "draw": numpy.random.rand()}
atexit.register(lambda: open(os.path.join(out, "atexit-" + rank), "w").close())
with open(os.path.join(out, "report-" + rank), "w") as f:
    json.dump(report, f)
print("rank", rank, "reports")
sys.exit(3 if rank == "1" else 0)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_replicator_run_workers_are_started_as_fresh_interpreters_would_be(
        tmp_path, monkeypatch, capfd, start_method):
    # a forked worker comes from a server started earlier, in another directory, with another
    # environment: the script must not see any of it, nor run differently from a fresh python
    from replicator.cli import main
    from replicator.launch.forked_start import forkserver_context

    forkserver_context()  # starts the server here, before the directory changes
    script, out = tmp_path / "scripts" / "report.py", tmp_path / "out"
    script.parent.mkdir()
    out.mkdir()
    script.write_text(_REPORTING_SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REPLICATOR_TEST_MARK", "set now")
    monkeypatch.delenv("SCIKIT_LEARN_DATA")  # set (conftest) before any server started
    capfd.readouterr()
    code = main(["run", "--nproc", "2", "--start-method", start_method, str(script),
                 str(out), "x"])
    printed = capfd.readouterr()
    assert code == 3, printed.err  # rank 1's own exit code
    assert "[rank 0] rank 0 reports" in printed.out and "[rank 1] rank 1 reports" in printed.out
    reports = [json.loads((out / f"report-{r}").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["argv"] == [str(out), "x"] and report["cwd"] == str(tmp_path)
        assert report["path0"] == str(script.parent)
        assert report["mark"] == "set now" and report["sklearn"] is None
        assert report["start_method"] is None
        assert report["threads"] == max(1, (os.cpu_count() or 1) // 2)
    assert reports[0]["draw"] != reports[1]["draw"]  # NumPy seeded afresh in each worker
    assert (out / "atexit-0").exists() and (out / "atexit-1").exists()


def _raise_on_rank1(_: int) -> None:
    s = rp.MirroredStrategy()
    if s.replica_id == 1:
        raise ValueError("bad value on purpose in rank 1")
    s.reduce("sum", torch.ones(1))  # rank 0 waits here; must not hang


def _stuck_in_a_named_wait(folder: str) -> None:
    Path(folder, f"started-{os.environ['RANK']}").touch()
    hang(120, Path(folder, "never"))


class _StoppedFromOutside(Exception):
    pass


@pytest.mark.timeout(120)
def test_a_launch_stopped_from_outside_prints_what_each_running_worker_was_doing(tmp_path,
                                                                                capfd):
    # a test's timeout (or Ctrl-C) interrupts the launcher: the workers' stacks are what shows
    # where a hang was, so each running worker prints its threads' stacks before it is stopped
    def stop_once_both_started() -> None:
        while len(list(tmp_path.glob("started-*"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    def raise_stopped(*_: object) -> None:
        raise _StoppedFromOutside()
    previous = signal.signal(signal.SIGUSR1, raise_stopped)
    try:
        import threading

        threading.Thread(target=stop_once_both_started, daemon=True).start()
        with pytest.raises(_StoppedFromOutside):
            launch(_stuck_in_a_named_wait, 2, args=(str(tmp_path),))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    printed = capfd.readouterr()
    assert "the launch stopped while rank 0, rank 1 still ran" in printed.err
    for rank in (0, 1):
        stacks = printed.err.split(f"rank {rank}'s threads:\n")[1].split("[replicator]")[0]
        assert "in hang" in stacks and "in _stuck_in_a_named_wait" in stacks, printed.err


@pytest.mark.timeout(180)
def test_worker_that_raises_ends_the_group_with_its_traceback():
    # the collective timeout (600 s) is far beyond the test's: rank 0 must be released by the
    # group ending, not by timing out
    with pytest.raises(rp.WorkerFailedError) as info:
        rp.launch(_raise_on_rank1, num_replicas=2, args=(0,), timeout_seconds=600)
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "ValueError: bad value on purpose in rank 1" in str(err)
    assert "_raise_on_rank1" in err.traceback_text


@pytest.mark.timeout(60)
def test_replicator_run_prints_the_failing_ranks_traceback_first_and_once(capfd):
    out = run_cli(capfd, ["run", "--nproc", "2", "--timeout", "30",
                             str(SCRIPTS / "fail_on_rank1.py")])
    assert out.returncode == 1
    err = out.stderr
    assert err.count("ValueError: bad value on purpose in rank 1") == 2  # summary + traceback
    assert err.count("Traceback of rank 1") == 1
    assert err.index("rank 1 failed") < err.index("Traceback")
    assert "Other ranks" in err and "rank 0" in err


def _sleep_on_rank1(gave_up: str) -> None:
    s = rp.MirroredStrategy()
    if s.replica_id == 1:
        # away past the 3 s collective timeout however slow the machine: until rank 0 has its
        # error (then the launcher need not wait out its grace for a rank still asleep)
        hang(600, gave_up)
        return
    try:
        s.reduce("sum", torch.ones(1))
    finally:
        Path(gave_up).touch()


@pytest.mark.timeout(180)
def test_collective_a_rank_never_joins_times_out_naming_it(tmp_path):
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(_sleep_on_rank1, num_replicas=2, args=(str(tmp_path / "gave_up"),),
               timeout_seconds=3)
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
    detail = info.value.traceback_text  # the whole message; the summary line is shortened
    assert "parameter weight: shape (4, 4)" in detail and "shape (5, 4)" in detail


@pytest.mark.timeout(150)
def test_busy_port_nproc_zero_and_missing_script_are_clear_errors(tmp_path, capfd):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        out = run_cli(capfd, ["run", "--nproc", "2", "--master-port", str(port),
                                 str(SCRIPTS / "train_mirrored.py"), str(tmp_path / "x")])
    finally:
        sock.close()
    assert out.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in out.stderr
    # MASTER_PORT in the environment is the port when --master-port is not given (as the
    # hint says): the same busy port, the same error
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        out = run_cli(capfd, ["run", "--nproc", "2", str(SCRIPTS / "train_mirrored.py"),
                                 str(tmp_path / "y")], env={"MASTER_PORT": str(port)})
    finally:
        sock.close()
    assert out.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in out.stderr
    out = run_cli(capfd, ["run", "--nproc", "0", str(SCRIPTS / "train_mirrored.py")])
    assert out.returncode == 2 and "--nproc must be a positive integer" in out.stderr
    out = run_cli(capfd, ["run", "--nproc", "2", "no_such_script.py"])
    assert out.returncode == 2 and "script 'no_such_script.py' not found" in out.stderr
    with pytest.raises(rp.errors.ClusterConfigError,
                       match="num_replicas must be a positive integer"):
        rp.launch(_square, num_replicas=0)


@pytest.mark.timeout(180)
def test_num_ps_with_a_script_that_builds_no_parameter_server_strategy_warns(tmp_path, capfd):
    script = tmp_path / "mirrored.py"
    script.write_text("import torch\nimport replicator as rp\n"
                      "strategy = rp.MirroredStrategy()\n"
                      "total = strategy.reduce('sum', torch.ones(1))\n"
                      "print(f'replicas {strategy.num_replicas_in_sync} total {total.item()}')\n")
    out = run_cli(capfd, ["run", "--nproc", "3", "--num-ps", "1", str(script)])
    assert out.returncode == 0, out.stderr[-3000:]  # 3 replicas ran, as the script says
    assert "replicas 3 total 3.0" in out.stdout
    assert "[replicator] warning: --num-ps 1 was given, but rank(s) 2 never started a " \
           "parameter server" in out.stderr, out.stderr[-3000:]
    assert "HINT: drop --num-ps" in out.stderr


def test_unknown_strategy_and_missing_devices_are_clear_errors():
    with pytest.raises(ValueError, match="unknown strategy 'mirroed'; available: .*mirrored"):
        rp.get_strategy("mirroed")
    with pytest.raises(rp.errors.ClusterConfigError, match="does not exist on this machine"):
        rp.MirroredStrategy(devices=["cuda:7"])
    with pytest.raises(rp.errors.ClusterConfigError, match="not a device name|not supported"):
        rp.OneDeviceStrategy("tpu:0")
    with pytest.raises(rp.errors.ClusterConfigError, match="--nproc 2"):
        rp.MirroredStrategy(devices=["cpu:0", "cpu:1"])


# -- output relay -------------------------------------------------------------------------------

_LINE = re.compile(r"\[rank (\d)\] r(\d)-(\d+):([a-j])+:end")


@pytest.mark.timeout(90)
def test_two_ranks_printing_long_lines_at_once_reach_the_terminal_whole_and_prefixed(capfd):
    lines, width = 200, 3000
    out = run_cli(capfd, ["run", "--nproc", "2", str(SCRIPTS / "print_lines.py"), str(lines),
                             str(width)])
    assert out.returncode == 0, out.stderr[-2000:]
    seen: dict[tuple[str, int], list[int]] = {}
    for name, text in (("stdout", out.stdout), ("stderr", out.stderr)):
        for line in text.splitlines():
            if "last line without a newline" in line:
                assert name == "stdout" and re.fullmatch(
                    r"\[rank (\d)\] r\1 last line without a newline", line), line
                continue
            m = _LINE.fullmatch(line)
            assert m is not None and len(line) == len(m.group(0)), f"torn line: {line[:120]}"
            rank = int(m.group(1))
            assert int(m.group(2)) == rank and line.count("abcdefghij"[rank]) >= width
            assert len(line) == len(f"[rank {rank}] r{rank}-{m.group(3)}:") + width + 4
            seen.setdefault((name, rank), []).append(int(m.group(3)))
    for rank in (0, 1):  # even lines on stdout, odd on stderr, none lost, in order
        assert seen[("stdout", rank)] == list(range(0, lines, 2))
        assert seen[("stderr", rank)] == list(range(1, lines, 2))
    assert out.stdout.count("last line without a newline") == 2  # not lost at exit


@pytest.mark.timeout(60)
def test_quiet_workers_shows_only_the_chief(capfd):
    out = run_cli(capfd, ["run", "--nproc", "2", "--quiet-workers",
                             str(SCRIPTS / "print_lines.py"), "6", "10"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[rank 0] r0-") == 3 and out.stderr.count("[rank 0] r0-") == 3
    assert "[rank 1]" not in out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_one_process_output_has_no_prefix(capfd):
    out = run_cli(capfd, ["run", "--nproc", "1", str(SCRIPTS / "print_lines.py"), "2", "5"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "r0-0:aaaaa:end"
    assert out.stderr.splitlines()[0] == "r0-1:aaaaa:end"


@pytest.mark.timeout(60)
def test_chief_progress_updates_are_relayed_in_place():
    cmd = REPLICATOR + ["run", "--nproc", "2", str(SCRIPTS / "progress_lines.py"), "8"]
    out = subprocess.run(cmd, capture_output=True, timeout=60,  # bytes: keep every \r
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stderr
    stdout = out.stdout.decode()
    # An update redraws the line behind the prefix after a carriage return; the last one
    # ends the line. Updates that arrive together show only the newest.
    assert re.search(r"\[rank 0\] step [1-7]/8\r\[rank 0\] step [2-8]/8", stdout), stdout
    assert re.search(r"(^|\r|\n)\[rank 0\] step 8/8 done\n", stdout), stdout
    assert all(f"[rank 1] rank 1 line {i}\n" in stdout for i in range(1, 9))
    for line in stdout.split("\n"):  # no update glued to another rank's line
        assert not ("[rank 1]" in line and "step" in line), line


# -- failures and restarts ----------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_a_failure_with_restarts_is_announced_once_per_restart(capfd):
    out = run_cli(capfd, ["run", "--nproc", "2", "--max-restarts", "1", "--timeout", "30",
                             str(SCRIPTS / "fail_on_rank1.py")])
    assert out.returncode == 1
    assert out.stderr.count("restart 1 of 1") == 1, out.stderr
    assert out.stderr.count("Traceback of rank 1") == 1


@pytest.mark.timeout(90)
def test_nan_loss_is_not_restarted(tmp_path, capfd):
    (tmp_path / "out").mkdir()
    out = run_cli(capfd, ["run", "--nproc", "2", "--max-restarts", "2", "--timeout", "30",
                             str(SCRIPTS / "backup_train.py"), str(tmp_path / "out"),
                             str(tmp_path / "backup"), "--steps", "10", "--save-freq", "2",
                             "--nan-at", "5"])
    assert out.returncode == 1
    err = out.stderr
    assert err.count("not restarting: NonFiniteLossError repeats on restart") == 1, err
    assert "restarting all workers" not in err
    assert "NonFiniteLossError" in err and "last backup: step 4" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "log-a0-r0.jsonl", "log-a0-r1.jsonl"]  # one attempt only


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, kind", [
    ("def broken(:\n    pass\n", "SyntaxError"),
    ("import replicator_no_such_module\n", "ModuleNotFoundError"),
])
def test_script_that_cannot_start_is_not_restarted(tmp_path, source, kind, capfd):
    script = tmp_path / "bad.py"
    script.write_text(source)
    out = run_cli(capfd, ["run", "--nproc", "2", "--max-restarts", "3", str(script)])
    assert out.returncode == 1
    assert out.stderr.count(f"not restarting: {kind} repeats on restart") == 1, out.stderr
    assert "restarting all workers" not in out.stderr
    assert out.stderr.count(f"{kind}:") >= 1 and out.stderr.count("Traceback of rank") == 1


def _mismatched_models_noisy(_: int) -> None:
    print("attempt", os.environ["REPLICATOR_RESTART_COUNT"], file=sys.stderr, flush=True)
    _mismatched_models(0)


@pytest.mark.timeout(90)
def test_launch_does_not_restart_replicas_that_disagree(capfd):
    with pytest.raises(rp.WorkerFailedError, match="ReplicaMismatchError"):
        rp.launch(_mismatched_models_noisy, num_replicas=2, args=(0,), timeout_seconds=20,
                  max_restarts=2)
    err = capfd.readouterr().err
    assert "not restarting: ReplicaMismatchError repeats on restart" in err
    assert "attempt 0" in err and "attempt 1" not in err


@pytest.mark.timeout(90)
def test_sigterm_without_a_backup_does_not_promise_a_resume(tmp_path):
    cmd = REPLICATOR + ["run", "--nproc", "2", str(SCRIPTS / "wait_for_sigterm.py")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    ready = 0
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while ready < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        ready += line.endswith("] ready\n")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert ready == 2 and proc.returncode == PREEMPTION_EXIT_CODE, err
    assert "No backup was saved" in err and "resume from the backup" not in err


# -- command line -------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["80000", "0", "-1"])
def test_master_port_out_of_range_is_a_clear_error(port, capfd):
    out = run_cli(capfd, ["run", "--nproc", "2", "--master-port", port,
                             str(SCRIPTS / "print_lines.py")])
    assert out.returncode == 2, out.stderr
    assert f"--master-port {port} is not a TCP port" in out.stderr and "HINT" in out.stderr
    assert "Traceback" not in out.stderr and "OverflowError" not in out.stderr
    with pytest.raises(rp.errors.ClusterConfigError, match="is not a TCP port"):
        rp.launch(_square, num_replicas=2, args=(1,), master_port=int(port))


@pytest.mark.timeout(60)
def test_version_and_demo_help():
    out = _run(REPLICATOR + ["--version"])
    assert out.returncode == 0 and out.stdout.startswith(f"replicator {rp.__version__} (torch ")
    out = _run(REPLICATOR + ["demo", "--help"])
    assert out.returncode == 0
    for flag in ("--epochs", "--batch-size", "--steps", "--lr", "--nproc", "--max-restarts",
                 "--quiet-workers"):
        assert flag in out.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif((os.cpu_count() or 1) > 3, reason="starts one worker more than the cores")
def test_more_workers_than_cores_warns_once(capfd):
    from replicator.cluster.cpu_scheduling import usable_cores

    n = usable_cores() + 1
    out = run_cli(capfd, ["run", "--nproc", str(n), str(SCRIPTS / "print_lines.py"), "1",
                             "5"])
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(f"--nproc {n} is more than the {n - 1} CPU core(s)") == 1
    assert "take turns on the cores" in out.stderr and "slower" in out.stderr
