"""`replicator run --replica-groups N`: the launcher side of live recovery on torchft.

Real processes, torchft's real lighthouse on loopback; the script (tests/scripts/
replica_group_env.py) needs no training engine: it records what each process was given.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from replicator.cli import main as cli_main
from replicator.cluster.processes import process_alive
from replicator.errors import LighthouseError
from replicator.launch.lighthouse import (
    Lighthouse,
    LighthouseSettings,
    foreign_replicas,
    seen_group_ids,
    torchft_missing,
    wait_reachable,
)
from replicator.testing import assert_params_close
from tests.helpers import child_processes
from tests.live_helpers import SCRIPT as LIVE_TRAIN
from tests.live_helpers import env as live_env
from tests.live_helpers import one_device

SCRIPT = str(Path(__file__).resolve().parent.parent / "scripts" / "replica_group_env.py")
REPLICATOR = [sys.executable, "-m", "replicator.cli", "run"]

pytestmark = pytest.mark.skipif(torchft_missing() is not None, reason="torchft not installed")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _run(capfd, args: list[str]) -> subprocess.CompletedProcess:
    """``replicator run ARGS`` by the command line's own main in this process (one fresh
    interpreter fewer; the lighthouse and the groups are new processes as always)."""
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONUNBUFFERED", "1")  # as _env() gives the launched command
        code = cli_main(["run", *args])
    out = capfd.readouterr()
    return subprocess.CompletedProcess(REPLICATOR + args, code, out.out, out.err)


def _starts(out: Path) -> list[dict]:
    path = out / "starts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(what: str, condition, timeout: float = 180.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the launcher ended (exit {proc.returncode}) before {what}:\n"
                        f"{out[-2000:]}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _unreachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/status", timeout=5)
    except OSError:
        return True
    return False


@pytest.mark.timeout(300)
def test_each_group_sees_its_id_and_the_lighthouse(tmp_path, capfd):
    res = _run(capfd, ["--replica-groups", "3", "--nproc", "1", "--min-replicas", "2", SCRIPT,
                       str(tmp_path), "exit"])
    assert res.returncode == 0, res.stderr[-3000:]
    starts = _starts(tmp_path)
    assert sorted(int(s["REPLICATOR_REPLICA_GROUP"]) for s in starts) == [0, 1, 2]
    url = starts[0]["REPLICATOR_LIGHTHOUSE"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    for s in starts:
        assert s["REPLICATOR_LIGHTHOUSE"] == s["TORCHFT_LIGHTHOUSE"] == url
        assert s["lighthouse_status"] == 200  # the lighthouse answered while the groups ran
        assert (s["REPLICATOR_REPLICA_GROUPS"], s["REPLICATOR_MIN_REPLICAS"]) == ("3", "2")
        assert (s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) == ("0", "0", "1")
        assert s["MASTER_ADDR"] == s["REPLICATOR_LIVE_BIND"] == "127.0.0.1"
        assert s["REPLICATOR_RESTART_COUNT"] == "0"
    assert len({s["MASTER_PORT"] for s in starts}) == 3  # a rendezvous of its own per group
    for g in range(3):
        assert f"[group {g} rank 0] group {g} rank 0 done" in res.stdout
    assert f"started a torchft lighthouse at {url}" in res.stderr
    assert _unreachable(url)  # stopped with the job


@pytest.mark.timeout(300)
def test_a_killed_group_restarts_alone_and_a_sigtermed_group_leaves(tmp_path):
    proc = subprocess.Popen(REPLICATOR + ["--replica-groups", "3", "--nproc", "1",
                                          "--max-restarts", "1", SCRIPT, str(tmp_path), "wait",
                                          "75"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        _wait_for("3 groups to start", lambda: len(_starts(tmp_path)) == 3, proc=proc)
        first = {int(s["REPLICATOR_REPLICA_GROUP"]): s for s in _starts(tmp_path)}
        os.kill(first[1]["pid"], signal.SIGKILL)
        _wait_for("group 1 to restart", lambda: len(_starts(tmp_path)) == 4, proc=proc)
        again = _starts(tmp_path)[3]
        assert again["REPLICATOR_REPLICA_GROUP"] == "1"
        assert again["REPLICATOR_RESTART_COUNT"] == "1" and again["pid"] != first[1]["pid"]
        assert again["MASTER_PORT"] == first[1]["MASTER_PORT"]  # its own store, kept
        # never restarted
        assert process_alive(first[0]["pid"]) and process_alive(first[2]["pid"])
        # SIGTERM to one group's process alone: it leaves the job (exit 75), not restarted
        os.kill(first[2]["pid"], signal.SIGTERM)
        _wait_for("group 2 to leave", lambda: not process_alive(first[2]["pid"]), proc=proc)
        (tmp_path / "finish").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    starts = _starts(tmp_path)
    assert [s["REPLICATOR_REPLICA_GROUP"] for s in starts].count("0") == 1
    assert [s["REPLICATOR_REPLICA_GROUP"] for s in starts].count("2") == 1
    assert "replica group 1: rank 0 failed (exit code -9): killed by SIGKILL; restarting " \
           "replica group 1 alone (restart 1 of 1)" in err
    assert "replica group 2 left the job" in err
    assert "group 0 rank 0 done" in out and "group 1 rank 0 done" in out


@pytest.mark.timeout(300)
def test_a_lost_group_ends_the_job_with_0_when_the_others_completed_it(tmp_path, capfd):
    # the command of docs/fault_tolerance.md without --max-restarts: group 1 is not restarted;
    # groups 0 and 2 finish, --min-replicas 1 held: the training finished, exit 0, and one
    # line says which group was lost and how to restart it
    res = _run(capfd, ["--replica-groups", "3", "--nproc", "1", "--min-replicas", "1", SCRIPT,
                       str(tmp_path), "die-in-group", "1"])
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if "the training finished" in ln)
    assert line.startswith("[replicator] the training finished on replica group(s) 0, 2 "
                           "(--min-replicas 1 held); replica group(s) 1 were lost: replica "
                           "group 1 failed after 0 restart(s) (--max-restarts 0 per group): "
                           "rank 0 failed (exit code 1): ValueError: bad value on purpose"), line
    assert "HINT: --max-restarts N restarts a lost group alone" in line
    assert [s["REPLICATOR_REPLICA_GROUP"] for s in _starts(tmp_path)].count("1") == 1


@pytest.mark.timeout(300)
def test_a_group_out_of_restarts_fails_the_job_naming_it(tmp_path, capfd):
    # fewer groups than --min-replicas completed: the training did not finish
    res = _run(capfd, ["--replica-groups", "3", "--nproc", "1", "--max-restarts", "1",
                       "--min-replicas", "3", SCRIPT, str(tmp_path), "die-in-group", "1"])
    assert res.returncode == 1, res.stderr[-3000:]
    assert "the training finished" not in res.stderr
    err = res.stderr
    assert "replicator run: replica group 1 failed after 1 restart(s) (--max-restarts 1 per " \
           "group): rank 0 failed (exit code 1): ValueError: bad value on purpose in group 1" \
           in err
    assert [s["REPLICATOR_REPLICA_GROUP"] for s in _starts(tmp_path)].count("1") == 2
    assert "group 0 rank 0 done" in res.stdout and "group 2 rank 0 done" in res.stdout


@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_reaches_every_group(tmp_path):
    proc = subprocess.Popen(REPLICATOR + ["--replica-groups", "2", "--nproc", "1", SCRIPT,
                                          str(tmp_path), "wait", "75"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        _wait_for("2 groups to start", lambda: len(_starts(tmp_path)) == 2, proc=proc)
        url = _starts(tmp_path)[0]["REPLICATOR_LIGHTHOUSE"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # both groups left at a step boundary with 75, as the live engine does: the launcher too
    assert proc.returncode == 75, err[-3000:]
    left = [json.loads(line) for line in (tmp_path / "left.jsonl").read_text().splitlines()]
    assert sorted(entry["group"] for entry in left) == [0, 1]
    assert "received SIGTERM: asking every replica group to leave" in err
    assert "replicator run: the job received SIGTERM: replica group(s) 0, 1 left at a step " \
           "boundary (exit code 75)" in err
    assert len(_starts(tmp_path)) == 2  # nothing was restarted
    assert _unreachable(url)


def _main(args: list[str], capsys) -> tuple[int, str]:
    """``replicator run ARGS`` in this process (for errors raised before any process starts)."""
    code = cli_main(["run", *args])
    return code, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_busy_lighthouse_port_is_a_clear_error(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        code, err = _main(["--replica-groups", "2", "--nproc", "1", "--lighthouse-bind",
                           f"127.0.0.1:{port}", SCRIPT, str(tmp_path), "exit"], capsys)
    finally:
        sock.close()
    assert code == 2, err
    assert f"port {port} on 127.0.0.1 is already in use, so the lighthouse cannot listen " \
           "there" in err
    assert "Traceback" not in err and not _starts(tmp_path)


@pytest.mark.timeout(60)
def test_without_torchft_replica_groups_say_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` fails as if absent
    assert torchft_missing() is not None
    code, err = _main(["--replica-groups", "2", "--nproc", "1", SCRIPT, str(tmp_path), "exit"],
                      capsys)
    assert code == 2
    assert "--replica-groups needs torchft" in err
    assert "pip install 'replicator[live]'" in err
    assert not _starts(tmp_path)


@pytest.mark.timeout(60)
def test_inconsistent_replica_group_flags_are_refused(tmp_path, capsys):
    for args, words in (
            (["--replica-groups", "3", "--min-replicas", "4"], "--min-replicas 4 is more than "
             "--replica-groups 3"),
            (["--min-replicas", "2"], "--min-replicas needs --replica-groups N"),
            (["--join", "127.0.0.1:1", "--lighthouse", "127.0.0.1:1"], "--join and "
             "--lighthouse both name a running lighthouse"),
            (["--replica-groups", "2", "--num-ps", "1"], "--num-ps does not combine with "
             "--replica-groups"),
            (["--replica-groups", "2", "--lighthouse", "nohost"], "has no port"),
            (["--replica-groups", "2", "--heartbeat-timeout", "0"], "--heartbeat-timeout must "
             "be a number of seconds > 0")):
        code, err = _main(args + ["--nproc", "1", SCRIPT, str(tmp_path), "exit"], capsys)
        assert code == 2, (args, err)
        assert words in err, (args, err)
    assert not _starts(tmp_path)


@pytest.mark.timeout(60)
def test_an_unreachable_lighthouse_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(LighthouseError, match=rf"the lighthouse at http://127.0.0.1:{port} "
                       r"\(--join\) did not answer within 1 s"):
        wait_reachable(f"http://127.0.0.1:{port}", 1.0, "--join")


@pytest.mark.timeout(120)
def test_joining_groups_get_ids_the_lighthouse_has_not_seen(tmp_path):
    """A real torchft Manager heartbeats as replica group 4; the ids read back from the
    lighthouse's status page are what --join counts from."""
    lighthouse = Lighthouse(settings=LighthouseSettings(join_timeout=1.0))
    url = lighthouse.start()
    manager = subprocess.Popen([sys.executable, "-c", _MANAGER, url], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        _wait_for("a quorum", lambda: "replicator_group_4:" in urllib.request.urlopen(
            url + "/status", timeout=5).read().decode(), proc=None, timeout=90)
        page = urllib.request.urlopen(url + "/status", timeout=5).read().decode()
        assert seen_group_ids(page) == {4} and not foreign_replicas(page)
        assert foreign_replicas(page.replace("replicator_group_4", "someone_else"))
    finally:
        manager.kill()
        manager.communicate()
        lighthouse.stop()
    assert not lighthouse.alive() and _unreachable(url)


_MANAGER = """
import sys, time, torch.distributed as dist
from datetime import timedelta
from torchft import Manager, ProcessGroupGloo
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
            load_state_dict=lambda s: None, state_dict=lambda: {}, lighthouse_addr=sys.argv[1],
            replica_id="replicator_group_4", rank=0, world_size=1, store_addr="127.0.0.1",
            store_port=store.port, hostname="127.0.0.1", timeout=timedelta(seconds=10))
m.start_quorum()
time.sleep(60)
"""


@pytest.mark.timeout(600)
def test_live_training_under_the_launcher_heals_a_killed_group_and_equals_one_device(tmp_path):
    """The launcher with the live engine: 2 groups train (--min-replicas 2: in step), group 1
    is SIGKILLed after step 5, the launcher restarts it alone, it heals from group 0, and both
    end equal to one device."""
    args = ["--samples", "240", "--epochs", "3", "--hold-at-step", "5", "--hold-for", "go"]
    reference = one_device(tmp_path, args)
    out = tmp_path / "groups"
    out.mkdir()
    env = dict(_env(), **live_env())
    proc = subprocess.Popen(REPLICATOR + ["--replica-groups", "2", "--nproc", "1",
                                          "--min-replicas", "2", "--max-restarts", "1",
                                          str(LIVE_TRAIN), "--out",
                                          str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        held = [out / f"progress_g{g}.txt" for g in (0, 1)]
        _wait_for("both groups to reach step 5", lambda: all(
            p.exists() and p.read_text() == "5" for p in held), timeout=300, proc=proc)
        victim = int((out / "pid_g1.txt").read_text())  # group 1's only process
        os.kill(victim, signal.SIGKILL)
        (out / "go").touch()
        out_text, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert "restarting replica group 1 alone (restart 1 of 1)" in err
    assert "replica group 1, rank 0 healed from a live peer" in err + out_text
    for g in (0, 1):
        got = torch.load(out / f"final_g{g}.pt")
        assert_params_close(reference, got, atol=1e-5, label=f"group {g}: ")


@pytest.mark.timeout(300)
def test_a_lighthouse_that_dies_stops_the_job_with_its_name(tmp_path):
    proc = subprocess.Popen(REPLICATOR + ["--replica-groups", "2", "--nproc", "1",
                                          "--max-restarts", "3", SCRIPT, str(tmp_path), "wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        _wait_for("2 groups to start", lambda: len(_starts(tmp_path)) == 2, proc=proc)
        lighthouse = [pid for pid, cmd in child_processes(proc.pid)
                      if "torchft_lighthouse" in cmd]
        assert len(lighthouse) == 1, child_processes(proc.pid)
        os.kill(lighthouse[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    assert "the lighthouse exited (exit code -9); stopping every replica group" in err
    assert "replicator run: error: the lighthouse at http://127.0.0.1:" in err
    assert "no quorum can form without it" in err
    assert len(_starts(tmp_path)) == 2  # the groups were stopped, not restarted
    assert not any(process_alive(s["pid"]) for s in _starts(tmp_path))
