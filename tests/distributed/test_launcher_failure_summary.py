"""The launcher's summary of a failed run names the cause first: a rank that finished while
another waited, a parameter server killed before its workers failed, and how to resume."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from replicator.cli import main
from replicator.cluster.worker_errors import BackupNote, WorkerError
from replicator.launch.failure_report import RankEnd, call_site, failure_for, root_of

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture
def replicator(tmp_path, capfd, monkeypatch) -> Callable[[list[str]], subprocess.CompletedProcess]:
    """``replicator(args)``: the command line ``replicator ARGS`` run by its own ``main`` in
    this process (one fresh interpreter fewer; the workers are new processes as always), from
    ``tmp_path`` with the workers' TMPDIR there: its exit code, stdout and stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    def run(args: list[str]) -> subprocess.CompletedProcess:
        capfd.readouterr()
        code = main(args)
        out = capfd.readouterr()
        return subprocess.CompletedProcess(["replicator", *args], code, out.out, out.err)

    return run


@pytest.mark.timeout(180)
def test_a_rank_that_finished_while_the_chief_waited_is_named_as_such(replicator) -> None:
    out = replicator(["run", "--nproc", "2", str(SCRIPTS / "chief_only_reduce.py")])
    assert out.returncode == 1, out.stderr
    # the summary's first line (a host with fewer GPUs than processes prints a note before it)
    first = next(line for line in out.stderr.splitlines() if line.startswith("replicator run:"))
    assert first.startswith("replicator run: rank 0 failed (exit code 1): rank 1 finished its "
                            "script normally (exit code 0) while rank 0 waited for it in "
                            "`reduce` at "), first
    assert "chief_only_reduce.py:10." in first  # the chief-only call, not the shared one
    assert "a collective called on some ranks only" in first and "HINT" in first
    assert "look for that rank's own error" not in first
    assert "rank 1 done" in out.stdout
    # rank 0's own error (its traceback follows the summary) says so too
    own = [line for line in out.stderr.splitlines()
           if line.startswith("replicator.errors.ReplicatorError: ")]
    assert own and "on rank 0 failed because rank 1 finished its script normally (exit code " \
        "0) while rank 0 waited for it" in own[-1], out.stderr
    assert "a collective called on some ranks only" in own[-1] and "HINT" in own[-1]
    assert "look for that rank's own error" not in out.stderr


@pytest.mark.timeout(180)
def test_a_killed_parameter_server_is_the_cause_of_its_workers_errors(replicator) -> None:
    out = replicator(["run", "--nproc", "3", "--num-ps", "1", str(SCRIPTS / "kill_server.py")])
    assert out.returncode == 1, out.stderr
    text = out.stderr
    assert "rank 2 failed (exit code -9): parameter server 0 was killed by SIGKILL" in text, text
    others = text[text.index("Other ranks:"):]
    for rank in (0, 1):
        line = next(ln for ln in others.splitlines() if ln.strip().startswith(f"rank {rank}:"))
        assert "ParameterServerLostError" in line, text
        assert line.endswith("(after parameter server 0 (rank 2) was killed by SIGKILL)"), line
    assert "after rank 0 failed" not in text


def _error(rank: int, message: str, when: float, kind: str = "RuntimeError",
           traceback: str = "") -> WorkerError:
    return WorkerError(rank, kind, message, traceback, when, (kind, "Exception"))


def test_consequences_never_come_before_a_cause_that_was_seen_later() -> None:
    lost = "parameter server 0 (rank 2) is lost with the 1 variable shard(s) it held: w"
    ends = [RankEnd(0, 1, 10.02, WorkerError(0, "ParameterServerLostError", lost, "", 10.0,
                                             ("ParameterServerLostError", "ReplicatorError"))),
            RankEnd(1, 1, 10.02, _error(1, "because another replica exited or lost its "
                                           "connection", 10.01)),
            RankEnd(2, -9, 10.03)]  # seen last: the launcher polls
    assert root_of(ends, first=0).rank == 2
    # a real failure of its own still comes first when it was earlier
    ends.append(RankEnd(3, 1, 9.0, _error(3, "bad value", 9.0)))
    assert root_of(ends, first=0).rank == 3


def test_the_call_site_is_the_users_line_and_the_library_call_it_made() -> None:
    import replicator

    lib = os.path.dirname(replicator.__file__)
    tb = (f'Traceback (most recent call last):\n  File "train.py", line 12, in <module>\n'
          f'    main()\n  File "train.py", line 9, in main\n    strategy.gather(x)\n'
          f'  File "{lib}/strategies/base.py", line 400, in gather\n    return ...\n'
          f'  File "{lib}/comm/collectives.py", line 80, in all_gather\n    ...\n'
          "RuntimeError: boom\n")
    assert call_site(tb) == ("gather", "train.py:9")
    assert call_site("RuntimeError: no frames") is None


def test_a_committed_backup_adds_the_resume_line_unless_a_rerun_repeats_the_failure() -> None:
    note = BackupNote("/ckpt", 40)
    killed = [RankEnd(0, None, None, terminated=True), RankEnd(1, -9, 5.0)]
    failure, _ = failure_for(killed, 1, lambda r: "", note)
    assert str(failure).splitlines()[0] == "rank 1 failed (exit code -9): killed by SIGKILL"
    assert "Rerun the same command to resume from the backup (step 40 in /ckpt)." in \
        str(failure).splitlines()[1]
    assert "terminated by the launcher after rank 1 was killed by SIGKILL" in failure.others[0]
    nan = [RankEnd(0, 1, 5.0, _error(0, "nan at step 41", 5.0, "NonFiniteLossError"))]
    failure, _ = failure_for(nan, 0, lambda r: "", note)
    assert "Rerun" not in str(failure)


@pytest.mark.timeout(180)
def test_a_rank_that_exits_with_a_code_after_background_saves_leaves_at_once(
        tmp_path, replicator) -> None:
    # the background saver's idle writer thread was waited for a full minute when a script
    # ended by sys.exit(code): leaving the process group waits for checkpoint threads, and the
    # writer was told to stop only at interpreter exit, after that wait
    out = replicator(["run", "--nproc", "2", str(SCRIPTS / "fail_after_backups.py"),
                      str(tmp_path / "backup"), "exit"])
    ended = time.time()
    assert out.returncode == 3, out.stderr
    exiting = float(re.search(r"exiting at ([0-9.]+)", out.stderr).group(1))
    assert ended - exiting < 30, f"the run ended {ended - exiting:.0f} s after rank 1 exited"


@pytest.mark.timeout(240)
def test_a_failed_run_leaves_no_trash_and_says_how_to_resume(tmp_path, replicator) -> None:
    for how in ("raise", "kill"):
        backup = tmp_path / f"backup-{how}"
        out = replicator(["run", "--nproc", "2", str(SCRIPTS / "fail_after_backups.py"),
                          str(backup), how])
        assert out.returncode == 1, out.stderr
        lines = out.stderr.splitlines()  # the workers' own warnings come first
        at = next(i for i, ln in enumerate(lines) if ln.startswith("replicator run: "))
        cause = "killed by SIGKILL" if how == "kill" else "RuntimeError: failing on purpose"
        assert lines[at].startswith("replicator run: rank 1 failed") and cause in lines[at], \
            out.stderr
        assert lines[at + 1].startswith("Rerun the same command to resume from the backup "
                                        "(step "), out.stderr
        if how == "raise":  # a SIGKILLed rank cannot clean up; its trash goes at the next start
            names = sorted(p.name for p in backup.iterdir())
            assert "step-00000009" in names and not any(".trash-" in n for n in names), names
