"""The command line and the launcher's pieces that need no worker: output relay, restart
policy, rank summaries, port checks, the demo's options."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from replicator import cli
from replicator.cluster.ports import check_port
from replicator.cluster.worker_errors import (
    error_path,
    read_backup,
    read_error,
    record_backup,
    record_exception,
)
from replicator.errors import ClusterConfigError, NonFiniteLossError
from replicator.launch.failure_report import group_by_rank, rank_ranges, restart_refusal
from replicator.launch.launcher import LocalGroup, WorkerProcess, oversubscription_warning
from replicator.launch.output import OutputRelay, terminal_env


class _Terminal(io.TextIOWrapper):
    def __init__(self, tty: bool) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8")
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty

    def value(self) -> bytes:
        self.flush()
        return self.buffer.getvalue()  # type: ignore[attr-defined]


def _relay(tty: bool = False) -> tuple[OutputRelay, _Terminal, _Terminal]:
    out, err = _Terminal(tty), _Terminal(tty)
    return OutputRelay(stdout=out, stderr=err), out, err


def _pipe(relay: OutputRelay, rank: int, stream: str) -> int:
    r, w = os.pipe()
    relay.attach(rank, os.fdopen(r, "rb"), stream)
    return w


@pytest.mark.timeout(30)
def test_relay_writes_whole_prefixed_lines_from_writers_racing_in_small_pieces():
    relay, out, err = _relay()
    pipes = {(rank, s): _pipe(relay, rank, s) for rank in (0, 1) for s in ("stdout", "stderr")}

    def writer(rank: int, stream: str) -> None:
        fd = pipes[(rank, stream)]
        for i in range(300):
            line = f"{stream}-{rank}-{i}:" + str(rank) * 500 + ":end\n"
            for k in range(0, len(line), 37):  # torn into many writes
                os.write(fd, line[k:k + 37].encode())
        os.write(fd, b"no newline at the end")
        os.close(fd)

    threads = [threading.Thread(target=writer, args=key) for key in pipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    relay.drain(10)
    for name, sink in (("stdout", out), ("stderr", err)):
        lines = sink.value().decode().split("\n")
        assert lines[-1] == ""
        for rank in (0, 1):
            mine = [x for x in lines if x.startswith(f"[rank {rank}] ")]
            assert mine[:-1] == [f"[rank {rank}] {name}-{rank}-{i}:" + str(rank) * 500 + ":end"
                                 for i in range(300)]
            assert mine[-1] == f"[rank {rank}] no newline at the end"
        assert all(x.startswith("[rank ") for x in lines[:-1])


@pytest.mark.timeout(30)
def test_relay_redraws_a_progress_line_around_other_ranks_lines_on_a_terminal():
    relay, out, _ = _relay(tty=True)
    bar, other = _pipe(relay, 0, "stdout"), _pipe(relay, 1, "stdout")

    def settle() -> None:
        time.sleep(0.3)  # let the pumps copy what was written

    os.write(bar, b"\r\x1b[2K10%")
    settle()
    os.write(other, b"a line\n")
    settle()
    os.write(bar, b"\r\x1b[2K50%")
    settle()
    os.write(bar, b"\r\x1b[2K100%\n")
    os.close(bar)
    os.close(other)
    relay.drain(5)
    erase = "\r\x1b[2K"
    assert out.value().decode() == (
        f"{erase}[rank 0] 10%"                      # drawn in place
        f"{erase}[rank 1] a line\n[rank 0] 10%"     # cleared, the line above, drawn again
        f"{erase}[rank 0] 50%"
        f"{erase}[rank 0] 100%\n")                  # the final state ends the line


def test_terminal_env_only_for_a_terminal():
    assert terminal_env(0, 2, _Terminal(False)) == {}
    env = terminal_env(0, 12, _Terminal(True))
    assert env["TTY_COMPATIBLE"] == "1" and int(env["COLUMNS"]) >= 20
    assert "TTY_COMPATIBLE" not in terminal_env(1, 12, _Terminal(True))


def test_rank_ranges_and_grouping():
    assert rank_ranges([5]) == "rank 5"
    assert rank_ranges([7, 0, 2, 3, 4, 9, 10]) == "ranks 0, 2-4, 7, 9, 10"
    details = {r: "terminated by the launcher after rank 1 failed" for r in range(2, 99)}
    details[0] = "ReplicatorError: peer exited (after rank 1 failed)"
    assert group_by_rank(details) == [
        "rank 0: ReplicatorError: peer exited (after rank 1 failed)",
        "ranks 2-98: terminated by the launcher after rank 1 failed"]
    # Two ranks keep a line each.
    assert group_by_rank({0: "exit code 75", 1: "exit code 75"}) == [
        "rank 0: exit code 75", "rank 1: exit code 75"]


@pytest.mark.timeout(30)
def test_summary_of_99_ranks_groups_the_terminated_ones(tmp_path):
    group = LocalGroup(99, lambda rank, env: None)
    try:
        try:
            raise ValueError("bad value on purpose in rank 1")
        except ValueError as exc:
            record_exception(exc, 1, error_path(group.error_dir, 1))
        codes = {0: 1, 1: 1, **{r: None for r in range(2, 99)}}
        # Stand-ins for processes: no pid, so nothing can ever be signalled.
        group.workers = [WorkerProcess(r, SimpleNamespace(exitcode=c, pid=None))
                         for r, c in codes.items()]
        group.workers[1].detected_at = 1.0
        group.workers[0].detected_at = 2.0
        failure, types = group._failure(0, group.workers[1], list(range(2, 99)))
    finally:
        group.workers = []
        group.close()
    assert failure.rank == 1 and types[:2] == ("ValueError", "Exception")
    text = str(failure)
    assert "ranks 2-98: terminated by the launcher after rank 1 failed" in text
    assert "rank 0: exit code 1 (after rank 1 failed)" in text
    assert "rank 57" not in text and len(text.splitlines()) < 15


def test_restart_policy_reads_the_recorded_exception_type(tmp_path):
    try:
        raise NonFiniteLossError("nan at step 5")
    except NonFiniteLossError as exc:
        record_exception(exc, 0, tmp_path / "e.json")
    err = read_error(tmp_path / "e.json")
    assert err is not None and err.types[0] == "NonFiniteLossError"
    assert restart_refusal(err.types) == ("not restarting: NonFiniteLossError repeats on restart "
                                          "(the restart replays the same steps from the last "
                                          "backup)")
    assert "ModuleNotFoundError repeats" in (restart_refusal(
        ["ModuleNotFoundError", "ImportError", "Exception"]) or "")
    assert restart_refusal(["RuntimeError", "Exception"]) is None
    assert restart_refusal([]) is None  # killed by a signal: no error file, restart


def test_backup_note_is_written_only_under_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("REPLICATOR_ERROR_DIR", raising=False)
    record_backup(tmp_path / "ckpt", 10)
    assert read_backup(tmp_path, range(2)) is None
    monkeypatch.setenv("REPLICATOR_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    record_backup(tmp_path / "ckpt", 20)
    note = read_backup(tmp_path, range(2))
    assert note is not None and note.step == 20 and note.directory == str(tmp_path / "ckpt")


@pytest.mark.parametrize("port", [0, -1, 65536, 80000, True, "29500"])
def test_bad_ports_are_clear_errors(port):
    with pytest.raises(ClusterConfigError, match="HINT"):
        check_port(port)


def test_good_ports_pass():
    assert check_port(None) is None and check_port(29500) == 29500 and check_port(65535) == 65535


def test_oversubscription_warning_says_what_it_costs():
    assert oversubscription_warning(2, 2) is None
    text = oversubscription_warning(8, 2) or ""
    assert "--nproc 8 is more than the 2 CPU core(s)" in text
    assert "slower than with --nproc 2" in text


def test_demo_options_are_parsed_and_passed_on():
    parser, actions = cli._parser()
    args = parser.parse_args(["demo", "--nproc", "3", "--epochs", "2", "--steps", "5"])
    assert args.nproc == 3
    assert cli._demo_argv(args, actions) == ["--epochs", "2", "--steps", "5"]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["demo", "--epoch-count", "2"])
    assert info.value.code == 2


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("replicator 0.1.0 (torch ")


def test_port_errors_exit_with_2_and_a_hint(capsys):
    assert cli.main(["run", "--nproc", "2", "--master-port", "80000", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--master-port 80000 is not a TCP port" in err and "HINT" in err


def test_master_port_from_the_environment_unless_the_flag_is_given(capsys, monkeypatch):
    parser, _ = cli._parser()
    monkeypatch.setenv("MASTER_PORT", "29871")
    assert cli._master_port(parser.parse_args(["run", "--nproc", "2", "x.py"])) == 29871
    flag = parser.parse_args(["run", "--nproc", "2", "--master-port", "29872", "x.py"])
    assert cli._master_port(flag) == 29872
    monkeypatch.setenv("MASTER_PORT", "")
    assert cli._master_port(parser.parse_args(["run", "--nproc", "2", "x.py"])) is None
    monkeypatch.setenv("MASTER_PORT", "twenty")
    assert cli.main(["run", "--nproc", "2", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "MASTER_PORT='twenty' (from the environment) is not a port number" in err
    assert "HINT" in err


@pytest.mark.timeout(60)
def test_a_script_that_vanished_is_recorded_as_not_worth_a_restart(tmp_path):
    env = dict(os.environ, REPLICATOR_ERROR_DIR=str(tmp_path), RANK="0")
    out = subprocess.run([sys.executable, "-m", "replicator.launch.script_entry",
                          str(tmp_path / "gone.py")], env=env, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 1
    err = read_error(error_path(tmp_path, 0))
    assert err is not None and err.type == "ScriptNotFoundError" and "gone.py" in err.message
    assert (restart_refusal(err.types) or "").startswith(
        "not restarting: ScriptNotFoundError repeats on restart")
